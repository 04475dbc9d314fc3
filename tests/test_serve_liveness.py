"""A process of a serve that stops answering (SIGSTOP, a frozen VM) is found, not waited on:
the supervisor reports it like a death, the clients get an error naming it, the serve exits
non-zero and nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import pytest
from serve_utils import alive, serving

pytestmark = pytest.mark.usefixtures("every_installed_plugin")


@pytest.mark.parametrize("role", ["engine_core", "worker:0", "frontend"])
def test_a_stopped_process_is_reported_as_not_responding(tiny_llama, tmp_path, role):
    with serving([str(tiny_llama), "--max-model-len", "256", "--heartbeat-timeout", "3", "--grace-period", "1"],
                 tmp_path) as serve:
        pids = serve.child_pids()
        events = []
        if role == "frontend":  # its clients hang with it, no process is left to answer them
            os.kill(pids[role], signal.SIGSTOP)
            stopped_at = time.monotonic()
        else:  # a stream in flight, to see what its client is told
            body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                os.kill(pids[role], signal.SIGSTOP)
                stopped_at = time.monotonic()
                events = [first, *(line for line in lines if line.startswith("data: "))]
        code = serve.wait(timeout=60)
        took = time.monotonic() - stopped_at
    log = serve.log
    assert code != 0, log[-3000:]
    assert f"{role} (pid {pids[role]}) is not responding: no heartbeat for 3 s (process state: T (stopped))" in log, \
        log[-3000:]
    assert took < 20, f"found after {took:.1f} s"
    if events:
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert role in error["message"] and "not responding" in error["message"], error
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [name for name, p in pids.items() if alive(p)]
