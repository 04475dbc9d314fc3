"""The CPU platform's fused C kernels (``loom.platforms.cpu_kernels``) against the reference ops."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from loom import envs
from loom.platforms import cpu_kernels
from loom_plugin_api import custom_op
from loom_plugin_api.ops.activation import SiluAndMul
from loom_plugin_api.ops.layernorm import RMSNorm
from loom_plugin_api.ops.rotary_embedding import RotaryEmbedding


@pytest.fixture(autouse=True)
def _live_envs():
    """Read LOOM_* as the test sets them: an in-process engine started by an earlier test froze them."""
    envs._disable_envs_cache_for_tests()


DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def k():
    kernels = cpu_kernels.kernels()
    assert kernels is not None, "the matrix always has a C compiler: the kernels must build"
    return kernels


def _tol(dtype):
    # bf16: the same roundings as the reference; the fp32 intermediates differ only in summation
    # order, which can move a result across one bf16 rounding boundary (one ulp, 2^-8 relative)
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 64), (300, 2048), (4, 40)])
def test_rms_norm(k, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    op = RMSNorm(hidden, eps=1e-5, dtype=dtype)
    op.weight.data = (torch.randn(hidden, generator=g) * 0.5 + 1).to(dtype)
    wide = (torch.randn(rows, hidden + 8, generator=g) * 3).to(dtype)
    x = wide[:, :hidden]  # strided rows, like a split
    r = torch.randn(rows, hidden, generator=g).to(dtype)
    torch.testing.assert_close(k.rms_norm(x, op.weight, 1e-5), op.forward_native(x), **_tol(dtype))
    out, res = k.rms_norm(x, op.weight, 1e-5, r)
    want_out, want_res = op.forward_native(x, r)
    torch.testing.assert_close(out, want_out, **_tol(dtype))
    assert torch.equal(res, want_res)  # x + r rounded once: exact
    assert torch.equal(x, wide[:, :hidden]) and x.data_ptr() == wide.data_ptr()  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 1536), (33, 96), (200, 8), (5, 40)])  # whole vectors, a tail, both
def test_silu_and_mul(k, dtype, rows, d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(rows, 2 * d, generator=g) * 4).to(dtype)
    # saturated, zero and tiny gates, both sides of exp's clamp, and a NaN that must stay one
    x[0, :8] = torch.tensor([-100.0, 100.0, 0.0, -1e-3, -86.5, -88.0, 89.0, float("nan")])
    got, want = k.silu_and_mul(x), SiluAndMul().forward_native(x)
    assert got.shape == (rows, d)
    torch.testing.assert_close(got, want, equal_nan=True, **_tol(dtype))


def test_silu_and_mul_keeps_subnormals_and_matches_bit_for_bit(k):
    """bf16: tiny gates and products stay subnormal (not flushed to zero) in whole vectors as in
    the row's tail, and ordinary values equal the reference's bits: the kernel rounds where the
    reference rounds."""
    tiny = torch.tensor([1.01e-39, -1.01e-39, 4.96e-39, 1e-30, 1e-20, -1e-20, 3e-38, -50.0])  # inside exp's clamp
    ups = torch.tensor([1.0, 1.0, 1.0, 1e-10, 1e-20, 1e-20, 0.5, 1.0])
    g = torch.Generator().manual_seed(5)
    d = 40  # two whole vectors of 16, a tail of 8
    gate, up = torch.randn(3, d, generator=g) * 3, torch.randn(3, d, generator=g)
    for col in (0, 16, 32):  # in each whole vector and in the tail
        gate[0, col:col + 8], up[0, col:col + 8] = tiny, ups
    x = torch.cat([gate, up], dim=1).to(torch.bfloat16)
    got, want = k.silu_and_mul(x), SiluAndMul().forward_native(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert (got[0, :6] != 0).all(), "subnormal results were flushed to zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head,rot", [(64, 64), (128, 64), (32, 16)])
def test_rotary_in_place_on_strided_qkv(k, dtype, neox, head, rot):
    g = torch.Generator().manual_seed(head + rot)
    op = RotaryEmbedding(head, rot, 512, 10000.0, is_neox_style=neox)
    hq, hk, t = 4, 2, 19
    qkv = torch.randn(t, (hq + 2 * hk) * head, generator=g).to(dtype)
    positions = torch.randint(0, 512, (t,), generator=g)
    want_q, want_k = op.forward_native(positions, qkv[:, :hq * head].clone(), qkv[:, hq * head:(hq + hk) * head].clone())
    v_before = qkv[:, (hq + hk) * head:].clone()
    q, kk = qkv[:, :hq * head], qkv[:, hq * head:(hq + hk) * head]  # views: rotated in place
    got_q, got_k = k.rotary_embedding(positions, q, kk, head, op.cos_sin_cache, neox)
    assert got_q.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :hq * head], want_q, **_tol(dtype))
    torch.testing.assert_close(qkv[:, hq * head:(hq + hk) * head], want_k, **_tol(dtype))
    assert torch.equal(qkv[:, (hq + hk) * head:], v_before)  # V untouched


def test_rotary_position_outside_the_cache_is_an_error(k):
    op = RotaryEmbedding(16, 16, 8, 10000.0)
    q, kk = torch.randn(2, 32), torch.randn(2, 16)
    with pytest.raises(IndexError, match="outside the rotary cache of 8 positions"):
        k.rotary_embedding(torch.tensor([3, 8]), q, kk, 16, op.cos_sin_cache, True)


def test_ops_run_the_installed_kernels_on_cpu(k, monkeypatch):
    """install() puts them behind forward_cpu (the registry is per process: a copy here)."""
    monkeypatch.setattr(custom_op, "kernel_registry", dict(custom_op.kernel_registry))
    assert cpu_kernels.install()
    # (another test may have rebuilt the kernels object since the fixture ran: compare methods)
    assert custom_op.kernel_registry["rms_norm"].__func__ is cpu_kernels.CpuKernels.rms_norm
    assert custom_op.CustomOp.get_kernel("rotary_embedding").__func__ is cpu_kernels.CpuKernels.rotary_embedding
    assert custom_op.CustomOp.get_kernel("row_argmax").__func__ is cpu_kernels.CpuKernels.row_argmax
    op = RMSNorm(64)
    x = torch.randn(3, 64)
    calls = []
    monkeypatch.setitem(custom_op.kernel_registry, "rms_norm", lambda *a: calls.append(a) or k.rms_norm(*a))
    torch.testing.assert_close(op.forward_cpu(x), op.forward_native(x))
    assert len(calls) == 1


def test_shapes_the_kernels_cannot_take_are_refused_or_run_the_reference(k):
    q, kk = torch.randn(3, 32), torch.randn(2, 16)  # 3 query rows, 2 key rows: never written out of bounds
    cache = RotaryEmbedding(16, 16, 8, 10000.0).cos_sin_cache
    with pytest.raises(ValueError, match="do not fit"):
        k.rotary_embedding(torch.tensor([0, 1, 2]), q, kk, 16, cache, True)
    x, w, r = torch.randn(4, 8), torch.randn(8), torch.randn(1, 8)  # a broadcast residual: the reference
    out, res = k.rms_norm(x, w, 1e-6, r)
    want_out, want_res = RMSNorm.forward_native(SimpleNamespace(weight=w, variance_epsilon=1e-6), x, r)
    assert torch.equal(out, want_out) and torch.equal(res, want_res)


def test_no_compiler_keeps_the_reference_path(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu_kernels.kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_kernels.kernels() is None
        assert "CPU fused kernels unavailable" in caplog.text
    finally:
        cpu_kernels.kernels.cache_clear()


def test_switch_off(monkeypatch):
    monkeypatch.setenv("LOOM_CPU_NATIVE_KERNELS", "0")
    cpu_kernels.kernels.cache_clear()
    try:
        assert cpu_kernels.kernels() is None and not cpu_kernels.install()
    finally:
        cpu_kernels.kernels.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_llama_layer_stack_matches_with_and_without_kernels(k, dtype):
    """End to end through the ops: norm -> silu_and_mul -> norm with residual, both paths."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 256, generator=g).to(dtype)
    w = torch.randn(256, generator=g).to(dtype)
    a = k.rms_norm(x, w, 1e-6)
    b = cpu_kernels._native_rms_norm(x, w, 1e-6)
    torch.testing.assert_close(k.silu_and_mul(a), F.silu(b[:, :128]) * b[:, 128:], **_tol(dtype))


