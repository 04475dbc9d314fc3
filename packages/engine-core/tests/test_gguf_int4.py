"""``--quantization gguf``: GGUF's Q4_0/Q4_1 blocks kept as int4 through torch's CPU int4 matmul.

Each check compares the int4 path with the same quantized weights dequantized and run through
the dense path: the block decoding exactly, one matmul per dtype, a tiny llama written as GGUF
with both formats (logits), and the embedded SmolLM2 file (greedy tokens and the chat answer).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from loom.layers import quantized
from loom.layers.quantized import Int4Weight
from loom.model_loader import get_model
from loom.model_loader.gguf_quant import dequantize_int4, dequantize_q8_0, split_int4_blocks
from loom.transformers_utils.tokenizer import get_tokenizer
from model_utils import greedy_generate, make_config, run_prefill, tp_prefill_worker
from test_gguf import QUESTION, SMOLLM2, _write_tiny_gguf, cache_root  # noqa: F401 (its module-wide LOOM_CACHE_DIR)

gguf = pytest.importorskip("gguf")
Q4 = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]


def _quantized(rows: int, cols: int, qtype, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[0, :32] += 3.0  # a block whose minimum is far from zero (Q4_1's m)
    return gguf.quants.quantize(w, qtype)


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
def test_blocks_decode_exactly_as_gguf_dequantizes(qtype):
    raw = _quantized(48, 96, qtype)
    q, scale, zero = split_int4_blocks(raw, qtype.name)
    assert q.shape == (48, 96) and scale.shape == zero.shape == (48, 3)
    assert q.dtype == np.uint8 and q.max() <= 15
    np.testing.assert_array_equal(dequantize_int4(q, scale, zero), gguf.quants.dequantize(raw, qtype))


def test_q8_0_dequantizes_exactly_and_is_not_int4():
    raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((40, 96)).astype(np.float32),
                               gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(dequantize_q8_0(raw), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="Q8_0 is not a 4-bit block format"):
        split_int4_blocks(raw, "Q8_0")


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_matmul_matches_the_dequantized_weight(qtype, dtype, rows):
    q, scale, zero = split_int4_blocks(_quantized(96, 128, qtype), qtype.name)
    weight = Int4Weight(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero), dtype)
    exact = torch.from_numpy(dequantize_int4(q, scale, zero))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = weight.matmul(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    assert torch.equal(weight.dense, exact.to(dtype))  # the copy for large batches: the file's weights
    if dtype == torch.float32:
        torch.testing.assert_close(got, x @ exact.t(), atol=1e-4, rtol=1e-5)
    else:
        # scales and zeros are held in bf16 (within bf16 rounding of the file's); with them, the
        # product is the fp32 one rounded once to bf16 (2^-8 relative)
        sz = weight.scales_and_zeros.float()  # (groups, out, 2)
        groups = torch.arange(128) // 32
        held = (torch.from_numpy(q).float() - 8) * sz[groups, :, 0].t() + sz[groups, :, 1].t()
        torch.testing.assert_close(held, exact, atol=2e-2, rtol=8e-3)
        torch.testing.assert_close(got.float(), x.float() @ held.t(), atol=1e-2, rtol=4e-3)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """A tiny llama whose attention is Q4_0 and MLP Q4_1 (embedding and LM head stay F32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=3 + 259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, rope_theta=1000.0, tie_word_embeddings=False)
    hf = LlamaForCausalLM(config).float().eval()
    path = str(tmp_path_factory.mktemp("tiny_q4") / "tiny-q4.gguf")

    def quant(name: str):
        if name.startswith("blk."):
            return Q4[0] if ".attn_" in name else Q4[1]
        return None

    _write_tiny_gguf(path, hf, quant=quant)
    return path


@pytest.mark.parametrize("int4_max_rows", [10**6, 0], ids=["int4 kernel", "dense copy"])
def test_tiny_model_int4_logits_match_dequantized(tiny_q4, monkeypatch, int4_max_rows):
    """Through the int4 kernel (every batch size), then through the layers' dense copies."""
    monkeypatch.setattr(quantized, "INT4_MAX_ROWS", int4_max_rows)
    dense = get_model(make_config(tiny_q4, quantization="none"))
    packed = get_model(make_config(tiny_q4, quantization="gguf"))
    int4 = [name for name, m in packed.named_modules() if isinstance(getattr(m, "weight", None), Int4Weight)]
    assert len(int4) == 2 * 4  # qkv, o, gate_up, down in each of the two layers
    assert not any(name.endswith(("qweight", "qscale", "qzero")) for name, _ in packed.named_parameters())
    dense_state, packed_state = dense.state_dict(), packed.state_dict()  # int4 layers show their dense weights
    assert set(packed_state) == set(dense_state)
    for name, tensor in dense_state.items():
        torch.testing.assert_close(packed_state[name].float(), tensor.float(), atol=0, rtol=0, msg=name)
    prompts = [[5, 17, 200, 3, 42, 261, 0], list(range(100, 140))]
    with torch.inference_mode():
        for got, want in zip(run_prefill(packed, prompts), run_prefill(dense, prompts)):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.timeout(300)
def test_tensor_parallel_2_int4_matches_one_rank(tiny_q4, tmp_path):
    """Two gloo ranks slice the int4 parameters as they slice dense weights: the same logits.
    Per rank, o_proj's input is 32 wide (int4) and down_proj's 48 (not whole groups: dense).
    Four rows in the step, so the int4 kernel (not the dense copy) computes them."""
    prompts = [[5, 17], [200, 3]]
    out = tmp_path / "tp_logits.pt"
    torch.multiprocessing.spawn(tp_prefill_worker, args=(2, str(tmp_path / "init"), [tiny_q4], prompts, str(out),
                                                         {"quantization": "gguf"}), nprocs=2, join=True)
    one = get_model(make_config(tiny_q4, quantization="gguf"))
    results = torch.load(out)
    assert results[tiny_q4 + ":int4 layers"] == 2 * 3  # qkv, o and gate_up per layer; down_proj stays dense
    for got, want in zip(results[tiny_q4], run_prefill(one, prompts)):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_quantization_gguf_needs_a_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}))
    with pytest.raises(ValueError, match="--quantization gguf keeps a GGUF file's blocks"):
        make_config(str(tmp_path), quantization="gguf")
    assert make_config(str(tmp_path), dtype="bfloat16").model_config.quantization == "none"


def test_auto_keeps_blocks_only_in_bfloat16(tiny_q4):
    assert make_config(tiny_q4, dtype="float32").model_config.quantization == "none"
    assert make_config(tiny_q4, dtype="bfloat16").model_config.quantization == "gguf"
    assert make_config(tiny_q4, dtype="bfloat16", quantization="none").model_config.quantization == "none"


def test_default_model_int4_greedy_matches_dequantized():
    """SmolLM2's Q4_1 linears as int4 against the same file dequantized, in fp32 (where the
    two paths differ only in summation order): the same 32 greedy tokens."""
    config = make_config(SMOLLM2, quantization="gguf")
    dense, packed = get_model(make_config(SMOLLM2, quantization="none")), get_model(config)
    tok = get_tokenizer(config.model_config)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    prompt = tok(text)["input_ids"]
    with torch.inference_mode():
        got = greedy_generate(packed, prompt, 32)
        assert got == greedy_generate(dense, prompt, 32)
    assert "Paris" in tok.decode(got)
