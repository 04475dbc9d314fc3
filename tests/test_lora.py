"""LoRA adapters through ``loom.LLM``: greedy tokens equal HF transformers with the same adapter
applied by ``peft`` (fp32), for Llama and OPT, one rank and two, in batches that mix two adapters
and the base model; the prefix cache never serves one adapter's KV to another; bad adapters and
misuse fail with a message that names the problem."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import pytest
from loom import LLM, SamplingParams
from loom_plugin_api import LoRARequest
from lora_utils import LLAMA_TARGETS, OPT_TARGETS, build_adapter, hf_greedy
from serve_utils import serving

pytestmark = pytest.mark.usefixtures("every_installed_plugin")

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40)]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tiny_opt, models_dir) -> dict[str, tuple[Path, Path]]:
    """Per model: a rank-8 adapter on every projection, and a rank-4 one on q/k/v only."""
    return {
        "llama": (build_adapter(tiny_llama, models_dir / "llama-lora-a", LLAMA_TARGETS, r=8, seed=1),
                  build_adapter(tiny_llama, models_dir / "llama-lora-b", LLAMA_TARGETS[:3], r=4, alpha=8, seed=2)),
        "opt": (build_adapter(tiny_opt, models_dir / "opt-lora-a", OPT_TARGETS, r=8, seed=3),
                build_adapter(tiny_opt, models_dir / "opt-lora-b", OPT_TARGETS[:3], r=4, alpha=8, seed=4)),
    }


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_mixed_batch_equals_peft_on_one_rank_and_two(kind, tiny_llama, tiny_opt, adapters):
    base = tiny_llama if kind == "llama" else tiny_opt
    a, b = adapters[kind]
    want = {name: hf_greedy(base, path, PROMPTS, MAX_TOKENS) for name, path in (("base", None), ("a", a), ("b", b))}
    assert want["a"] != want["base"] and want["b"] != want["base"]  # the adapters change the tokens
    loras = {"base": None, "a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}
    # one batch: every prompt under every adapter and the base model, interleaved
    order = [(name, i) for i in range(len(PROMPTS)) for name in ("a", "base", "b")]
    prompts = [{"prompt_token_ids": PROMPTS[i]} for _, i in order]
    for tp in (1, 2):
        llm = LLM(str(base), dtype="float32", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8,
                  tensor_parallel_size=tp)
        got = llm.generate(prompts, GREEDY, lora_request=[loras[name] for name, _ in order])
        llm.shutdown()
        for (name, i), out in zip(order, got):
            assert out.outputs[0].token_ids == want[name][i], f"tp={tp} {name} prompt {i}"


def test_prefix_cache_is_keyed_by_adapter(tiny_llama, adapters):
    """A long prompt run under adapter a, then under b and the base model (its blocks cached in
    between): each equals its own reference, so no block computed under a served the others."""
    a, b = adapters["llama"]
    prompt = list(range(100, 164))  # 4 full blocks of 16
    want = {name: hf_greedy(tiny_llama, path, [prompt], MAX_TOKENS)[0] for name, path in
            (("base", None), ("a", a), ("b", b))}
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8)
    ra, rb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    for name, lora in (("a", ra), ("b", rb), ("base", None), ("a", ra)):
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=lora)[0]
        assert out.outputs[0].token_ids == want[name], name
    # the second run under a hit its own blocks: the cache works, it is only keyed
    assert llm.llm_engine.block_manager.prefix_hits >= 48
    llm.shutdown()


def test_more_adapters_than_max_loras_all_finish_with_their_own_tokens(tiny_llama, adapters):
    a, b = adapters["llama"]
    want_a = hf_greedy(tiny_llama, a, PROMPTS, MAX_TOKENS)
    want_b = hf_greedy(tiny_llama, b, PROMPTS, MAX_TOKENS)
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8,
              max_cpu_loras=1)  # one slot and one loaded adapter: every switch reloads from disk
    ra, rb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(2)]
    loras = [ra, rb] * len(PROMPTS)
    got = llm.generate(prompts, GREEDY, lora_request=loras)
    llm.shutdown()
    for k, out in enumerate(got):
        want = (want_a if k % 2 == 0 else want_b)[k // 2]
        assert out.outputs[0].token_ids == want


def _broken(tmp_path: Path, good: Path, name: str, edit) -> Path:
    path = tmp_path / name
    path.mkdir()
    for f in good.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    edit(path)
    return path


def _set_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_bad_adapters_and_misuse_are_refused_with_the_reason(tiny_llama, adapters, tmp_path):
    a, _ = adapters["llama"]
    off = LLM(str(tiny_llama), dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="--enable-lora"):
        off.generate("hi", GREEDY, lora_request=LoRARequest("a", 1, str(a)))
    off.shutdown()
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=8)
    cases = {
        "rank 16 is above --max-lora-rank 8": _broken(tmp_path, a, "rank16", lambda p: _set_config(p, r=16)),
        "adapter_model.safetensors is missing": _broken(tmp_path, a, "nofile",
                                                        lambda p: (p / "adapter_model.safetensors").unlink()),
        "target module 'c_attn' is not one the model has": _broken(
            tmp_path, a, "module", lambda p: _set_config(p, target_modules=["q_proj", "c_attn"])),
        "r must be a positive integer": _broken(tmp_path, a, "rank0", lambda p: _set_config(p, r=0)),
        "peft_type is 'IA3'": _broken(tmp_path, a, "ia3", lambda p: _set_config(p, peft_type="IA3")),
        "is not a directory": tmp_path / "absent",
    }
    for k, (message, path) in enumerate(cases.items(), start=1):
        with pytest.raises(ValueError, match=message):
            llm.generate("hi", GREEDY, lora_request=LoRARequest(f"bad{k}", k, str(path)))
    # a rank-2 adapter whose r in the config does not match its tensors
    small = build_adapter(tiny_llama, tmp_path / "small", ["q_proj"], r=2, seed=5)
    lying = _broken(tmp_path, small, "lying", lambda p: _set_config(p, r=3))
    with pytest.raises(ValueError, match=r"has shape \[2, 64\]; rank 3 on this model needs \[3, 64\]"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("lying", 50, str(lying)))
    ok = LoRARequest("small", 51, str(small))
    llm.generate("hi", GREEDY, lora_request=ok)
    with pytest.raises(ValueError, match="LoRA id 51 already names adapter 'small'"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("other", 51, str(a)))
    # the engine still serves, adapters and the base model alike
    assert len(llm.generate(["hi", "there"], GREEDY, lora_request=[ok, None])) == 2
    llm.shutdown()


def _served_tokens(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_loom_serve_with_adapters_on_two_ranks_and_a_resolver(tiny_llama, adapters, tmp_path):
    """The flags through the real serve: adapters from --lora-modules and from the filesystem
    resolver plugin (its entry point, in the front end's process) run on two worker processes."""
    a, b = adapters["llama"]
    resolvable = tmp_path / "adapters"
    resolvable.mkdir()
    shutil.copytree(b, resolvable / "found")  # a copy: a symlink leading out of the directory is refused
    want = {name: hf_greedy(tiny_llama, path, PROMPTS[1:], MAX_TOKENS) for name, path in
            (("base", None), ("a", a), ("found", b))}
    args = [str(tiny_llama), "--dtype", "float32", "--max-model-len", "128", "-tp", "2", "--served-model-name",
            "base", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a={a}"]
    env = {"LOOM_ALLOW_RUNTIME_LORA_UPDATING": "1", "LOOM_LORA_RESOLVER_CACHE_DIR": str(resolvable)}
    with serving(args, tmp_path, env) as serve:
        for name in ("a", "base", "found"):
            assert [_served_tokens(serve.url, name, p) for p in PROMPTS[1:]] == want[name], name
        models = httpx.get(serve.url + "/v1/models", timeout=10).json()["data"]
        assert {(m["id"], m["parent"]) for m in models} == {("base", None), ("a", "base"), ("found", "base")}
        r = httpx.post(serve.url + "/v1/completions", json={"model": "../adapters", "prompt": "x"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("extra, message", [
    (["--lora-modules", "a=/nonexistent"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/nonexistent"], "'/nonexistent' is not a directory"),
    (["--enable-lora", "--lora-modules", "oops"], "expected NAME=PATH"),
])
def test_loom_serve_refuses_bad_lora_modules_before_starting(tiny_llama, tmp_path, extra, message):
    proc = subprocess.run([sys.executable, "-m", "loom.entrypoints.cli.main", "serve", str(tiny_llama), *extra],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "loom-supervisor" not in proc.stderr  # nothing was spawned


def test_an_adapter_a_worker_cannot_load_fails_its_requests_and_is_refused_after(tiny_llama, adapters, tmp_path):
    """An adapter whose files change after it was first loaded: the reload (after an eviction)
    fails that request alone, and the engine refuses its id from then on, with the reason."""
    a, b = adapters["llama"]
    moving = tmp_path / "moving"
    shutil.copytree(a, moving)
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8,
              max_cpu_loras=1)
    rm, rb = LoRARequest("moving", 1, str(moving)), LoRARequest("b", 2, str(b))
    llm.generate("hi", GREEDY, lora_request=rm)
    llm.generate("hi", GREEDY, lora_request=rb)  # evicts "moving" from the worker
    config = moving / "adapter_config.json"
    config.write_text(config.read_text() + " ")  # another version under the same id
    with pytest.raises(Exception, match="changed since it was first loaded"):
        llm.generate("hi", GREEDY, lora_request=rm)
    with pytest.raises(ValueError, match="cannot be loaded.*load it under a new name"):
        llm.generate("hi", GREEDY, lora_request=rm)
    assert len(llm.generate(["hi", "ho"], GREEDY, lora_request=[rb, None])) == 2  # the rest goes on
    llm.shutdown()


def test_a_runner_that_drops_the_adapters_is_an_error_not_base_tokens(tiny_llama, adapters, monkeypatch):
    from loom_plugin_api import ModelRunner, set_forward_context

    def run_model_without_lora(self, inputs):  # a platform runner written before LoRA existed
        with set_forward_context(inputs.attn_metadata):
            return self.model(inputs.input_ids, inputs.positions)

    monkeypatch.setattr(ModelRunner, "run_model", run_model_without_lora)
    a, _ = adapters["llama"]
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=8)
    assert len(llm.generate("hi", GREEDY)) == 1  # no adapter in the step: fine
    with pytest.raises(Exception, match="must pass ModelInput.lora_mapping to set_forward_context"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("a", 1, str(a)))
    llm.shutdown()
