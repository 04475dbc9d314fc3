"""Layers against straightforward torch references; TP weight loaders with a faked rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loom.distributed import parallel_state
from loom.layers.activation import SiluAndMul, get_act_fn
from loom.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from loom.layers.logits_processor import LogitsProcessor
from loom.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from loom_plugin_api.ops.layernorm import LayerNorm, RMSNorm
from loom_plugin_api.ops.rotary_embedding import Llama3RotaryEmbedding, RotaryEmbedding, get_rope


@pytest.fixture
def fake_tp(monkeypatch):
    """``fake_tp(size, rank)``: layers built afterwards believe they are that TP rank."""

    def set_rank(size: int, rank: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup(world_size=size, rank=rank))

    return set_rank


# ---- norms and activations -----------------------------------------------------------
def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x, res = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    torch.testing.assert_close(norm(x), _rms_ref(x, norm.weight, 1e-5))
    out, new_res = norm(x, res)
    summed = (x.float() + res.float()).to(dtype)
    torch.testing.assert_close(new_res, summed)
    torch.testing.assert_close(out, _rms_ref(summed, norm.weight, 1e-5), atol=1e-2 if dtype != torch.float32 else 1e-6,
                               rtol=1e-2 if dtype != torch.float32 else 1e-5)


def test_rms_norm_dispatches_platform_method():
    from loom.platforms import current_platform
    from loom_plugin_api.custom_op import FORWARD_METHOD_BY_PLATFORM

    assert RMSNorm(8).forward_method_name == FORWARD_METHOD_BY_PLATFORM[current_platform._enum]


def test_layer_norm_matches_torch():
    torch.manual_seed(0)
    ln = LayerNorm(16, eps=1e-5)
    ref = torch.nn.LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16))
        ref.bias.copy_(torch.randn(16))
        ln.weight.copy_(ref.weight)
        ln.bias.copy_(ref.bias)
    x = torch.randn(3, 16)
    torch.testing.assert_close(ln(x), ref(x))
    plain = LayerNorm(16, elementwise_affine=False)
    assert plain.weight is None and not list(plain.parameters())
    torch.testing.assert_close(plain(x), F.layer_norm(x, (16,)))


def test_silu_and_mul_and_act_fn():
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])
    torch.testing.assert_close(get_act_fn("relu")(x.clone()), F.relu(x))
    torch.testing.assert_close(get_act_fn("silu")(x.clone()), F.silu(x))
    torch.testing.assert_close(get_act_fn("gelu_new")(x.clone()), F.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="activation 'nope' is not supported"):
        get_act_fn("nope")


# ---- rotary --------------------------------------------------------------------------
def _rope_ref(x: torch.Tensor, pos: torch.Tensor, head: int, rot: int, base: float, neox: bool) -> torch.Tensor:
    """Textbook RoPE: rotate channel pairs (i, i + rot/2) [NeoX] or (2i, 2i + 1) [GPT-J]."""
    T = x.shape[0]
    x = x.view(T, -1, head).clone()
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2).float() / rot)
    angle = pos.float()[:, None] * inv_freq[None, :]  # (T, rot/2)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    idx = torch.arange(rot // 2)
    a, b = (idx, idx + rot // 2) if neox else (2 * idx, 2 * idx + 1)
    xa, xb = x[..., a].clone(), x[..., b].clone()
    x[..., a] = xa * cos - xb * sin
    x[..., b] = xb * cos + xa * sin
    return x.view(T, -1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [16, 8])
def test_rotary_matches_reference(neox, rot):
    torch.manual_seed(0)
    head, hq, hk = 16, 4, 2
    rope = RotaryEmbedding(head, rot, 64, 10000.0, is_neox_style=neox)
    pos = torch.tensor([0, 1, 5, 63, 7])
    q, k = torch.randn(5, hq * head), torch.randn(5, hk * head)
    # clones: with a platform kernel installed (an earlier in-process engine), q and k rotate in place
    q_out, k_out = rope(pos, q.clone(), k.clone())
    torch.testing.assert_close(q_out, _rope_ref(q, pos, head, rot, 10000.0, neox))
    torch.testing.assert_close(k_out, _rope_ref(k, pos, head, rot, 10000.0, neox))


def test_rotary_cache_is_shared_between_layers():
    a = RotaryEmbedding(16, 16, 32, 500.0)
    b = RotaryEmbedding(16, 16, 32, 500.0)
    assert a.cos_sin_cache.data_ptr() == b.cos_sin_cache.data_ptr()
    assert "cos_sin_cache" not in a.state_dict()


def test_get_rope_types():
    from loom_plugin_api.custom_op import op_registry_oot

    # Under a platform that replaces RotaryEmbedding (the dummy one), get_rope builds the replacement.
    expected = op_registry_oot.get("RotaryEmbedding", RotaryEmbedding)
    assert type(get_rope(16, 16, 32, 10000.0)) is expected
    assert type(get_rope(16, 16, 32, 10000.0, rope_scaling={"rope_type": "default", "rope_theta": 1.0})) \
        is expected
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        get_rope(16, 16, 32, 10000.0, rope_scaling={"rope_type": "yarn", "factor": 2.0})


def test_linear_scaling_divides_positions():
    torch.manual_seed(0)
    scaled = get_rope(16, 16, 64, 10000.0, rope_scaling={"type": "linear", "factor": 2.0})
    plain = RotaryEmbedding(16, 16, 64, 10000.0)
    torch.testing.assert_close(scaled.cos_sin_cache[8], plain.cos_sin_cache[4])


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=128,
                         rope_parameters=scaling)
    ref_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    rope = get_rope(128, 128, 128, 500000.0, rope_scaling=scaling)
    assert isinstance(rope, Llama3RotaryEmbedding)
    torch.testing.assert_close(rope._compute_inv_freq(500000.0), ref_inv_freq.float())


# ---- TP sharding of the linear layers -------------------------------------------------
def _built_at(fake_tp, rank: int, factory):
    fake_tp(2, rank)
    layer = factory()
    return layer


def _load(layer, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id) if shard_id is not None else param.weight_loader(param, tensor)


def test_column_parallel_shards_rows(fake_tp):
    w, b = torch.randn(8, 6), torch.randn(8)
    x = torch.randn(3, 6)
    outs = []
    for rank in range(2):
        layer = _built_at(fake_tp, rank, lambda: ColumnParallelLinear(6, 8))
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        assert layer.weight.shape == (4, 6)
        torch.testing.assert_close(layer.weight, w[rank * 4:(rank + 1) * 4])
        outs.append(layer(x))  # gather_output=False: this rank's columns
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))


def test_row_parallel_shards_columns_and_bias_once(fake_tp):
    w, b = torch.randn(5, 8), torch.randn(5)
    x = torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for rank in range(2):
        layer = _built_at(fake_tp, rank, lambda: RowParallelLinear(8, 5, reduce_results=False))
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        torch.testing.assert_close(layer.weight, w[:, rank * 4:(rank + 1) * 4])
        total += layer(x[:, rank * 4:(rank + 1) * 4])
    torch.testing.assert_close(total, F.linear(x, w, b))


def test_row_parallel_takes_its_input_slice(fake_tp):
    w = torch.randn(5, 8)
    x = torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for rank in range(2):
        layer = _built_at(fake_tp, rank, lambda: RowParallelLinear(8, 5, bias=False, input_is_parallel=False,
                                                                   reduce_results=False))
        _load(layer, "weight", w)
        total += layer(x)
    torch.testing.assert_close(total, F.linear(x, w))


def test_merged_column_parallel(fake_tp):
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    for rank in range(2):
        layer = _built_at(fake_tp, rank, lambda: MergedColumnParallelLinear(4, [6, 6], bias=False))
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        expected = torch.cat([gate[rank * 3:(rank + 1) * 3], up[rank * 3:(rank + 1) * 3]])
        torch.testing.assert_close(layer.weight, expected)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_qkv_parallel(fake_tp, kv_heads):
    heads, head, hidden = 4, 3, 8
    q, k, v = torch.randn(heads * head, hidden), torch.randn(kv_heads * head, hidden), torch.randn(kv_heads * head, hidden)
    for rank in range(2):
        layer = _built_at(fake_tp, rank, lambda: QKVParallelLinear(hidden, head, heads, kv_heads, bias=False))
        for sid, t in (("q", q), ("k", k), ("v", v)):
            _load(layer, "weight", t, sid)
        kv_per_rank = max(kv_heads // 2, 1)
        kv_rank = rank if kv_heads >= 2 else 0  # one KV head: replicated on both ranks
        rows = kv_per_rank * head
        expected = torch.cat([q[rank * 2 * head:(rank + 1) * 2 * head],
                              k[kv_rank * rows:(kv_rank + 1) * rows], v[kv_rank * rows:(kv_rank + 1) * rows]])
        assert layer.num_heads == 2 and layer.num_kv_heads == kv_per_rank
        torch.testing.assert_close(layer.weight, expected)


def test_qkv_fused_checkpoint_tensor(fake_tp):
    fake_tp(1, 0)
    layer = QKVParallelLinear(8, 2, 4, 2, bias=True)
    fused_w, fused_b = torch.randn(16, 8), torch.randn(16)
    _load(layer, "weight", fused_w)
    _load(layer, "bias", fused_b)
    torch.testing.assert_close(layer.weight, fused_w)
    torch.testing.assert_close(layer.bias, fused_b)


def test_loader_shape_mismatch_is_a_clear_error():
    layer = ReplicatedLinear(4, 4, prefix="model.x")
    with pytest.raises(ValueError, match=r"model.x: checkpoint tensor of shape \(4, 5\) does not fit"):
        _load(layer, "weight", torch.randn(4, 5))


def test_indivisible_tp_is_a_clear_error(fake_tp):
    fake_tp(2, 0)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        ColumnParallelLinear(4, 7)


def test_vocab_parallel_embedding_and_lm_head(fake_tp):
    vocab, dim = 100, 4
    table = torch.randn(vocab, dim)
    hidden = torch.randn(3, dim)
    logits = []
    for rank in range(2):
        fake_tp(2, rank)
        emb = VocabParallelEmbedding(vocab, dim)
        _load(emb, "weight", table)
        per = emb.num_embeddings_per_partition
        assert per * 2 >= vocab and per % 64 == 0
        lo, hi = emb.vocab_start_index, emb.vocab_end_index
        torch.testing.assert_close(emb.weight[: hi - lo], table[lo:hi])
        assert torch.count_nonzero(emb.weight[hi - lo:]) == 0
        head = ParallelLMHead(vocab, dim).tie_weights(emb)
        logits.append(F.linear(hidden, head.weight))
    full = torch.cat(logits, -1)[:, :vocab]
    torch.testing.assert_close(full, hidden @ table.T)


def test_single_rank_embedding_and_logits_processor():
    vocab, dim = 70, 4
    table = torch.randn(vocab, dim)
    emb = VocabParallelEmbedding(vocab, dim)
    _load(emb, "weight", table)
    ids = torch.tensor([0, 69, 5])
    torch.testing.assert_close(emb(ids), table[ids])
    hidden = torch.randn(2, dim)
    logits = LogitsProcessor(vocab)(emb, hidden)
    assert logits.shape == (2, vocab)
    torch.testing.assert_close(logits, hidden @ table.T)


@pytest.mark.parametrize("vocab", [1000, 4097, 50257])
def test_fused_greedy_equals_argmax_of_logits(vocab):
    from loom.layers.logits_processor import LogitsProcessor
    from loom.layers.vocab_parallel_embedding import ParallelLMHead

    torch.manual_seed(0)
    head = ParallelLMHead(vocab, 24)
    head.weight.data.normal_()
    processor = LogitsProcessor(vocab)
    hidden = torch.randn(7, 24)
    hidden[3] = 0  # all-equal logits: ties resolve to the lowest id, as argmax does
    expected = processor(head, hidden).argmax(-1)
    torch.testing.assert_close(processor.greedy_token_ids(head, hidden, chunk=1000), expected)
    assert processor.greedy_token_ids(head, hidden)[3].item() == 0
