"""LoRA adapters through the OpenAI server: a request's ``model`` names an adapter, ``/v1/models``
lists them with their parent, adapters load and unload at runtime, resolvers find unknown names,
and every broken adapter or unknown name gets OpenAI's error shape while the server keeps serving.

Adapters here are written by hand (config + safetensors), so each broken variant is exact; their
tokens are checked against ``loom.LLM`` with the same adapter (the peft equality is tests/test_lora.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from loom import LLM, SamplingParams, envs
from loom.config.server import LoRAModulePath
from loom.engine.arg_utils import EngineArgs
from loom.engine.inproc import InprocAsyncLLM
from loom.entrypoints.openai import build_app
from loom.lora.resolvers import filesystem
from loom_plugin_api import LoRARequest
from loom_plugin_api.lora import LoRAResolver, lora_resolver_registry
from safetensors.torch import save_file
from server_thread import ServerThread
from test_openai_server import TEMPLATE, _build_tiny_llama, _gpt2_tokenizer

BASE = "tiny-llama"
DIMS = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
        "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def make_adapter(path: Path, targets=tuple(DIMS), r: int = 4, alpha: int = 8, seed: int = 0, **config) -> Path:
    """A PEFT-format LoRA adapter of the tiny Llama with random A and B on both layers."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for t in targets:
            d_in, d_out = DIMS[t]
            part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, d_in, generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, r, generator=g) * 0.3
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
                "task_type": "CAUSAL_LM", **config}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return _build_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in (("sql", 1), ("poet", 2), ("fs-a", 3), ("fs-b", 4)):
        make_adapter(root / name, seed=seed)
    make_adapter(root / "rank16", r=16)
    make_adapter(root / "wide", r=4)
    (root / "wide" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "c_fc"]}))
    make_adapter(root / "nofile")
    (root / "nofile" / "adapter_model.safetensors").unlink()
    make_adapter(root / "truncated")
    weights = root / "truncated" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    make_adapter(root / "ints")
    _rewrite_header(root / "ints", lambda entry: {**entry, "dtype": "I32"})
    make_adapter(root / "elsewhere")
    _rewrite_header(root / "elsewhere", None, rename=lambda key: key.replace("model.model.layers", "model.layers"))
    return root


def _rewrite_header(path: Path, edit, rename=lambda key: key) -> None:
    """Change the entries (or names) of an adapter's safetensors header, keeping the data."""
    import struct

    weights = path / "adapter_model.safetensors"
    raw = weights.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    header = {rename(k): (v if edit is None or k == "__metadata__" else edit(v)) for k, v in header.items()}
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


