"""The 8-bit KV cache: its torch reference (kv_int8.py), and the compiled write and decode kernels
(paged_decode_q8.c) against it.

The kernels are compiled where the CPU has AVX512-VNNI; there they must build and pass their
self-check (a test that found them missing would fail). Only on a CPU without AVX512-VNNI, where
``int8_kv()`` is None, do the kernel tests skip.
"""

from __future__ import annotations

import pytest
import torch
from loom.attention.backends import kv_int8, native
from loom.attention.backends.kv_int8 import dequantize_rows, quantize_rows, row_bytes
from loom.platforms.cpu_features import cpu_flags
from loom.worker import cpu_step_replay
from test_cpu_paged_decode import _reference as paged_reference


@pytest.fixture(scope="module")
def q8() -> kv_int8.Int8KV:
    k = kv_int8.int8_kv()
    if k is None:
        if "avx512_vnni" in cpu_flags():
            pytest.fail("the CPU has AVX512-VNNI but the int8 KV kernels are unavailable (see the warning logged)")
        pytest.skip("the int8 KV kernels need AVX512-VNNI")
    return k


@pytest.fixture
def threads():
    """Set torch's (and so the kernel's) thread count for one test; restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _heads(t, hk, d, g, zero_head=None):
    """(t, hk * d) bf16 rows of mixed magnitudes (per channel, a few large channels as keys after
    RoPE have), optionally with KV head ``zero_head`` of every row all zeros."""
    ch = torch.exp(torch.randn(hk * d, generator=g) * 0.6)
    ch[:3] *= 8
    x = torch.randn(t, hk * d, generator=g) * ch
    if zero_head is not None:
        x[:, zero_head * d: (zero_head + 1) * d] = 0
    return x.to(torch.bfloat16)


# ---- the reference ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hk", "d"), [(3, 64), (2, 32), (1, 40)])
def test_reference_round_trip_within_half_a_step(dtype, hk, d):
    g = torch.Generator().manual_seed(hk * 100 + d)
    x = _heads(37, hk, d, g, zero_head=hk - 1 if hk > 1 else None).to(dtype)
    x[5] = 0  # a whole row of zeros too
    rows = quantize_rows(x, hk, d)
    assert rows.shape == (37, row_bytes(hk, d)) and rows.dtype == torch.uint8 and row_bytes(hk, d) == hk * (d + 4)
    codes = rows[:, : hk * d].contiguous().view(torch.int8).view(37, hk, d)
    scales = rows[:, hk * d:].contiguous().view(torch.float32)  # (37, hk)
    xf = x.float().view(37, hk, d)
    torch.testing.assert_close(scales, xf.abs().amax(-1) / 127, atol=0, rtol=0)
    assert codes.abs().max() <= 127
    nonzero = scales > 0
    assert (codes[nonzero].abs().amax(-1) == 127).all()  # the largest magnitude maps to 127
    back = dequantize_rows(rows, hk, d, torch.float32)
    err = (back - xf).abs()
    assert (err <= scales.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-30).all(), (err / scales.unsqueeze(-1)).max()
    # an all-zero head: scale 0, codes 0, zeros back
    assert (scales[~nonzero] == 0).all() and (codes[~nonzero] == 0).all() and (back[~nonzero] == 0).all()
    assert (~nonzero[5]).all() and (hk == 1 or (~nonzero[:, hk - 1]).all())
    assert dequantize_rows(rows.view(37, 1, -1), hk, d, torch.bfloat16).shape == (37, 1, hk, d)


def test_reference_rounds_ties_to_even():
    """With a head's largest magnitude 127 the codes are the values rounded: 2.5 -> 2, 3.5 -> 4."""
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, 1.5])
    codes = quantize_rows(x, 1, 32)[:, :32].view(torch.int8)
    assert codes[0, :6].tolist() == [127, 2, 4, -2, 0, 2]


# ---- the compiled write ----

