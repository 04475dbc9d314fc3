"""GGUF: the embedded SmolLM2 Q4_1 file, plus a tiny F32 llama written here with GGUFWriter.

The SmolLM2 file converts once per test session (~7 s) into a temporary LOOM_CACHE_DIR;
loom's model of it and transformers' own GGUF reading of it load once per module.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from loom import envs
from loom.model_loader import get_model, gguf_loader
from loom.models.llama import rope_settings
from loom.transformers_utils.config import default_model_path
from loom.transformers_utils.tokenizer import get_tokenizer
from model_utils import greedy_generate, make_config, run_prefill

SMOLLM2 = default_model_path()  # the default model is a test dependency: missing is an error
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
    return gguf_loader.ensure_gguf_cache(SMOLLM2)


# ---- SmolLM2 -------------------------------------------------------------------------
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


def test_cache_is_written_and_reused(smollm2_cache, cache_root, monkeypatch):
    assert smollm2_cache.startswith(os.path.join(cache_root, "gguf"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "tensors.json", "source.json"):
        assert os.path.isfile(os.path.join(smollm2_cache, name)), name
    assert not [f for f in os.listdir(os.path.dirname(smollm2_cache)) if f.startswith(".tmp-")]

    def no_conversion(*args):
        raise AssertionError("a warm cache must not convert again")

    monkeypatch.setattr(gguf_loader, "_convert", no_conversion)
    assert gguf_loader.ensure_gguf_cache(SMOLLM2) == smollm2_cache
    assert gguf_loader.load_gguf_config(SMOLLM2).hidden_size == 576
    assert gguf_loader.get_gguf_tokenizer(SMOLLM2).decode([1]) == "<|im_start|>"


def _dequantize_q4_1(tensor) -> np.ndarray:
    """ggml's Q4_1 written out, independent of the gguf package: blocks of 32 weights, each an
    f16 scale d, an f16 minimum m and 16 bytes of nibbles q; w[j] = d * (q[j] & 15) + m and
    w[j + 16] = d * (q[j] >> 4) + m."""
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (B, 1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 4:]  # (B, 16)
    nibbles = np.concatenate([q & 0x0F, q >> 4], axis=1).astype(np.float32)  # (B, 32)
    return (d * nibbles + m).reshape(tuple(int(n) for n in reversed(tensor.shape.tolist())))


def _checkpoint_view(model) -> dict[str, torch.Tensor]:
    """loom's weights under checkpoint names: the fused qkv / gate_up projections split back."""
    cfg = model.config
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {}
    for name, tensor in model.state_dict().items():
        if ".qkv_proj." in name:
            for part, piece in zip("qkv", tensor.split([q_rows, kv_rows, kv_rows])):
                out[name.replace(".qkv_proj.", f".{part}_proj.")] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate", "up"), tensor.chunk(2)):
                out[name.replace(".gate_up_proj.", f".{part}_proj.")] = piece
        else:
            out[name] = tensor
    return out


@pytest.fixture(scope="module")
def smollm2_model(smollm2_cache):
    """loom's model of the default GGUF file (through the conversion cache), fp32, TP 1."""
    return get_model(make_config(SMOLLM2))


