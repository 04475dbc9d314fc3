"""The embedded default model (SmolLM2-135M-Instruct, GGUF) answers a real question."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from loom import LLM, SamplingParams
from loom.engine import launch
from serve_utils import serving, thread_cpus


def test_default_model_knows_paris():
    llm = LLM(dtype="float32")  # pinned: on a CPU with native bf16, auto would pick bfloat16
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    text = out[0].outputs[0].text
    assert "Paris" in text, text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_default_model_knows_paris_in_bf16(expected_platform):
    """The README's example in the dtype ``auto`` gives on a CPU with native bf16. The CPU
    platform's kernels keep the answer (its bf16 prefill attention rounds P where torch's flash
    kernel does; with P in fp32 this prompt drifted to another answer from the first token, as
    bf16 answers do at near-ties: bench/quant_agreement.py). The dummy platform's reference ops
    round differently and drift, so there the model has only to answer."""
    llm = LLM(dtype="bfloat16")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    text = out[0].outputs[0].text
    if expected_platform == "cpu":
        assert "Paris" in text, text
    else:
        assert text.strip(), text


@pytest.mark.parametrize(("cpu_bf16", "dtype"), [("1", "bfloat16"), ("0", "float32")])
def test_cli_generate_with_default_model(cpu_bf16, dtype):
    """``dtype`` auto: the GGUF model loads into bf16 where the CPU computes it natively
    (``LOOM_CPU_BF16`` stands for the CPU's flags), into fp32 elsewhere, and answers either way."""
    proc = subprocess.run(
        [sys.executable, "-m", "loom.entrypoints.cli.main", "generate", "What is the capital of France?",
         "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "LOOM_CPU_BF16": cpu_bf16, "LOOM_LOGGING_LEVEL": "INFO"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"dtype auto resolved to {dtype}: LOOM_CPU_BF16={cpu_bf16}" in proc.stderr, proc.stderr[-3000:]
    assert f", {dtype}) from " in proc.stderr, proc.stderr[-3000:]  # "Loaded ARCH (CLASS, DTYPE) from ..."
    assert proc.stdout.strip(), proc.stderr[-3000:]
    if dtype == "float32":
        # In bf16 the answer depends on the platform's ops: the CPU platform says Paris, the dummy
        # platform's reference ops round differently and drift to another answer.
        assert "Paris" in proc.stdout


def test_cli_generate_with_an_int8_kv_cache(expected_platform):
    """``--kv-cache-dtype int8`` reaches the workers through the CLI. On the CPU platform the 8-bit
    cache keeps the answer (and holds about twice the tokens in the same memory); a platform whose
    attention backend keeps no 8-bit cache (the dummy platform's) refuses it at start-up, naming the flag."""
    proc = subprocess.run(
        [sys.executable, "-m", "loom.entrypoints.cli.main", "generate", "What is the capital of France?",
         "--max-tokens", "24", "--dtype", "bfloat16", "--kv-cache-dtype", "int8"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "LOOM_LOGGING_LEVEL": "INFO"},
    )
    if expected_platform == "cpu":
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "K/V in int8" in proc.stderr, proc.stderr[-3000:]
        assert "Paris" in proc.stdout, proc.stdout
    else:
        assert proc.returncode != 0, proc.stdout
        assert "--kv-cache-dtype int8 is not supported here" in proc.stderr, proc.stderr[-3000:]


def test_serving_the_default_model_binds_the_workers_threads_to_cores(tmp_path, monkeypatch):
    """``loom serve`` of the default model (a real model's width): the launcher binds the lone
    worker's OpenMP threads one to a (physical) core; the front end and the engine core keep every
    core."""
    for name in (*launch.OPERATOR_CHOICE, "LOOM_CPU_BIND"):  # an operator's choice leaves them unbound
        monkeypatch.delenv(name, raising=False)
    cores = os.sched_getaffinity(0)
    physical = {frozenset(core) for core in launch.physical_cores(list(cores))}
    with serving(["--max-model-len", "256"], tmp_path) as serve:
        r = httpx.post(serve.url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello",
                       "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text  # the worker's parallel regions ran: its OpenMP threads exist
        children = serve.child_pids()
        threads = {frozenset(c) for c in thread_cpus(children["worker:0"])}
        assert threads <= physical, threads
        assert len(threads) > 1 or len(physical) == 1, threads  # not all on one core
        for name in ("frontend", "engine_core"):
            assert all(c == cores for c in thread_cpus(children[name])), name