@pytest.mark.parametrize(("hk", "d"), [(3, 64), (2, 32), (8, 128), (2, 40), (1, 256)])
def test_write_equals_quantize_rows_bit_for_bit(q8, hk, d):
    g = torch.Generator().manual_seed(hk * 1000 + d)
    t, num_slots, width, row = 24, 50, hk * d, row_bytes(hk, d)
    qkv = torch.cat([_heads(t, 3 * hk, d, g, zero_head=1), torch.zeros(t, 8, dtype=torch.bfloat16)], 1)
    key, value = qkv[:, width: 2 * width], qkv[:, 2 * width: 3 * width]  # strided: a fused qkv output's slices
    key[3], value[4] = 0, 0  # whole rows of zeros
    key[7, :6] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, 1.5])  # exact ties: to even, as torch.round
    key[7, 6:d] = 0
    assert key.stride() == (qkv.stride(0), 1) and not key.is_contiguous()
    slots = torch.randperm(num_slots, generator=g)[:t].contiguous()
    k_rows, v_rows = (torch.randint(0, 256, (num_slots, row), generator=g, dtype=torch.uint8) for _ in range(2))
    k_want, v_want = k_rows.clone(), v_rows.clone()
    k_want[slots], v_want[slots] = quantize_rows(key, hk, d), quantize_rows(value, hk, d)
    assert q8.write(key, value, slots, k_rows, v_rows)
    assert torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)  # the slots, and nothing else
    for bad in ([1, 2, num_slots, 3], [1, -1, 2, 3]):  # past the end, negative: nothing is written
        with pytest.raises(IndexError, match="outside the KV cache"):
            q8.write(key[:4] * 2, value[:4] * 2, torch.tensor(bad), k_rows, v_rows)
        assert torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)


def test_special_values_write_as_the_reference_writes_them(q8):
    """A head holding a NaN or an infinity reads back as NaN (scale NaN, codes 0), as it would
    attend in the model's dtype; a head of zeros and subnormals reads back as zeros (scale 0): in
    the compiled write exactly as in ``quantize_rows``, whose NaN a plain max would drop and whose
    tiny values a plain reciprocal would overflow into codes of the wrong sign."""
    hk, d = 2, 64
    x = torch.randn(6, hk * d).to(torch.bfloat16)
    x[0, 0], x[1, 17], x[2, d + 6] = float("nan"), float("inf"), -float("inf")
    x[3, :d], x[3, 5] = 1e-39, -2e-39  # subnormal in bf16 and fp32
    x[4, :d] = 0
    k_rows, v_rows = (torch.zeros(6, row_bytes(hk, d), dtype=torch.uint8) for _ in range(2))
    assert q8.write(x, x, torch.arange(6), k_rows, v_rows)
    want = quantize_rows(x, hk, d)
    assert torch.equal(k_rows, want) and torch.equal(v_rows, want)
    back = dequantize_rows(want, hk, d, torch.float32)  # (6, hk, d)
    assert back[0, 0].isnan().all() and back[1, 0].isnan().all() and back[2, 1].isnan().all()
    assert not back[0, 1].isnan().any() and not back[2, 0].isnan().any()  # the other head of the row
    assert (back[3, 0] == 0).all() and (back[4, 0] == 0).all()


