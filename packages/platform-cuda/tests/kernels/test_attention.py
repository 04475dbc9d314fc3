from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import ATTENTION_TOL, DEVICE, DTYPES, ON_GPU, assert_close, build_paged_batch
from loom_platform_cuda.kernels import (
    paged_attention,
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
)
from loom_platform_cuda.kernels.attention import _num_splits, _plan
from loom_platform_cuda.kernels.reference import paged_attention_ref

# (num_heads, num_kv_heads, head_size, block_size)
GQA = (8, 2, 64, 16)
HEAD_CONFIGS = [
    pytest.param(GQA, id="gqa8/2-d64-bs16"),
    pytest.param((4, 4, 32, 32), id="mha4-d32-bs32"),
    pytest.param((4, 1, 128, 16), id="mqa4/1-d128-bs16"),
    pytest.param((6, 2, 80, 16), id="gqa6/2-d80-bs16"),  # group of 3, head_size padded to 128
    pytest.param((16, 2, 96, 32), id="gqa16/2-d96-bs32"),  # group of 8: 8 tokens per prefill tile
]

# (context after the step, new tokens) per request
DECODE_BATCHES = [
    pytest.param([(16, 1), (17, 1), (1, 1), (40, 1)], id="block-edges"),  # ends at a block, one past it
    pytest.param([(9, 1)], id="one-token"),
    pytest.param([(300, 1), (5, 1), (33, 1)], id="one-long"),
]
PREFILL_BATCHES = [
    pytest.param([(20, 20), (33, 33)], id="fresh-prompts"),
    pytest.param([(50, 18), (32, 16), (17, 1)], id="chunks-on-cached-prefix"),
    pytest.param([(40, 1), (70, 30), (17, 1), (5, 5)], id="mixed-decode-prefill"),
    pytest.param([(150, 3), (2, 2)], id="long-prefix-short-chunk"),
]
if ON_GPU:
    DECODE_BATCHES.append(pytest.param([(2048, 1)] * 8 + [(4097, 1), (1, 1)], id="gpu-long"))
    PREFILL_BATCHES.append(pytest.param([(1000, 700), (600, 1), (513, 512), (3000, 200)], id="gpu-long"))


def _reference(batch) -> torch.Tensor:
    return paged_attention_ref(batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                               batch.block_tables, batch.scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("requests", DECODE_BATCHES)
def test_decode_matches_reference(dtype, heads, requests):
    h, hk, d, bs = heads
    b = build_paged_batch(requests, num_heads=h, num_kv_heads=hk, head_size=d, block_size=bs, dtype=dtype)
    out = paged_attention_decode(b.query, b.kv_cache, b.seq_lens, b.block_tables, b.scale, b.max_seq_len)
    assert out.shape == b.query.shape and out.dtype == dtype
    assert_close(out, _reference(b), ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 5])
def test_decode_split_context_matches_reference(dtype, num_splits):
    # the short requests leave later splits empty; the long one spans them all
    b = build_paged_batch([(300, 1), (5, 1), (129, 1)], num_heads=8, num_kv_heads=2, head_size=64,
                          block_size=16, dtype=dtype)
    out = paged_attention_decode(b.query, b.kv_cache, b.seq_lens, b.block_tables, b.scale, b.max_seq_len,
                                 num_splits=num_splits)
    assert_close(out, _reference(b), ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_odd_split_count_matches_reference(dtype, num_splits):
    # 1300 keys (not a multiple of BLOCK_N = 64) in 7 splits of 192, the last one short; the
    # shorter rows split their own context, so most of their splits are empty
    b = build_paged_batch([(1300, 1), (100, 1), (77, 1)], num_heads=8, num_kv_heads=2, head_size=64,
                          block_size=16, dtype=dtype)
    plan = _plan(decode=True, group=4, head_size=64, num_reqs=3, num_kv_heads=2, max_query_len=1,
                 max_seq_len=b.max_seq_len, num_splits=num_splits, sm_count=1)
    assert plan.num_splits == num_splits  # the launch keeps the odd count
    out = paged_attention_decode(b.query, b.kv_cache, b.seq_lens, b.block_tables, b.scale, b.max_seq_len,
                                 num_splits=num_splits)
    assert_close(out, _reference(b), ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("requests", PREFILL_BATCHES)
def test_paged_attention_matches_reference(dtype, heads, requests):
    h, hk, d, bs = heads
    b = build_paged_batch(requests, num_heads=h, num_kv_heads=hk, head_size=d, block_size=bs, dtype=dtype)
    out = paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale,
                          b.max_query_len, b.max_seq_len)
    assert out.shape == b.query.shape and out.dtype == dtype
    assert_close(out, _reference(b), ATTENTION_TOL[dtype])


def test_prefill_split_context_matches_reference():
    b = build_paged_batch([(200, 10), (70, 70)], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                          dtype=torch.float32)
    out = paged_attention_prefill(b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                  b.scale, b.max_query_len, b.max_seq_len, num_splits=3)
    assert_close(out, _reference(b), ATTENTION_TOL[torch.float32])


def test_paged_attention_dispatches_a_decode_batch():
    b = build_paged_batch([(33, 1), (16, 1)], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                          dtype=torch.float32)
    out = paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale,
                          1, b.max_seq_len)
    assert_close(out, _reference(b), ATTENTION_TOL[torch.float32])


