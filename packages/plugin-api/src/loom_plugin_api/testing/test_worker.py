"""Worker tier: the platform's worker on tiny Llama and OPT checkpoints built by the kit.

A fresh interpreter (``_worker_driver``) drives the lifecycle the engine drives: init,
load, profile (``determine_available_memory``), allocate the KV cache, run steps (a chunked
prefill next to a full one, then decodes), shut down. Its greedy tokens must equal HF
transformers' on the same checkpoint, and it must exit leaving no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from ..platform import Platform
from ._platform import PlatformUnderTest
from ._processes import group_alive
from ._tiny_models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.worker

NEW_TOKENS = 8
STAGES = [
    "config",
    "init",
    "load_model",
    "determine_available_memory",
    "initialize_cache",
    "execute_model",
    "shutdown",
]


@pytest.fixture(scope="module", params=["llama", "opt"])
def worker_run(
    request: pytest.FixtureRequest,
    platform_cls: type[Platform],
    loom_platform_under_test: PlatformUnderTest,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict:
    if not loom_platform_under_test.device_present:
        pytest.skip(f"needs the device: {loom_platform_under_test.error}")
    if "float32" not in platform_cls.supported_dtypes:
        pytest.skip(
            f"{platform_cls.__qualname__}.supported_dtypes does not declare float32 (the HF reference's)"
        )
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"worker-{kind}")
    model = build_tiny_model(tmp / "model", kind)
    g = torch.Generator().manual_seed(1)
    prompts = {
        "chunked": torch.randint(3, 259, (21,), generator=g).tolist(),
        "short": torch.randint(3, 259, (6,), generator=g).tolist(),
    }
    spec = {"prompts": prompts, "chunk": 12, "new_tokens": NEW_TOKENS, "eos_token_id": 2}
    (tmp / "spec.json").write_text(json.dumps(spec))
    events = tmp / "events.jsonl"
    argv = ["-m", "loom_plugin_api.testing._worker_driver", str(model), str(tmp / "spec.json"), str(events)]
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "LOOM_PLATFORM": loom_platform_under_test.name})
    try:
        log = proc.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
    left = group_alive(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    lines = events.read_text().splitlines() if events.exists() else []
    return {
        "kind": kind,
        "events": [json.loads(line) for line in lines],
        "log": log,
        "returncode": proc.returncode,
        "left": left,
        "expected": {r: hf_greedy(model, p, NEW_TOKENS) for r, p in prompts.items()},
    }


def _stage(run: dict, name: str) -> dict:
    for event in run["events"]:
        if event["stage"] == name:
            if not event["ok"]:
                pytest.fail(f"{run['kind']}: stage {name} raised {event['error']}\n{event['traceback']}")
            return event
    done = [e["stage"] for e in run["events"]]
    pytest.fail(
        f"{run['kind']}: stage {name} never ran (stages done: {done}; exit {run['returncode']}):\n"
        f"{run['log'][-3000:]}"
    )


def test_lifecycle(worker_run: dict) -> None:
    for name in STAGES:
        _stage(worker_run, name)


def test_greedy_tokens_equal_hf_transformers(worker_run: dict) -> None:
    tokens = _stage(worker_run, "execute_model")["tokens"]
    for req, expected in worker_run["expected"].items():
        if tokens[req] != expected:
            how = "prefilled in two chunks" if req == "chunked" else "one prefill"
            pytest.fail(
                f"{worker_run['kind']}: request {req!r} ({how}) sampled {tokens[req]} greedily; "
                f"HF transformers (float32) gives {expected}. Check the "
                "worker's attention (cached prefix, block table) and ops against the ops and attention tiers"
            )


def test_shutdown_leaves_no_process(worker_run: dict) -> None:
    children = _stage(worker_run, "shutdown")["children"]
    if children:
        pytest.fail(
            f"{worker_run['kind']}: after shutdown() the worker process still has children {children}: "
            "shutdown must stop every process the worker started"
        )
    if worker_run["returncode"] != 0 or worker_run["left"]:
        pytest.fail(
            f"{worker_run['kind']}: the worker process exited {worker_run['returncode']}"
            f"{' and left processes in its group' if worker_run['left'] else ''}:\n"
            f"{worker_run['log'][-2000:]}"
        )