def test_nan_in_a_query_key_or_value_comes_out_nan(q8):
    """NaN in, NaN out, for the heads it reaches, as the reference gives (a NaN score would
    otherwise vanish in the kernel's exp, which masks what is below its range)."""
    hk, d, h, bs = 2, 64, 4, 4
    g = torch.Generator().manual_seed(9)
    tables, ctx = torch.arange(8).view(2, 4), torch.tensor([7, 5])
    rows_q, rows_req = torch.tensor([0, 1]), torch.tensor([0, 1])

    def nan_heads(query, k_rows, v_rows):
        out = torch.zeros(2, h * d, dtype=torch.bfloat16)
        assert q8.decode(query, rows_q, rows_req, k_rows, v_rows, tables, ctx, out, num_heads=h, num_kv_heads=hk,
                         head_size=d, block_size=bs, scale=d**-0.5)
        want = _reference(query, rows_q, rows_req, k_rows, v_rows, tables, ctx, h, hk, d, bs, d**-0.5)
        got = out.float().view(2, h, d).isnan().any(-1)
        assert torch.equal(got, want.view(2, h, d).isnan().any(-1))
        return got.tolist()

    keys, values = (torch.randn(32, hk * d, generator=g).to(torch.bfloat16) for _ in range(2))
    query = torch.randn(2, h * d, generator=g).to(torch.bfloat16)
    k_rows, v_rows = quantize_rows(keys, hk, d), quantize_rows(values, hk, d)
    clean = [[False] * h] * 2
    assert nan_heads(query, k_rows, v_rows) == clean
    bad_q = query.clone()
    bad_q[0, 3] = float("nan")  # query head 0 of row 0
    assert nan_heads(bad_q, k_rows, v_rows) == [[True, False, False, False], [False] * h]
    bad_k = keys.clone()
    bad_k[2, 1] = float("nan")  # request 0's token 2, KV head 0: its group of query heads 0 and 1
    assert nan_heads(query, quantize_rows(bad_k, hk, d), v_rows) == [[True, True, False, False], [False] * h]
    bad_v = values.clone()
    bad_v[2, d + 1] = float("inf")  # KV head 1
    assert nan_heads(query, k_rows, quantize_rows(bad_v, hk, d)) == [[False, False, True, True], [False] * h]


def test_write_refuses_other_dtypes_and_layouts(q8):
    key = torch.randn(2, 64).to(torch.bfloat16)
    rows = torch.zeros(8, row_bytes(1, 64), dtype=torch.uint8)
    slots = torch.tensor([0, 1])
    assert not q8.write(key.float(), key.float(), slots, rows, rows.clone())
    assert not q8.write(key, key, slots.int(), rows, rows.clone())
    assert not q8.write(key, key, slots, rows[:, :-1], rows.clone()[:, :-1])  # a row that is not Hk * (D + 4)
    assert not q8.write(key, key, slots, rows[::2], rows.clone()[::2])  # not contiguous
    assert not q8.write(key.t(), key.t(), slots, rows, rows.clone())
    assert (rows == 0).all()


# ---- the compiled decode ----

def _reference(query, rows_q, rows_req, k_rows, v_rows, tables, ctx, num_heads, hk, d, block_size, scale):
    """The bf16 kernel's float64 reference (each request alone) over the cache rows dequantized
    with ``dequantize_rows``."""
    return paged_reference(query, rows_q, rows_req, dequantize_rows(k_rows, hk, d, torch.float64),
                           dequantize_rows(v_rows, hk, d, torch.float64), tables, ctx, num_heads, block_size, scale)


# Measured (2026-12-06, Xeon with AVX-512): the largest error against the float64 reference is
# 7.8e-3 at outputs up to |4|, at most 4e-4 beyond the output's own bf16 rounding (half a unit in
# the last place: 2^-9 relative); int16 query codes alone would be ~1e-4. A wrong scale, a token
# missed or read twice, a lost tile or a softmax without its max errs by 1e-1 and more.
ATOL, RTOL = 2e-3, 5e-3