def _q8_weight(n, kdim, group, seed):
    """Random codes, positive scales and small zeros, as an int8 checkpoint's would be."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, kdim), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, kdim // group, generator=g) * 0.02 + 1e-3
    zero = torch.randn(n, kdim // group, generator=g) * 0.01
    return q, scale, zero


def _q8_reference(x, q, scale, zero, group):
    n, kdim = q.shape
    w = ((q.float() - 128).view(n, kdim // group, group) * scale[..., None] + zero[..., None]).view(n, kdim)
    return F.linear(x.float(), w)


def _q8_close(got, want, dtype):
    # fp32: the same products summed in another order; bf16: plus the output's rounding (2^-8)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 5])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("kdim", [64, 576, 1536])
@pytest.mark.parametrize("n", [16, 100, 576])  # whole tiles, a tail, a model width
def test_q8_linear_matches_the_dequantized_weight(k, dtype, rows, group, kdim, n):
    q, scale, zero = _q8_weight(n, kdim, group, seed=rows + kdim + n)
    g = torch.Generator().manual_seed(group)
    wide = torch.randn(rows, kdim + 24, generator=g).to(dtype)
    x = wide[:, 8:8 + kdim]  # strided rows, like a split
    got = k.q8_linear(x, q, scale, zero, group)
    if kdim % group:
        assert got is None  # 64 inputs cannot hold groups of 128: the caller's other path
        return
    assert got.shape == (rows, n) and got.dtype == dtype
    _q8_close(got, _q8_reference(x, q, scale, zero, group), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_q8_linear_keeps_leading_dims_and_takes_up_to_8_rows(k, dtype):
    q, scale, zero = _q8_weight(40, 96, 32, seed=1)
    x = torch.randn(2, 1, 96).to(dtype)
    got = k.q8_linear(x, q, scale, zero, 32)
    assert got.shape == (2, 1, 40) and got.dtype == dtype
    _q8_close(got, _q8_reference(x, q, scale, zero, 32), dtype)
    x8 = torch.randn(8, 96).to(dtype)
    _q8_close(k.q8_linear(x8, q, scale, zero, 32), _q8_reference(x8, q, scale, zero, 32), dtype)


def test_q8_linear_refuses_what_it_cannot_take(k):
    q, scale, zero = _q8_weight(32, 64, 32, seed=2)
    x = torch.randn(3, 64)
    assert k.q8_linear(torch.randn(9, 64), q, scale, zero, 32) is None  # prefill: a GEMM's job
    assert k.q8_linear(torch.randn(3, 3, 64), q, scale, zero, 32) is None  # 9 rows through leading dims
    assert k.q8_linear(x.half(), q, scale, zero, 32) is None  # not a kernel dtype
    assert k.q8_linear(x, q, scale, zero, 24) is None  # group not a multiple of 16
    assert k.q8_linear(x, q, scale[:, :1].contiguous(), zero[:, :1].contiguous(), 64) is not None  # one group: fine
    assert k.q8_linear(x, q.t().contiguous().t(), scale, zero, 32) is None  # column-major codes
    assert k.q8_linear(x, q, scale.t().contiguous().t(), zero, 32) is None  # strided scales
    assert k.q8_linear(x, q, scale.double(), zero, 32) is None  # scales not fp32
    assert k.q8_linear(torch.randn(3, 48), q, scale, zero, 32) is None  # width mismatch
    assert k.q8_linear(torch.randn(0, 64), q, scale, zero, 32).shape == (0, 32)  # no rows: an empty result


def test_q8_linear_does_not_depend_on_the_thread_count(k):
    """Each output is one thread's, in slices of whole tiles: 1 and 2 threads agree bit for bit."""
    q, scale, zero = _q8_weight(1003, 576, 32, seed=3)  # an odd width: a tail on the last slice
    x = torch.randn(3, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = k.q8_linear(x, q, scale, zero, 32)
        torch.set_num_threads(2)
        two = k.q8_linear(x, q, scale, zero, 32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _q4_weight(n, kdim, group, seed, dtype=torch.float32):
    """Random 4-bit codes, positive scales and small zeros, and their packing for ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, kdim), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, kdim // group, generator=g) * 0.2 + 1e-2
    zero = torch.randn(n, kdim // group, generator=g) * 0.1
    return q, scale, zero, cpu_kernels.pack_q4(q, scale, zero, dtype)


def _q4_reference(x, q, scale, zero, group):
    """fp32 weight, x's dtype's scales: bf16 activations take bf16-rounded scales and zeros (as
    torch's int4 kernel, which takes them in the activations' dtype)."""
    if x.dtype == torch.bfloat16:
        scale, zero = scale.bfloat16().float(), zero.bfloat16().float()
    n, kdim = q.shape
    w = ((q.float() - 8).view(n, kdim // group, group) * scale[..., None] + zero[..., None]).view(n, kdim)
    return F.linear(x.float(), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kdim", [32, 64, 96, 576, 1536])  # a lone 32-code chunk, whole chunks, both
def test_pack_q4_round_trips(kdim, dtype):
    g = torch.Generator().manual_seed(kdim)
    q = torch.randint(0, 16, (7, kdim), generator=g, dtype=torch.uint8)
    scale, zero = torch.rand(7, kdim // 32, generator=g) + 0.01, torch.randn(7, kdim // 32, generator=g)
    packed = cpu_kernels.pack_q4(q, scale, zero, dtype)
    assert (packed.n, packed.k, packed.group_size, packed.dtype) == (7, kdim, 32, dtype)
    assert packed.codes.shape == (7, kdim // 2) and packed.codes.dtype == torch.uint8 and packed.codes.is_contiguous()
    q2, scale2, zero2 = cpu_kernels.unpack_q4(packed)
    assert torch.equal(q2, q)
    assert torch.equal(packed.codes[:, :32] & 15, q[:, :32]) if kdim >= 64 else True  # byte m's low nibble: c[m]
    if dtype == torch.float32:
        assert packed.scale_zero is None and torch.equal(scale2, scale) and torch.equal(zero2, zero)
    else:  # bf16 pairs, scale in the low half
        assert packed.scale is None and packed.zero is None
        assert packed.scale_zero.shape == (7, kdim // 32) and packed.scale_zero.dtype == torch.int32
        assert torch.equal(scale2, scale.bfloat16().float()) and torch.equal(zero2, zero.bfloat16().float())
        assert torch.equal((packed.scale_zero & 0xFFFF).to(torch.int16), scale.bfloat16().view(torch.int16))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernels.pack_q4(q[:, :kdim - 16], scale, zero, dtype)


def test_pack_q4_refuses_inconsistent_weights():
    q, scale, zero, _ = _q4_weight(8, 96, 32, seed=0)
    with pytest.raises(ValueError, match="scale and zero"):
        cpu_kernels.pack_q4(q, scale[:, :2], zero[:, :2], torch.float32)  # groups of 48
    with pytest.raises(ValueError, match="scale and zero"):
        cpu_kernels.pack_q4(q, scale, zero[:, :1], torch.float32)
    with pytest.raises(ValueError, match="scale and zero"):
        cpu_kernels.pack_q4(q, scale[:4], zero[:4], torch.float32)  # fewer outputs
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.pack_q4(q, scale, zero, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("kdim", [64, 576, 1536])
@pytest.mark.parametrize("n", [16, 100, 576, 960])  # whole tiles, a tail, model widths
def test_q4_linear_matches_the_dequantized_weight(k, dtype, rows, group, kdim, n):
    if kdim % group:
        return  # 64 inputs cannot hold groups of 128 (pack_q4 refuses them)
    q, scale, zero, packed = _q4_weight(n, kdim, group, seed=rows + kdim + n, dtype=dtype)
    g = torch.Generator().manual_seed(group)
    wide = torch.randn(rows, kdim + 24, generator=g).to(dtype)
    x = wide[:, 8:8 + kdim]  # strided rows, like a split
    got = k.q4_linear(x, packed)
    assert got.shape == (rows, n) and got.dtype == dtype
    _q8_close(got, _q4_reference(x, q, scale, zero, group), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kdim,group", [(96, 32), (160, 32), (192, 96), (288, 96), (256, 64), (384, 192)])
def test_q4_linear_odd_chunks_and_other_groups(k, dtype, kdim, group):
    """A last chunk of 32 codes, groups that end mid-chunk, group sizes the kernel has no literal for."""
    q, scale, zero, packed = _q4_weight(37, kdim, group, seed=kdim + group, dtype=dtype)
    for rows in (1, 3, 6):
        x = torch.randn(rows, kdim).to(dtype)
        _q8_close(k.q4_linear(x, packed), _q4_reference(x, q, scale, zero, group), dtype)


def test_q4_linear_bf16_uses_exactly_the_bf16_rounded_scales(k):
    """The bf16 kernel's outputs are the bf16 roundings of the reference with bf16-rounded scales
    and zeros (all but the odd one where the sums' order tips a rounding), and not those of the
    unrounded weight (about half of them differ: the scales' rounding shows). Over 40 seeds of x
    the first fraction was never below 0.99 and the second never above 0.65 (max errors, compared
    before, overlapped: the outputs' own bf16 rounding is as large as the scales')."""
    q, scale, zero, packed = _q4_weight(256, 1536, 32, seed=5, dtype=torch.bfloat16)
    x = torch.randn(1, 1536, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = k.q4_linear(x, packed).float()
    want = _q4_reference(x, q, scale, zero, 32)
    torch.testing.assert_close(got, want.bfloat16().float(), rtol=8e-3, atol=1e-3 * want.abs().max().item())
    n, kdim = q.shape
    exact = F.linear(x.float(), ((q.float() - 8).view(n, 48, 32) * scale[..., None] + zero[..., None]).view(n, kdim))
    same_as_rounded = (got == want.bfloat16().float()).float().mean().item()
    same_as_exact = (got == exact.bfloat16().float()).float().mean().item()
    assert same_as_rounded >= 0.95 and same_as_exact <= 0.8, (same_as_rounded, same_as_exact)


@pytest.mark.parametrize("dtype", DTYPES)
def test_q4_linear_keeps_leading_dims(k, dtype):
    q, scale, zero, packed = _q4_weight(40, 128, 32, seed=1, dtype=dtype)
    x = torch.randn(2, 1, 128).to(dtype)
    got = k.q4_linear(x, packed)
    assert got.shape == (2, 1, 40) and got.dtype == dtype
    _q8_close(got, _q4_reference(x, q, scale, zero, 32), dtype)
    x1 = torch.randn(128).to(dtype)  # one row, no leading dims
    got1 = k.q4_linear(x1, packed)
    assert got1.shape == (40,)
    _q8_close(got1, _q4_reference(x1, q, scale, zero, 32), dtype)
    xt = torch.randn(128, 3).to(dtype).t()  # rows with a non-unit inner stride: copied
    _q8_close(k.q4_linear(xt, packed), _q4_reference(xt, q, scale, zero, 32), dtype)


def test_q4_linear_refuses_what_it_cannot_take(k):
    q, scale, zero, packed = _q4_weight(32, 64, 32, seed=2)
    x = torch.randn(3, 64)
    assert k.q4_linear(torch.randn(9, 64), packed) is None  # prefill: a GEMM's job
    assert k.q4_linear(torch.randn(3, 3, 64), packed) is None  # 9 rows through leading dims
    assert k.q4_linear(x.half(), packed) is None  # not a kernel dtype
    assert k.q4_linear(x.bfloat16(), packed) is None  # packed for float32 activations
    assert k.q4_linear(x, cpu_kernels.pack_q4(q, scale, zero, torch.bfloat16)) is None  # and the other way
    assert k.q4_linear(x, cpu_kernels.pack_q4(q, scale[:, :1], zero[:, :1], torch.float32)) is not None  # one group
    assert k.q4_linear(torch.randn(3, 48), packed) is None  # width mismatch
    assert k.q4_linear(torch.randn(3, 128), packed) is None
    assert k.q4_linear(torch.tensor(1.0), packed) is None  # a scalar
    assert k.q4_linear(torch.randn(0, 64), packed).shape == (0, 32)  # no rows: an empty result


def test_q4_linear_does_not_depend_on_the_thread_count(k):
    """Each output is one thread's, in slices of whole tiles: 1 and 2 threads agree bit for bit."""
    before = torch.get_num_threads()
    try:
        for dtype in DTYPES:
            packed = _q4_weight(1003, 576, 32, seed=3, dtype=dtype)[3]  # an odd width: a tail on the last slice
            for rows in (1, 3):
                x = torch.randn(rows, 576).to(dtype)
                torch.set_num_threads(1)
                one = k.q4_linear(x, packed)
                torch.set_num_threads(2)
                two = k.q4_linear(x, packed)
                assert torch.equal(one, two)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 2048), (200, 2048), (3, 40), (5, 7), (2, 16)])
def test_row_argmax_is_torch_max_with_the_first_index(k, dtype, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    # a strided view of a wider matrix, as the LM head's padded chunks are; few distinct values, so
    # most rows hold ties across lanes and in the tail
    x = torch.randint(-3, 4, (rows, n + 5), generator=g).to(dtype)[:, :n]
    x[0, n // 2] = float("-inf")
    want_val, want_idx = torch.max(x, dim=-1)
    val, idx = k.row_argmax(x)
    assert val.dtype == torch.float32 and idx.dtype == torch.int64
    torch.testing.assert_close(val, want_val.float(), rtol=0, atol=0)
    assert torch.equal(idx, want_idx)


def test_row_argmax_edge_rows_and_refusals(k):
    x = torch.full((3, 33), float("-inf"))
    x[1, 32] = 1.0  # the largest value alone in the tail
    x[2, 5] = x[2, 20] = 2.0  # a tie across lanes: the first index
    val, idx = k.row_argmax(x)
    assert idx.tolist() == [0, 32, 5] and val.tolist() == [float("-inf"), 1.0, 2.0]
    assert k.row_argmax(torch.zeros(2, 8, dtype=torch.float16)) is None  # no kernel for fp16
    assert k.row_argmax(torch.zeros(8, 2).t()) is None  # rows with a stride inside
    assert k.row_argmax(torch.zeros(4)) is None and k.row_argmax(torch.zeros(2, 0)) is None
    val, idx = k.row_argmax(torch.zeros(0, 8))
    assert val.shape == idx.shape == (0,)


def test_greedy_sampling_takes_the_installed_row_argmax(monkeypatch):
    """The LM head's running max looks the kernel up in the contract's registry, and runs
    torch's max where none is installed or the kernel refuses the chunk."""
    from loom.layers.logits_processor import _row_max

    monkeypatch.setattr(custom_op, "kernel_registry", {})
    x = torch.randn(3, 50)
    want = x.max(dim=-1)
    got = _row_max(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    calls = []
    monkeypatch.setitem(custom_op.kernel_registry, "row_argmax", lambda t: calls.append(t) or None)
    got = _row_max(x)  # refused: torch's
    assert len(calls) == 1 and torch.equal(got[1], want[1])
    monkeypatch.setitem(custom_op.kernel_registry, "row_argmax",
                        lambda t: (torch.zeros(t.shape[0]), torch.full((t.shape[0],), 7)))
    assert _row_max(x)[1].tolist() == [7, 7, 7]