@pytest.fixture(scope="module")
def expected(model_path, adapter_dir) -> dict[str, list[int]]:
    """Greedy tokens of the prompt through loom.LLM: the base model and each adapter."""
    llm = LLM(str(model_path), dtype="float32", max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    names = ["sql", "poet", "fs-a", "fs-b"]
    params = SamplingParams(**GREEDY)
    outs = llm.generate([PROMPT] * 5, params, lora_request=[None, *(
        LoRARequest(n, i, str(adapter_dir / n)) for i, n in enumerate(names, start=1))])
    llm.shutdown()
    return {k: o.outputs[0].token_ids for k, o in zip(["base", *names], outs)}


@pytest.fixture(scope="module")
def server(model_path, adapter_dir):
    """Adapters on, runtime loading on, ``sql`` loaded at start-up."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        envs._disable_envs_cache_for_tests()
        client = InprocAsyncLLM.from_engine_args(EngineArgs(
            model=str(model_path), served_model_name=BASE, dtype="float32", max_model_len=256, enable_lora=True,
            max_loras=2, max_lora_rank=8, max_cpu_loras=2))
        client.tokenizer.chat_template = TEMPLATE
        app = build_app(client, BASE, endpoint_plugins={},
                        lora_modules=[LoRAModulePath("sql", str(adapter_dir / "sql"))])
        envs._disable_envs_cache_for_tests()
    with ServerThread(app) as srv:
        yield srv
    asyncio.run(client.shutdown())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def completion_text(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, extra_body={"ignore_eos": True}, temperature=0.0,
                                     max_tokens=8).choices[0].text


def test_models_lists_the_base_and_each_adapter_with_its_parent(client, server):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "sql"}
    assert cards["sql"].model_extra["parent"] == BASE and cards[BASE].model_extra["parent"] is None
    assert "/" not in cards["sql"].root  # no server path shown


def test_a_request_naming_an_adapter_runs_with_it(client, expected):
    tok = _gpt2_tokenizer()
    want = {k: tok.decode(v) for k, v in expected.items()}
    assert want["sql"] != want["base"]
    assert completion_text(client, "sql") == want["sql"]
    assert completion_text(client, BASE) == want["base"]
    chunks = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], stream=True,
                                            temperature=0.0, max_tokens=4)
    assert {c.model for c in chunks} == {"sql"}


def _error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] is not None and error["type"]
    for word in words:
        assert word in error["message"], error["message"]


def test_unknown_model_is_a_404_in_openai_shape(server):
    r = post(server, "/v1/completions", {"model": "nobody", "prompt": PROMPT, "max_tokens": 2})
    _error(r, 404, "`nobody` does not exist", "sql")
    assert r.json()["error"]["code"] == "model_not_found"


def test_load_serve_unload_at_runtime(server, client, adapter_dir, expected):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(adapter_dir / "poet")})
    assert r.status_code == 200 and "poet" in r.text
    assert {m.id for m in client.models.list().data} == {BASE, "sql", "poet"}
    assert completion_text(client, "poet") == _gpt2_tokenizer().decode(expected["poet"])
    _error(post(server, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(adapter_dir / "poet")}),
           400, "already loaded")
    _error(post(server, "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": str(adapter_dir / "poet")}),
           400, "base model's name")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "poet"}).status_code == 200
    _error(post(server, "/v1/completions", {"model": "poet", "prompt": PROMPT, "max_tokens": 2}), 404, "poet")
    _error(post(server, "/v1/unload_lora_adapter", {"lora_name": "poet"}), 404, "not loaded")
    # loaded again: a new id, the same tokens
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(adapter_dir / "poet")}) \
        .status_code == 200
    assert completion_text(client, "poet") == _gpt2_tokenizer().decode(expected["poet"])
    post(server, "/v1/unload_lora_adapter", {"lora_name": "poet"})


@pytest.mark.parametrize("name, words", [
    ("rank16", ["rank 16 is above --max-lora-rank 8"]),
    ("wide", ["target module 'c_fc' is not one the model has"]),
    ("nofile", ["adapter_model.safetensors is missing"]),
    ("absent", ["is not a directory"]),
    ("truncated", ["a truncated or damaged file"]),
    ("ints", ["is I32; adapters hold F32, F16 or BF16 weights"]),
    ("elsewhere", ["names module 'layers.0.", "which is not where this model has its"]),
])
def test_a_broken_adapter_is_a_400_naming_the_problem(server, client, adapter_dir, expected, name, words):
    _error(post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir / name)}),
           400, *words)
    assert name not in {m.id for m in client.models.list().data}
    assert completion_text(client, "sql") == _gpt2_tokenizer().decode(expected["sql"])  # still serving


class Counting(LoRAResolver):
    def __init__(self, inner: LoRAResolver) -> None:
        self.inner, self.calls = inner, []

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        self.calls.append((base_model_name, lora_name))
        await asyncio.sleep(0.2)  # concurrent requests for the name arrive while it resolves
        return await self.inner.resolve_lora(base_model_name, lora_name)


class Broken(LoRAResolver):
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        if lora_name == "explode":
            raise RuntimeError("hub unreachable")
        return None


@pytest.fixture
def resolvers(adapter_dir):
    counting = Counting(filesystem.FilesystemResolver(str(adapter_dir)))
    lora_resolver_registry.register_resolver("test-broken", Broken())
    lora_resolver_registry.register_resolver("test-fs", counting)
    yield counting
    lora_resolver_registry.unregister_resolver("test-broken")
    lora_resolver_registry.unregister_resolver("test-fs")


def test_resolvers_find_an_unknown_name_once_for_concurrent_requests(server, client, resolvers, expected):
    async def many() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as ac:
            outs = await asyncio.gather(*(ac.completions.create(
                model="fs-a", prompt=PROMPT, temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})
                for _ in range(6)))
        return [o.choices[0].text for o in outs]

    texts = asyncio.run(many())
    assert texts == [_gpt2_tokenizer().decode(expected["fs-a"])] * 6
    assert resolvers.calls == [(BASE, "fs-a")]  # one resolution; the other requests waited for it
    assert "fs-a" in {m.id for m in client.models.list().data}
    assert completion_text(client, "fs-b") == _gpt2_tokenizer().decode(expected["fs-b"])
    post(server, "/v1/unload_lora_adapter", {"lora_name": "fs-a"})
    post(server, "/v1/unload_lora_adapter", {"lora_name": "fs-b"})


def test_resolver_refusals_and_failures(server, resolvers):
    for name in ("../sql", "..", "nobody", "rank16"):  # escapes, unknown, and found but broken
        r = post(server, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 2})
        if name == "rank16":
            _error(r, 400, "rank 16 is above --max-lora-rank 8")
        else:
            _error(r, 404, "does not exist")
    _error(post(server, "/v1/completions", {"model": "explode", "prompt": PROMPT, "max_tokens": 2}), 500,
           "'test-broken' failed", "hub unreachable")


def test_without_runtime_updating_there_are_no_load_routes_and_no_resolving(model_path, adapter_dir, resolvers):
    envs._disable_envs_cache_for_tests()
    client = InprocAsyncLLM.from_engine_args(EngineArgs(model=str(model_path), served_model_name=BASE,
                                                        dtype="float32", max_model_len=256))
    envs._disable_envs_cache_for_tests()
    with ServerThread(build_app(client, BASE, endpoint_plugins={})) as srv:
        _error(post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_dir / "sql")}), 404)
        _error(post(srv, "/v1/completions", {"model": "fs-a", "prompt": PROMPT, "max_tokens": 2}), 404)
    assert resolvers.calls == []
    with pytest.raises(ValueError, match="--enable-lora"):
        build_app(client, BASE, endpoint_plugins={}, lora_modules=[LoRAModulePath("sql", str(adapter_dir / "sql"))])
    asyncio.run(client.shutdown())


def test_filesystem_resolver_registers_only_for_a_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("LOOM_LORA_RESOLVER_CACHE_DIR", raising=False)
    envs._disable_envs_cache_for_tests()
    filesystem.register()
    assert filesystem.RESOLVER_NAME not in lora_resolver_registry.get_supported_resolvers()
    monkeypatch.setenv("LOOM_LORA_RESOLVER_CACHE_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not a directory"):
        filesystem.register()
    monkeypatch.setenv("LOOM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))
    try:
        filesystem.register()
        filesystem.register()  # idempotent
        assert lora_resolver_registry.get_supported_resolvers().count(filesystem.RESOLVER_NAME) == 1
    finally:
        lora_resolver_registry.unregister_resolver(filesystem.RESOLVER_NAME)
    resolver = filesystem.FilesystemResolver(str(tmp_path))
    (tmp_path / "link").symlink_to(tmp_path.parent)
    assert [resolver.adapter_dir(n) for n in ("..", ".", "a/b", "", "link")] == [None] * 4 + [None]
    assert resolver.adapter_dir("ok") == str(tmp_path.resolve() / "ok")