def test_prefill_without_prefix_matches_causal_sdpa():
    # an independent check of the reference and the kernel: a fresh prompt is plain causal attention
    h, hk, d = 8, 2, 64
    b = build_paged_batch([(37, 37)], num_heads=h, num_kv_heads=hk, head_size=d, block_size=16,
                          dtype=torch.float32)
    q = b.query.view(37, h, d).transpose(0, 1)  # (H, T, D)
    k = b.key.view(37, hk, d).transpose(0, 1).repeat_interleave(h // hk, dim=0)
    v = b.value.view(37, hk, d).transpose(0, 1).repeat_interleave(h // hk, dim=0)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(37, h * d)
    out = paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale,
                          b.max_query_len, b.max_seq_len)
    assert_close(out, expected, ATTENTION_TOL[torch.float32])
    assert_close(_reference(b), expected, ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cache_then_attend_end_to_end(dtype):
    # reshape_and_cache writes the chunk, then attention reads it back through the block table
    b = build_paged_batch([(45, 13), (16, 1), (20, 4)], num_heads=8, num_kv_heads=2, head_size=64,
                          block_size=16, dtype=dtype)
    expected = _reference(b)
    kv_cache = b.kv_cache.clone()
    flat = kv_cache.view(2, -1, 2, 64)
    flat[:, b.slot_mapping] = 0  # forget the new tokens; the kernel must write them back
    reshape_and_cache(b.key, b.value, kv_cache, b.slot_mapping)
    out = paged_attention(b.query, kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale,
                          b.max_query_len, b.max_seq_len)
    assert_close(out, expected, ATTENTION_TOL[dtype])


def test_attention_accepts_int32_metadata_and_strided_query():
    b = build_paged_batch([(30, 6), (17, 1)], num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                          dtype=torch.float32)
    padded = torch.zeros(b.query.shape[0], b.query.shape[1] + 64, device=DEVICE)
    padded[:, : b.query.shape[1]] = b.query
    query = padded[:, : b.query.shape[1]]  # row stride > width, as a slice of a fused QKV
    out = paged_attention(query, b.kv_cache, b.query_start_loc.int(), b.seq_lens.int(), b.block_tables.int(),
                          b.scale, b.max_query_len, b.max_seq_len)
    assert_close(out, _reference(b), ATTENTION_TOL[torch.float32])


def _args(b, **changes):
    args = dict(query=b.query, kv_cache=b.kv_cache, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                block_tables=b.block_tables, scale=b.scale, max_query_len=b.max_query_len,
                max_seq_len=b.max_seq_len)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: dict(query=b.query[:, :-1]), "query width"),
        (lambda b: dict(query=b.query.half()), "differs from query dtype"),
        (lambda b: dict(kv_cache=b.kv_cache[0]), "kv_cache must be"),
        (lambda b: dict(block_tables=b.block_tables[:, :1]), "fewer than max_seq_len"),
        (lambda b: dict(seq_lens=b.seq_lens.float()), "seq_lens must be int32 or int64"),
        (lambda b: dict(query_start_loc=b.query_start_loc[:-1]), "query_start_loc has"),
        (lambda b: dict(max_query_len=0), "max_query_len"),
    ],
)
def test_paged_attention_rejects_bad_inputs(change, message):
    b = build_paged_batch([(40, 8), (20, 1)], num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                          dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        paged_attention(**_args(b, **change(b)))


def test_decode_rejects_more_than_one_token_per_request():
    b = build_paged_batch([(40, 2)], num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                          dtype=torch.float32)
    with pytest.raises(ValueError, match="one token per request"):
        paged_attention_decode(b.query, b.kv_cache, b.seq_lens, b.block_tables, b.scale, b.max_seq_len)


@pytest.mark.parametrize(
    ("programs", "key_blocks", "expected"),
    [
        (64 * 8, 8, 1),  # batch 64 x 8 kv heads fills an H200 (132 SMs) without splitting
        (8 * 8, 8, 8),  # batch 8 leaves it mostly idle: split each context 8 ways
        (1, 2, 2),  # cannot split finer than the context allows
        (64, 1, 1),
    ],
)
def test_num_splits_fills_the_device(programs, key_blocks, expected):
    assert _num_splits(programs, key_blocks, slots=132 * 4) == expected
