"""``loom serve --startup-trace`` end to end: one Chrome trace with a track per process of the
serve, nested spans, and a READY span that ends when the server starts answering ``/health``."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import time

import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import pytest
from loom import LLM
from serve_utils import Serve, get, start_serve

pytestmark = pytest.mark.usefixtures("every_installed_plugin")


def _tracks(doc):
    """``{pid: (process name, {tid: thread name}, [complete events])}``."""
    tracks = {}
    for e in doc["traceEvents"]:
        entry = tracks.setdefault(e["pid"], ["?", {}, []])
        if e["name"] == "process_name":
            entry[0] = e["args"]["name"]
        elif e["name"] == "thread_name":
            entry[1][e["tid"]] = e["args"]["name"]
        elif e["ph"] == "X":
            entry[2].append(e)
    return tracks


def _check_nesting(events):
    by_thread = {}
    for e in events:
        by_thread.setdefault(e["tid"], []).append(e)
    for spans in by_thread.values():
        stack = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + 1e-3:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1]["ts"] + stack[-1]["dur"] + 1e-3, \
                f"{e['name']!r} overlaps {stack[-1]['name']!r} without nesting in it"
            stack.append(e)


def test_serve_writes_one_trace_with_every_process(tiny_llama, tmp_path):
    out = tmp_path / "startup.json"
    launched = time.monotonic()
    proc, url = start_serve([str(tiny_llama), "--tensor-parallel-size", "2", "--max-model-len", "256",
                             "--startup-trace", str(out)], tmp_path / "serve.log")
    serve = Serve(proc, url, tmp_path / "serve.log")
    try:
        while True:
            assert proc.poll() is None, serve.log[-4000:]
            assert time.monotonic() - launched < 180, serve.log[-4000:]
            with contextlib.suppress(OSError):
                if get(url + "/health", timeout=2)[0] == 200:
                    break
            time.sleep(0.02)
        to_health = time.monotonic() - launched
        deadline = time.monotonic() + 30
        while "start-up trace written" not in serve.log and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = serve.child_pids()
        log = serve.log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    doc = json.loads(out.read_text())  # parses
    tracks = _tracks(doc)
    names = {name: pid for pid, (name, _, _) in tracks.items()}
    assert {"cli", "frontend", "engine_core", "worker:0", "worker:1"} <= set(names), names
    for role in ("frontend", "engine_core", "worker:0", "worker:1"):
        assert names[role] == pids[role]  # the track is the real process
    cli_threads = set(tracks[names["cli"]][1].values())
    assert {f"supervisor: {r}" for r in ("frontend", "engine_core", "worker:0", "worker:1")} <= cli_threads
    for name, _, events in tracks.values():
        assert events, f"{name} has no spans"
        _check_nesting(events)
    spans = {(name, e["name"]) for name, _, events in tracks.values() for e in events}
    for role in ("frontend", "engine_core", "worker:0", "worker:1"):
        assert (role, "interpreter start and imports") in spans and (role, "resolve platform") in spans
    for expected in [("cli", "build config"), ("cli", "platform hook check_and_update_config"),
                     ("worker:0", "load weights"), ("worker:1", "initialize_cache"),
                     ("engine_core", "load tokenizer"), ("frontend", "start the HTTP server"),
                     ("cli", "wait for HELLO"), ("cli", "CONFIG → READY")]:
        assert expected in spans, expected
    assert any(name == "cli" and s.startswith("import plugin ") for name, s in spans)
    ready = next(e for e in tracks[names["cli"]][2] if e["name"] == "cli: loom serve: start-up until READY")
    ready_end_s = (ready["ts"] + ready["dur"]) / 1e6
    assert abs(ready_end_s - to_health) <= 0.05 * to_health, (ready_end_s, to_health)
    # the two lines at ready: the trace's summary, and what serves where
    line = re.search(r"loom: start-up trace written to (\S+) .*: ready in ([\d.]+) s; longest steps: (.+)", log)
    assert line and line[1] == str(out) and abs(float(line[2]) - ready_end_s) < 0.01
    assert len(line[3].split("), ")) == 3
    assert re.search(r"Ready in [\d.]+ s: model \S+ \(LlamaForCausalLM\), platform \w+, \w+, TP 2, "
                     r"KV cache [\d,]+ tokens; serving at http://127\.0\.0\.1:\d+ \(chat page at /\)", log), log[-3000:]


def test_llm_writes_its_own_trace(tiny_llama, tmp_path, capsys):
    out = tmp_path / "llm.json"
    llm = LLM(str(tiny_llama), max_model_len=128, startup_trace=out)
    llm.shutdown()
    tracks = _tracks(json.loads(out.read_text()))
    ((name, _, events),) = tracks.values()
    assert name == "llm"
    _check_nesting(events)
    root = max(events, key=lambda e: e["dur"])
    assert root["name"] == "llm: LLM() start-up until ready" and root["ts"] == 0
    assert {"load_model", "load weights", "initialize_cache", "build config"} <= {e["name"] for e in events}
    assert "start-up trace written to" in capsys.readouterr().out