def _problem(heads, kv_heads, head_size, ctx, block_size, seed, extra_rows=3):
    g = torch.Generator().manual_seed(seed)
    B, blocks_per_req = len(ctx), max(-(-c // block_size) for c in ctx) + 1
    num_blocks = B * blocks_per_req + 5
    # each request's blocks scattered over the cache, not in order
    tables = torch.randperm(num_blocks, generator=g)[: B * blocks_per_req].view(B, blocks_per_req)
    slots = num_blocks * block_size
    k_rows = quantize_rows(_heads(slots, kv_heads, head_size, g), kv_heads, head_size)
    v_rows = quantize_rows(torch.randn(slots, kv_heads * head_size, generator=g), kv_heads, head_size)
    T, width = B + extra_rows, heads * head_size  # query rows of other tokens sit between the decode rows
    query = (torch.randn(T, width + 2 * kv_heads * head_size, generator=g) * 1.5).to(torch.bfloat16)[:, :width]
    rows_q = torch.randperm(T, generator=g)[:B].contiguous()
    rows_req = torch.randperm(B, generator=g)
    ctx_of = torch.tensor(ctx)[rows_req].contiguous()  # the context belongs to the request row
    return query, rows_q, rows_req, k_rows, v_rows, tables, ctx_of


@pytest.mark.parametrize("nthreads", [1, 2, 3])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size", "ctx"), [
    (9, 3, 64, [1, 15, 16, 17, 160, 700]),  # the default model's heads
    (4, 2, 32, [1, 15, 16, 17, 160, 700]),
    (32, 1, 64, [5, 40]),  # a group of 32 query heads a KV head
    (6, 2, 96, [33, 100]),  # P.V's last 32 columns alone
    (2, 1, 256, [20, 65]),
    (8, 8, 128, [300]),  # one row: its KV heads split between the threads
])
def test_decode_matches_dequantized_reference(q8, threads, nthreads, heads, kv_heads, head_size, ctx):
    threads(nthreads)
    block_size = 16
    query, rows_q, rows_req, k_rows, v_rows, tables, ctx_of = _problem(heads, kv_heads, head_size, ctx, block_size,
                                                                       seed=heads * 1000 + head_size)
    out = torch.full((query.shape[0], heads * head_size), 7.0, dtype=torch.bfloat16)
    scale = head_size**-0.5
    assert q8.decode(query, rows_q, rows_req, k_rows, v_rows, tables, ctx_of, out, num_heads=heads,
                     num_kv_heads=kv_heads, head_size=head_size, block_size=block_size, scale=scale)
    want = _reference(query, rows_q, rows_req, k_rows, v_rows, tables, ctx_of, heads, kv_heads, head_size,
                      block_size, scale)
    torch.testing.assert_close(out[rows_q].double(), want, atol=ATOL, rtol=RTOL)
    untouched = torch.ones(query.shape[0], dtype=torch.bool)
    untouched[rows_q] = False
    assert (out[untouched] == 7.0).all()


