"""Every platform hook is called in the process, the number of times and the order that its
docstring in ``loom_plugin_api.Platform`` specifies, observed in a ``--tensor-parallel-size 2``
serve through a probe platform (hook_probe.py) that records each call with its pid and role.

The probe is selected explicitly (LOOM_PLUGINS, LOOM_PLATFORM), so the test runs the same in
an environment where another out-of-tree platform is installed.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import hook_probe
import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import openai
import pytest
from fake_dist import write_fake_dist
from loom_plugin_api import Platform
from serve_utils import serving

ROLES = ("cli", "frontend", "engine_core", "worker:0", "worker:1")
WORKERS = ("worker:0", "worker:1")
CONFIG_HOOKS = ("validate_environ", "apply_config_platform_defaults", "check_and_update_config")


@pytest.fixture(scope="module")
def calls(tiny_llama, tmp_path_factory) -> list[dict]:
    """The probe's records of one TP=2 serve: start, one completion, SIGTERM."""
    root = tmp_path_factory.mktemp("hook_probe")
    write_fake_dist(root / "site", "loom-hook-probe",
                    {"loom.platform_plugins": {"hook_probe": "hook_probe:hook_probe_platform"}},
                    "hook_probe", Path(hook_probe.__file__).read_text())
    log = root / "calls.jsonl"
    env = {
        "LOOM_HOOK_PROBE_LOG": str(log),
        "LOOM_PLUGINS": "hook_probe",  # no other platform or general plugin that is installed
        "LOOM_PLATFORM": "hook_probe",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "site"), os.environ.get("PYTHONPATH")])),
    }
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LOOM_CPU_KVCACHE_SPACE", "LOOM_ATTENTION_BACKEND"):  # the workers ask the platform
            mp.delenv(name, raising=False)
        with serving([str(tiny_llama), "--tensor-parallel-size", "2", "--max-model-len", "128", "--seed", "7"],
                     root, env=env) as serve:
            client = openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0)
            r = client.completions.create(model=str(tiny_llama), prompt="Hi", max_tokens=2,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 2
            pids = serve.child_pids()
            cli_pid = serve.proc.pid
        assert serve.proc.returncode == 0, serve.log[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for rec in records:  # each role is the process the supervisor says it is
        assert rec["pid"] == (cli_pid if rec["role"] == "cli" else pids[rec["role"]]), rec
    return records


def hooks_in(calls: list[dict], role: str) -> list[str]:
    return [c["hook"] for c in calls if c["role"] == role]


def test_the_probe_records_every_hook_of_the_contract():
    hooks = {name for name, value in vars(Platform).items() if isinstance(value, classmethod)}
    assert hooks == set(hook_probe.HOOKS)


def test_every_process_resolves_the_probe(calls):
    assert {c["role"] for c in calls if c["hook"] == "detector"} == set(ROLES)


def test_config_hooks_run_once_in_the_cli_process_only(calls):
    cli = hooks_in(calls, "cli")
    for hook in CONFIG_HOOKS:
        assert cli.count(hook) == 1, (hook, cli)
        assert [c["role"] for c in calls if c["hook"] == hook] == ["cli"], hook
    # validate_environ right after the device config; defaults before the platform's last word
    assert [h for h in cli if h in CONFIG_HOOKS] == list(CONFIG_HOOKS)


def test_pre_register_and_update_sees_the_parser_then_the_config(calls):
    pre = [c["detail"] for c in calls if c["hook"] == "pre_register_and_update"]
    assert {c["role"] for c in calls if c["hook"] == "pre_register_and_update"} == {"cli"}
    assert pre.count("none") == 1 and pre.count("parser") >= 1
    cli = [(c["hook"], c["detail"]) for c in calls if c["role"] == "cli"]
    assert cli.index(("pre_register_and_update", "none")) < cli.index(("validate_environ", None))
    assert max(i for i, c in enumerate(cli) if c == ("pre_register_and_update", "parser")) < \
        cli.index(("pre_register_and_update", "none"))


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_hooks_run_in_each_worker_in_order(calls, worker):
    hooks = hooks_in(calls, worker)
    once = ("register_triton_kernel_overrides", "set_device", "seed_everything", "get_device_communicator_cls",
            "update_block_size_for_backend", "get_device_available_memory")
    counts = Counter(hooks)
    for hook in once:
        assert counts[hook] == 1, (hook, hooks)
    assert counts["get_attn_backend_cls"] >= 1  # once per distinct argument set: one model, one backend
    order = [h for h in hooks if h in (*once, "get_attn_backend_cls")]
    first = {h: order.index(h) for h in set(order)}
    # overrides before any worker code; the device before the seed and the TP group; the
    # backend while the model is built, the block size after it, the memory for the KV cache last
    assert first["register_triton_kernel_overrides"] == 0
    assert first["set_device"] < first["seed_everything"] < first["get_device_communicator_cls"]
    assert first["get_device_communicator_cls"] < first["get_attn_backend_cls"]
    assert first["get_attn_backend_cls"] < first["update_block_size_for_backend"]
    assert first["update_block_size_for_backend"] < first["get_device_available_memory"]
    seeds = [c["detail"] for c in calls if c["role"] == worker and c["hook"] == "seed_everything"]
    assert seeds == [7]
    assert [c["detail"] for c in calls if c["role"] == worker and c["hook"] == "set_device"] == ["cpu"]


@pytest.mark.parametrize("worker", WORKERS)
def test_the_runtime_drives_the_worker_lifecycle_in_order(calls, worker):
    """Each lifecycle call once and in the order loom_plugin_api.worker specifies (a step per
    EXECUTE), the block size settled between loading and measuring, shutdown on SIGTERM last."""
    seen = [h for h in hooks_in(calls, worker) if h.startswith("worker.") or h == "update_block_size_for_backend"]
    steps = seen.count("worker.execute_model")
    assert steps >= 2, seen  # a prefill and a decode step at least
    assert [h for h in seen if h != "worker.execute_model"] == [
        "worker.init_device", "worker.load_model", "update_block_size_for_backend",
        "worker.determine_available_memory", "worker.get_kv_cache_block_bytes", "worker.initialize_cache",
        "worker.shutdown"]
    assert seen[-steps - 1:-1] == ["worker.execute_model"] * steps  # every step after the cache, before shutdown


def test_worker_hooks_run_in_workers_only(calls):
    worker_hooks = ("register_triton_kernel_overrides", "set_device", "seed_everything", "get_attn_backend_cls",
                    "get_device_communicator_cls", "update_block_size_for_backend",
                    "get_device_available_memory", "get_device_total_memory")
    # The CLI asks for the two class names once, to validate them before anything is spawned.
    named = ("get_attn_backend_cls", "get_device_communicator_cls")
    for hook in worker_hooks:
        allowed = {*WORKERS, "cli"} if hook in named else set(WORKERS)
        assert {c["role"] for c in calls if c["hook"] == hook} <= allowed, hook
    assert Counter(c["hook"] for c in calls if c["role"] == "cli" and c["hook"] in named) == dict.fromkeys(named, 1)


def test_frontend_and_engine_core_call_no_hook(calls):
    for role in ("frontend", "engine_core"):
        assert hooks_in(calls, role) == ["detector"] * hooks_in(calls, role).count("detector"), role

