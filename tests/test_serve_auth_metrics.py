"""``loom serve --api-key`` and ``/metrics`` in a real process tree.

One serve takes the key as a flag (and is also where /metrics values are checked across
processes: the front end counts, the engine core's stats arrive over IPC); one takes it
from ``LOOM_API_KEY`` alone. Neither may show the key on any child's command line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import Serve, serving, thread_cpus

FLAG_KEY = "sk-flag-6f1e2d"
ENV_KEY = "sk-env-93ab07"
IGNORE_EOS = {"ignore_eos": True}
UNAUTHORIZED = {"error": {"message": "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'",
                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


# the serves inherit this environment: every installed plugin, the detected platform, no key
pytestmark = pytest.mark.usefixtures("every_installed_plugin_no_key")


@pytest.fixture(scope="module")
def flag_serve(tiny_llama, tmp_path_factory) -> Iterator[Serve]:
    args = [str(tiny_llama), "--max-model-len", "256", "--api-key", FLAG_KEY]
    with serving(args, tmp_path_factory.mktemp("flag_serve")) as serve:
        yield serve


@pytest.fixture(scope="module")
def env_serve(tiny_llama, tmp_path_factory) -> Iterator[Serve]:
    args = [str(tiny_llama), "--max-model-len", "256"]
    with serving(args, tmp_path_factory.mktemp("env_serve"), env={"LOOM_API_KEY": ENV_KEY}) as serve:
        yield serve


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def check_key_stays_off_command_lines(serve: Serve, key: str) -> None:
    children = serve.child_pids()
    assert set(children) == {"frontend", "engine_core", "worker:0"}, serve.log
    below = descendants(serve.proc.pid)
    assert set(children.values()) <= set(below)
    for pid in below:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline, f"pid {pid}: {cmdline!r}"
    # Only the front end checks keys; the other processes do not get it at all.
    for name, pid in children.items():
        has_key = key.encode() in Path(f"/proc/{pid}/environ").read_bytes()
        assert has_key == (name == "frontend"), name


def check_auth(serve: Serve, model: str, key: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
        r = httpx.post(serve.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
                       headers=headers, timeout=30)
        assert (r.status_code, r.json()) == (401, UNAUTHORIZED), headers
        r = httpx.get(serve.url + "/v1/models", headers=headers, timeout=30)
        assert (r.status_code, r.json()) == (401, UNAUTHORIZED), headers
    assert httpx.get(serve.url + "/health", timeout=30).status_code == 200
    assert httpx.get(serve.url + "/metrics", timeout=30).status_code == 200
    wrong = openai.OpenAI(base_url=serve.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    right = openai.OpenAI(base_url=serve.url + "/v1", api_key=key, max_retries=0, timeout=60)
    assert [m.id for m in right.models.list().data] == [Path(model).name]  # the served name, not the path
    r = right.completions.create(model=model, prompt="Hello", max_tokens=2, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 2


def test_a_small_models_worker_is_left_unbound(flag_serve, tiny_llama) -> None:
    """A small model's worker (mostly one Python thread) keeps every core the serve has, as the
    front end and the engine core do (test_default_model.py has a real model's, bound)."""
    r = httpx.post(flag_serve.url + "/v1/completions", json={"model": str(tiny_llama), "prompt": "Hello",
                   "max_tokens": 2}, headers={"Authorization": f"Bearer {FLAG_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text  # the worker's parallel regions ran: its OpenMP threads exist
    cores = os.sched_getaffinity(0)
    for name, pid in flag_serve.child_pids().items():
        assert all(c == cores for c in thread_cpus(pid)), name


def test_api_key_flag(flag_serve, tiny_llama) -> None:
    check_auth(flag_serve, str(tiny_llama), FLAG_KEY)
    check_key_stays_off_command_lines(flag_serve, FLAG_KEY)


def test_api_key_from_the_environment_only(env_serve, tiny_llama) -> None:
    check_auth(env_serve, str(tiny_llama), ENV_KEY)
    assert ENV_KEY.encode() not in Path(f"/proc/{env_serve.proc.pid}/cmdline").read_bytes()
    check_key_stays_off_command_lines(env_serve, ENV_KEY)


def scrape(url: str, model: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value}": value}`` for ``model``'s samples, histogram buckets left out."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.labels.get("model_name") == model and "le" not in s.labels:
                others = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                values[f"{s.name}{{{others}}}"] = s.value
    return values


def test_metrics_count_known_requests_across_processes(flag_serve, tiny_llama) -> None:
    model = str(tiny_llama)
    client = openai.OpenAI(base_url=flag_serve.url + "/v1", api_key=FLAG_KEY, max_retries=0, timeout=60)
    before = scrape(flag_serve.url, tiny_llama.name)  # labelled with the served name
    client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=3, extra_body=IGNORE_EOS)
    client.completions.create(model=model, prompt=[9, 10, 11, 12, 13, 14], max_tokens=2, n=2,
                              temperature=0.7, extra_body=IGNORE_EOS)
    stream = client.completions.create(model=model, prompt=[15, 16], max_tokens=5, stream=True,
                                       extra_body=IGNORE_EOS)
    for _ in stream:  # to its end
        pass
    after = scrape(flag_serve.url, tiny_llama.name)
    got = {k: after[k] - before.get(k, 0.0) for k in after}
    assert {k: got[k] for k in (
        "loom:prompt_tokens_total{}", "loom:generation_tokens_total{}",
        "loom:request_success_total{finished_reason=length}", "loom:time_to_first_token_seconds_count{}",
        "loom:e2e_request_latency_seconds_count{}",
    )} == {
        "loom:prompt_tokens_total{}": 4 + 6 + 2,
        "loom:generation_tokens_total{}": 3 + 2 * 2 + 5,
        "loom:request_success_total{finished_reason=length}": 4,  # one per completion
        "loom:time_to_first_token_seconds_count{}": 3,  # one per request
        "loom:e2e_request_latency_seconds_count{}": 3,
    }
    # The engine core's stats (over IPC): every request has ended, every block is free again.
    assert after["loom:num_requests_running{}"] == 0
    assert after["loom:num_requests_waiting{}"] == 0
    assert after["loom:kv_cache_usage_perc{}"] == 0