def test_decode_of_written_rows(q8):
    """The write and the decode together: rows written by the kernel, read back by it, as a
    decode step sees its own token's K/V."""
    g = torch.Generator().manual_seed(5)
    h, hk, d, bs = 9, 3, 64, 16
    tables = torch.tensor([[3, 0, 5], [1, 4, 2]])
    ctx = torch.tensor([40, 17])
    k_rows, v_rows = (torch.zeros(6 * bs, row_bytes(hk, d), dtype=torch.uint8) for _ in range(2))
    slots = torch.cat([tables[r, torch.arange(n) // bs] * bs + torch.arange(n) % bs for r, n in enumerate(ctx.tolist())])
    qkv = _heads(len(slots), h + 2 * hk, d, g)
    assert q8.write(qkv[:, h * d: (h + hk) * d], qkv[:, (h + hk) * d:], slots.contiguous(), k_rows, v_rows)
    query = (torch.randn(2, h * d, generator=g)).to(torch.bfloat16)
    out = torch.empty(2, h * d, dtype=torch.bfloat16)
    rows = torch.arange(2)
    assert q8.decode(query, rows, rows, k_rows, v_rows, tables, ctx, out, num_heads=h, num_kv_heads=hk,
                     head_size=d, block_size=bs, scale=0.125)
    want = _reference(query, rows, rows, k_rows, v_rows, tables, ctx, h, hk, d, bs, 0.125)
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=RTOL)


def test_a_row_without_context_gets_zeros(q8):
    query, rows_q, rows_req, k_rows, v_rows, tables, ctx = _problem(9, 3, 64, [0, 20], 16, seed=1, extra_rows=0)
    out = torch.full((2, 9 * 64), float("nan"), dtype=torch.bfloat16)
    assert q8.decode(query, rows_q, rows_req, k_rows, v_rows, tables, ctx, out, num_heads=9, num_kv_heads=3,
                     head_size=64, block_size=16, scale=0.125)
    empty = int((ctx == 0).nonzero())
    assert torch.equal(out[rows_q[empty]], torch.zeros(9 * 64, dtype=torch.bfloat16))
    want = _reference(query, rows_q[1 - empty:2 - empty], rows_req[1 - empty:2 - empty], k_rows, v_rows, tables,
                      ctx[1 - empty:2 - empty], 9, 3, 64, 16, 0.125)
    torch.testing.assert_close(out[rows_q[1 - empty]].double().view(1, -1), want, atol=ATOL, rtol=RTOL)


def test_decode_declines_what_it_cannot_compute(q8):
    """float32 queries and head sizes that are not a multiple of 32 go back to the caller (False,
    ``out`` untouched); mismatched layouts are an error."""
    query, rows_q, rows_req, k_rows, v_rows, tables, ctx = _problem(4, 2, 32, [10, 20], 16, seed=2)
    out = torch.full((query.shape[0], 4 * 32), 7.0, dtype=torch.bfloat16)
    kw = dict(num_heads=4, num_kv_heads=2, head_size=32, block_size=16, scale=0.2)
    assert not q8.decode(query.float(), rows_q, rows_req, k_rows, v_rows, tables, ctx, out.float(), **kw)
    assert not q8.supports(torch.float32, 32) and not q8.supports(torch.bfloat16, 40)
    assert q8.supports(torch.bfloat16, 64) and q8.supports(torch.bfloat16, 256) and not q8.supports(torch.bfloat16, 288)
    q40, _, _, k40, v40, _, _ = _problem(4, 2, 40, [10, 20], 16, seed=3)
    out40 = torch.full((q40.shape[0], 4 * 40), 7.0, dtype=torch.bfloat16)
    assert not q8.decode(q40, rows_q, rows_req, k40, v40, tables, ctx, out40, **{**kw, "head_size": 40})
    assert (out == 7.0).all() and (out40 == 7.0).all()
    with pytest.raises(ValueError, match="strides"):
        q8.decode(query, rows_q, rows_req, k_rows[::2], v_rows[::2], tables, ctx, out, **kw)
    with pytest.raises(ValueError, match="strides"):
        q8.decode(query, rows_q, rows_req, k_rows, v_rows, tables.int(), ctx, out, **kw)
    with pytest.raises(ValueError, match="strides"):
        q8.decode(query, rows_q, rows_req, k_rows, v_rows, tables, ctx, out.float(), **kw)
    with pytest.raises(ValueError, match="multiple"):
        q8.decode(query, rows_q, rows_req, k_rows, v_rows, tables, ctx, out, **{**kw, "num_heads": 3})


def test_calls_are_recorded_on_the_tape(q8, monkeypatch):
    """While a step is captured each kernel call lands on ``native.tape`` with plain arguments."""
    query, rows_q, rows_req, k_rows, v_rows, tables, ctx = _problem(4, 2, 32, [10, 20], 16, seed=4)
    out = torch.zeros(query.shape[0], 4 * 32, dtype=torch.bfloat16)
    kv = torch.randn(2, 2 * 64).to(torch.bfloat16)
    tape: list = []
    monkeypatch.setattr(native, "tape", tape)
    assert q8.write(kv[:, :64], kv[:, 64:], torch.tensor([0, 9]), k_rows, v_rows)
    assert q8.decode(query, rows_q, rows_req, k_rows, v_rows, tables, ctx, out, num_heads=4, num_kv_heads=2,
                     head_size=32, block_size=16, scale=0.2)
    assert [fn for fn, _ in tape] == [q8.lib.kv_write_q8, q8.lib.paged_decode_q8]
    for fn, args in tape:
        assert all(type(a) in (int, float) for a in args)
        assert cpu_step_replay._tape_op(fn, args) is not None  # a replay can make it in one tape_run
    assert tape[1][1][0] == query.data_ptr() and tape[1][1][-1] == 0.2


def test_int8_kv_is_none_without_the_native_kernel(monkeypatch):
    monkeypatch.setattr(native, "paged_decode", lambda: None)
    kv_int8.int8_kv.cache_clear()
    try:
        assert kv_int8.int8_kv() is None
    finally:
        kv_int8.int8_kv.cache_clear()