@pytest.fixture(scope="module")
def smollm2_reference():
    """transformers' own reading of the same file: its GGUF dequantization and Q/K un-permutation."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(SMOLLM2), gguf_file=os.path.basename(SMOLLM2),
                                                dtype=torch.float32).eval()


def test_every_weight_matches_transformers_gguf_loader(smollm2_model, smollm2_reference):
    ours = _checkpoint_view(smollm2_model)
    theirs = smollm2_reference.state_dict()
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))[:5]
    assert len(theirs) == 2 + 9 * 30 + 1  # embed, norm, lm_head (tied), 9 tensors x 30 layers
    for name, want in theirs.items():
        # both sides dequantize Q4_1/Q8_0 blocks to fp32 with the same arithmetic: exact
        torch.testing.assert_close(ours[name], want, atol=0, rtol=0, msg=name)


def test_q4_1_weights_match_a_hand_written_dequantizer(smollm2_model):
    """The Q4_1 tensors of one layer, decoded here from the file's bytes and permuted back the
    way llama.cpp's converter did: the model's Q/K rows must be the HF (NeoX-half) order."""
    from gguf import GGUFReader

    ours = _checkpoint_view(smollm2_model)
    tensors = {t.name: t for t in GGUFReader(SMOLLM2).tensors}
    heads = {"attn_q": 9, "attn_k": 3}
    for kind, hf in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                     ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                     ("ffn_down", "mlp.down_proj")):
        tensor = tensors[f"blk.7.{kind}.weight"]
        assert tensor.tensor_type.name == "Q4_1"
        got = ours[f"model.layers.7.{hf}.weight"].numpy()
        if kind in heads:
            got = _permute(got, heads[kind])  # llama.cpp's convert_hf_to_gguf permutation
        np.testing.assert_array_equal(got, _dequantize_q4_1(tensor), err_msg=kind)


def test_logits_match_transformers_gguf_model(smollm2_model, smollm2_reference):
    tok = gguf_loader.get_gguf_tokenizer(SMOLLM2)
    prompt = tok(QUESTION)["input_ids"]
    (got,) = run_prefill(smollm2_model, [prompt])
    with torch.inference_mode():
        want = smollm2_reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_greedy_answer_is_paris(smollm2_model):
    config = make_config(SMOLLM2)
    assert config.model_config.model_format == "gguf"
    tok = get_tokenizer(config.model_config)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                   add_generation_prompt=True)
    out = greedy_generate(smollm2_model, tok(text)["input_ids"], max_new_tokens=8)
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


def random_k_blocks(rows: int, cols: int, type_name: str, seed: int) -> np.ndarray:
    """Raw Q4_K or Q6_K super-blocks (``(rows, bytes)`` uint8) of random codes, scales and mins with
    fp16 super-block scales of a weight-like size: the ``gguf`` package cannot quantize to
    K-quants, and a model only needs the file's values to be what both load paths read."""
    rng = np.random.default_rng(seed)
    size, fields = {"Q4_K": (144, ((0, 2e-4), (2, 1e-3))), "Q6_K": (210, ((208, 3e-5),))}[type_name]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for offset, magnitude in fields:
        halves = rng.uniform(0.5, 1.5, blocks.shape[:2]).astype(np.float16) * np.float16(magnitude)
        blocks[..., offset:offset + 2] = halves[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def _write_tiny_gguf(path: str, hf_model, arch: str = "llama", quant=None) -> None:
    """``quant(gguf_name)``: the GGML type to store a 2-D tensor as (None: F32); K-quants hold
    :func:`random_k_blocks` instead of the model's weights."""
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
        qtype = quant(gname) if quant is not None and w.ndim == 2 else None
        if qtype is not None and qtype.name in ("Q4_K", "Q6_K"):
            writer.add_tensor(gname, random_k_blocks(*w.shape, qtype.name, len(gname)), raw_dtype=qtype)
        elif qtype is not None:
            writer.add_tensor(gname, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
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


def test_fp32_weights_are_written_only_when_asked_for(tiny_gguf, tmp_path, monkeypatch):
    """The conversion writes metadata; the dequantized fp32 weights (eight times a 4-bit file)
    appear on the first ``--quantization none`` load, atomically, and are then reused."""
    path, hf = tiny_gguf
    cache = gguf_loader.ensure_gguf_cache(path, str(tmp_path))
    assert {"config.json", "source.json", "tensors.json", "tokenizer.json"} <= set(os.listdir(cache))
    assert "model.safetensors" not in os.listdir(cache)
    weights = gguf_loader.gguf_weights_file(path, str(tmp_path))
    assert weights == os.path.join(cache, "model.safetensors") and not [f for f in os.listdir(cache) if ".tmp-" in f]
    from safetensors.numpy import load_file  # here: only this test reads safetensors directly

    assert set(load_file(weights)) == set(hf.state_dict())

    def no_rewrite(*args):
        raise AssertionError("written weights must be reused")

    monkeypatch.setattr(gguf_loader, "_write_safetensors", no_rewrite)
    assert gguf_loader.gguf_weights_file(path, str(tmp_path)) == weights


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
