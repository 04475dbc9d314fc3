"""Hostile input against a real ``loom serve``: every case is refused with a 4xx in OpenAI's error
shape before any work is done for it, while innocent streams running beside it finish unharmed,
``/health`` keeps answering and the front end's memory stays bounded."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import pytest
from serve_utils import serving

pytestmark = pytest.mark.usefixtures("every_installed_plugin")

MAX_MODEL_LEN = 256
BODY_LIMIT = 1 << 20
HUGE = 1180591620717411303424  # 2**70

# (endpoint, body, status, the field the error names or None, a piece of the message)
COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
CASES = [
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "n": HUGE}, 400, "n", "the limit is 128"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "n": 2**40}, 400, "n", "the limit is 128"),
    (COMPLETION, {"prompt": ["a"] * 100, "max_tokens": 1, "n": 2}, 400, "n", "200 completions"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "top_k": 2**63}, 400, "top_k", "vocabulary size"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "top_k": 2**64}, 400, "top_k", "vocabulary size"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [2**63]}, 400,
     "stop_token_ids", "outside the vocabulary"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [99999999]}, 400, "stop_token_ids",
     "outside the vocabulary"),
    (COMPLETION, {"prompt": [[1, 2], [2**64]], "max_tokens": 1}, 400, "prompt", "outside the vocabulary"),
    (COMPLETION, {"prompt": [-1, 5], "max_tokens": 1}, 400, "prompt", "outside the vocabulary"),
    (COMPLETION, {"prompt": "hi", "max_tokens": HUGE}, 400, "max_tokens", "maximum context length"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "min_tokens": HUGE}, 400, "min_tokens",
     "maximum context length"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "seed": 2**64}, 400, None, "seed must be in"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "logprobs": 2**70}, 400, None, "logprobs must be in [0, 20]"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, None,
     "logprobs must be in [0, 20]"),
    (COMPLETION, {"prompt": "\ud800", "max_tokens": 1}, 400, "prompt", "lone surrogate"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 1}, 400, "messages",
     "lone surrogate"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}], "max_tokens": 1},
     400, "messages", "lone surrogate"),
    (COMPLETION, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    (COMPLETION, {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", "valid integer"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "stream": "yes"}, 400, "stream", "valid boolean"),
    (COMPLETION, {"prompt": [True], "max_tokens": 1}, 400, "prompt", "valid"),
    (COMPLETION, b'{"prompt": "hi", "max_tokens": 1, "temperature": Infinity}', 400, "temperature", "finite"),
    (COMPLETION, b'{"prompt": "hi", "max_tokens": 1, "top_p": NaN}', 400, "top_p", "finite"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "stop": ["x"] * 10_000}, 400, "stop", "the limit is 64"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 1, "stop": "x" * 100_000}, 400, "stop", "the limit is 1024"),
    (COMPLETION, {"prompt": "hi " * 200_000, "max_tokens": 1}, 400, "prompt", "maximum context length"),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * 200_000}], "max_tokens": 1}, 400, "messages",
     "maximum context length"),
    (COMPLETION, {"prompt": "x" * (BODY_LIMIT + 1), "max_tokens": 1}, 413, None, "--max-request-body-bytes"),
]


def _reference(url: str, prompt: str) -> str:
    r = httpx.post(url + COMPLETION, json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                           "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _innocent_stream(url: str, prompt: str) -> tuple[str, str | None, bool]:
    text, finish, done = [], None, False
    with httpx.stream("POST", url + COMPLETION, timeout=300, json={
            "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
                finish = event["choices"][0]["finish_reason"] or finish
    return "".join(text), finish, done


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.fixture(scope="module")
def hostile_server(tiny_llama, tmp_path_factory):
    with serving([str(tiny_llama), "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
                  "--max-request-body-bytes", str(BODY_LIMIT)], tmp_path_factory.mktemp("hostile")) as serve:
        yield serve


def test_hostile_requests_are_refused_and_innocent_streams_finish(hostile_server):
    url = hostile_server.url
    frontend = hostile_server.child_pids()["frontend"]
    prompts = ["The capital of France is", "One two three four", "Hello, my name is", "Once upon a time"]
    expected = [_reference(url, p) for p in prompts]
    rss_before = _rss_mib(frontend)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        innocent = [pool.submit(_innocent_stream, url, p) for p in prompts]
        for path, body, status, param, piece in CASES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: \ud800 escaped
            started = time.monotonic()
            r = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
            case = f"{path} {str(body)[:120]}"
            assert r.status_code == status, (case, r.text[:300])
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, case
            assert piece in error["message"], (case, error)
            if param is not None:
                assert error["param"] == param, (case, error)
            assert "cmpl-" not in error["message"], case  # nothing of another request
            assert time.monotonic() - started < 10, case  # refused before any work, not after it
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        results = [f.result(timeout=300) for f in innocent]
    for (text, finish, done), want in zip(results, expected):
        assert (text, finish, done) == (want, "length", True)
    assert _rss_mib(frontend) - rss_before < 300, "the front end grew on refused requests"
    assert httpx.head(url + "/health", timeout=5).status_code == 200


def test_health_answers_while_a_large_body_is_read_and_refused(hostile_server):
    url = hostile_server.url
    body = b'{"max_tokens": 1, "prompt": "' + b"word " * (BODY_LIMIT // 5 - 10) + b'"}'
    assert len(body) <= BODY_LIMIT
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, url + COMPLETION, content=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
        for _ in range(5):
            started = time.monotonic()
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - started < 2
        r = big.result()
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(hostile_server):
    def chunks():  # no Content-Length: the server counts the bytes as they come
        yield b'{"max_tokens": 1, "prompt": "'
        for _ in range(BODY_LIMIT // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(hostile_server.url + COMPLETION, content=chunks(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413, r.text[:300]
    assert f"has more than {BODY_LIMIT} bytes" in r.json()["error"]["message"]
    assert httpx.get(hostile_server.url + "/health", timeout=5).status_code == 200


def test_the_model_path_is_accepted_but_never_shown(hostile_server, tiny_llama):
    url, path = hostile_server.url, str(tiny_llama)
    models = httpx.get(url + "/v1/models", timeout=5)
    assert [m["id"] for m in models.json()["data"]] == [tiny_llama.name]
    assert path not in models.text
    r = httpx.post(url + COMPLETION, json={"model": path, "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == tiny_llama.name, r.text[:300]
    r = httpx.post(url + COMPLETION, json={"model": "other", "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 404 and path not in r.text and tiny_llama.name in r.json()["error"]["message"]
