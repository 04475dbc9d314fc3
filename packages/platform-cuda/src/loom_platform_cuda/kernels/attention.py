"""Paged attention over loom's KV cache: decode, prefill and chunked prefill in one kernel.

One program owns a tile of a request's new tokens for one KV head. The query heads that
share that KV head (the GQA group) are packed into the tile's rows, row r = (token r // G,
head r % G), so each K/V tile is loaded once for the whole group. The program walks the
context through the block table BLOCK_N keys at a time with an online softmax in fp32.

Decode (one token per request) uses one token per tile and may split the context across
``num_splits`` programs (flash-decoding) when the batch alone does not fill the GPU; each split
writes a normalized partial output and its log-sum-exp, and ``_reduce_splits_kernel``
merges them. The split count is a runtime argument, not a constexpr: the launch heuristic
picks dozens of values across batch sizes and context lengths, and a constexpr would compile
a new variant of both kernels, seconds each on a GPU, the first time a serve meets each one.

Causal rule: new token j of a request with context L and q new tokens sits at position
L - q + j and sees keys at positions <= its own. The new tokens' K/V must already be in
the cache (``reshape_and_cache`` runs first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    INTERPRETING,
    as_rows,
    check_device,
    check_float,
    check_index,
    next_pow2,
    num_sms,
)

__all__ = ["paged_attention", "paged_attention_decode", "paged_attention_prefill"]

_LOG2E = 1.4426950408889634
# The reduce kernel's BLOCK_S is next_pow2(num_splits) but at least this, so the heuristic's
# split counts (at most _MAX_SPLITS) share four variants; masked lanes cost next to nothing.
_MIN_REDUCE_BLOCK_S = 8
# Splits are only worth their reduce pass when each one still reads this many keys.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64


# Arguments that change from step to step are left unspecialized: Triton would otherwise compile
# one variant for 1, one for multiples of 16 and one for the rest. The block table's width (its
# row stride) follows the batch's longest context in eager steps.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_attn_kernel(
    q_ptr,  # (T, H*D)
    cache_ptr,  # (2, num_blocks, block_size, Hk, D)
    block_tables_ptr,  # (num_reqs, max_blocks)
    seq_lens_ptr,  # (num_reqs,)
    query_start_loc_ptr,  # (num_reqs + 1,); unused when IS_DECODE
    out_ptr,  # (T, H*D); written when not SPLIT
    part_out_ptr,  # (T, H, num_splits, D) fp32; written when SPLIT
    part_lse_ptr,  # (T, H, num_splits) fp32, log2 units
    scale_log2,  # softmax scale * log2(e)
    stride_q_t, stride_o_t,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h,
    stride_bt,
    block_size,
    partition_size,  # keys per split, a multiple of BLOCK_N; unused when decoding with SPLIT
    num_splits,  # programs per tile along the context; 1 unless SPLIT
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_SIZE: tl.constexpr,
    IS_DECODE: tl.constexpr,  # one new token per request: token index == request index
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for _reduce_splits_kernel
    BLOCK_Q: tl.constexpr,  # new tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile >= BLOCK_Q * GROUP, a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_SIZE)
    DOT_FP32: tl.constexpr,  # upcast dot operands (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored by 16-bit dots)
):
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    if SPLIT:
        tile = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
    else:
        tile = tl.program_id(2)
        split = 0

    if IS_DECODE:
        q_start = req.to(tl.int64)
        q_len = 1
    else:
        q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
        q_len = (tl.load(query_start_loc_ptr + req + 1) - q_start).to(tl.int32)
    tile_start = tile * BLOCK_Q
    if tile_start >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + req).to(tl.int32)
    prefix = ctx - q_len  # position of the request's first new token

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP  # (BLOCK_M,) index among the request's new tokens
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    row_pos = prefix + tok  # (BLOCK_M,) position of each row's token in the sequence
    t_idx = q_start + tok  # (BLOCK_M,) flat token index
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_SIZE
    q_mask = row_ok[:, None] & d_ok[None, :]

    q = tl.load(q_ptr + t_idx[:, None] * stride_q_t + head[:, None] * HEAD_SIZE + d[None, :],
                mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)

    # This program's keys: its split of the context, cut after the tile's last token.
    if IS_DECODE and SPLIT:
        # split this row's own context evenly: the launch (a recorded graph's) stays fixed
        part = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    else:
        part = partition_size
    kv_lo = split * part
    kv_hi = tl.minimum(kv_lo + part, prefix + tl.minimum(tile_start + BLOCK_Q, q_len))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = cache_ptr + kvh * stride_c_h
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        n_ok = n < kv_hi
        blk = tl.load(bt_row + n // block_size, mask=n_ok, other=0).to(tl.int64)
        kv_off = blk * stride_c_blk + (n % block_size) * stride_c_off  # (BLOCK_N,)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(k_base + stride_c_kv + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
        visible = n_ok[None, :] & (n[None, :] <= row_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if not SPLIT:
        o_ptrs = out_ptr + t_idx[:, None] * stride_o_t + head[:, None] * HEAD_SIZE + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (t_idx * NUM_HEADS + head) * num_splits + split  # (BLOCK_M,)
        tl.store(part_out_ptr + part[:, None] * HEAD_SIZE + d[None, :], o, mask=q_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


# num_reqs and num_splits change from step to step (see above).
@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _reduce_splits_kernel(
    part_out_ptr,  # (T, H, num_splits, D) fp32
    part_lse_ptr,  # (T, H, num_splits) fp32, log2 units
    out_ptr,  # (T, H*D)
    query_start_loc_ptr,  # (num_reqs + 1,); unused when IS_DECODE
    num_reqs,
    num_splits,
    stride_o_t,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    IS_DECODE: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits, a power of two: a few buckets, not one per count
    BLOCK_D: tl.constexpr,
):
    # one program per (token, head)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if not IS_DECODE:
        # tokens after the last request (padding) have no partials to merge
        if t >= tl.load(query_start_loc_ptr + num_reqs):
            return
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    part = (t * NUM_HEADS + h) * num_splits + s  # (BLOCK_S,)
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    # Split 0 always holds key 0, which every token sees, so the max is finite.
    w = tl.math.exp2(lse - tl.max(lse, 0))  # (BLOCK_S,)
    o = tl.load(part_out_ptr + part[:, None] * HEAD_SIZE + d[None, :],
                mask=s_ok[:, None] & (d < HEAD_SIZE)[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_o_t + h * HEAD_SIZE + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)


@dataclass(frozen=True, slots=True)
class _Launch:
    block_q: int
    block_m: int
    block_n: int
    num_splits: int
    partition_size: int
    num_warps: int
    num_stages: int


# Launch shapes were picked by compiling for sm_90 offline and reading registers, spills and
# shared memory (bf16, head_size 128): decode BLOCK_N=64 / 4 warps / 2 stages takes ~96
# registers and ~39 KB, so about 4 programs fit on an SM; prefill 64x64 tiles take ~200
# registers without spilling. They are not tuned on a GPU yet.
_DECODE_PROGRAMS_PER_SM = 4


def _num_splits(programs: int, key_blocks: int, slots: int) -> int:
    """Flash-decoding split count: FlashAttention's wave-efficiency rule.

    ``programs`` run without splitting, ``key_blocks`` is the most splits the longest context
    allows, ``slots`` how many programs the device runs at once. Splitting pays only when the
    batch leaves the device under-filled; then take the fewest splits whose last wave is at
    least 85% as full as the best choice.
    """
    if programs >= 0.8 * slots:
        return 1
    max_splits = min(_MAX_SPLITS, key_blocks, slots)
    efficiency = {}
    for n in range(1, max_splits + 1):
        # a split count that gives some split no more keys than n - 1 splits would is wasted
        if n > 1 and math.ceil(key_blocks / n) == math.ceil(key_blocks / (n - 1)):
            continue
        waves = programs * n / slots
        efficiency[n] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return min(n for n, e in efficiency.items() if e >= 0.85 * best)


def _plan(
    *, decode: bool, group: int, head_size: int, num_reqs: int, num_kv_heads: int,
    max_query_len: int, max_seq_len: int, num_splits: int | None, sm_count: int,
) -> _Launch:
    """Tile sizes and split count (fixed heuristics: the interpreter cannot autotune)."""
    block_d = next_pow2(head_size)
    block_n = 64 if block_d <= 128 else 32
    # Tiles of about 64 rows: the query heads of a group times as many tokens as fit.
    block_q = 1 if decode else max(1, 64 // group)
    block_m = max(16, next_pow2(block_q * group))
    if num_splits is None:
        programs = num_reqs * num_kv_heads * math.ceil(max_query_len / block_q)
        key_blocks = math.ceil(max_seq_len / _MIN_KEYS_PER_SPLIT)
        num_splits = _num_splits(programs, key_blocks, sm_count * _DECODE_PROGRAMS_PER_SM)
    num_splits = max(1, num_splits)
    partition = math.ceil(math.ceil(max_seq_len / num_splits) / block_n) * block_n
    num_splits = math.ceil(max_seq_len / partition)  # no split may start past the longest context
    return _Launch(block_q, block_m, block_n, num_splits, partition, num_warps=4, num_stages=2)


def _check_cache(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    check_float("kv_cache", kv_cache)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be (2, num_blocks, block_size, num_kv_heads, head_size), got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_size")
    _, _, block_size, hk, d = kv_cache.shape
    if d > 256:
        raise ValueError(f"head_size {d} is not supported (at most 256)")
    return block_size, hk, d


def _run(
    query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    max_query_len: int, max_seq_len: int, out: torch.Tensor | None, num_splits: int | None,
) -> torch.Tensor:
    query = as_rows("query", query)  # (T, H*D)
    check_float("query", query)
    block_size, hk, d = _check_cache(kv_cache)
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from query dtype {query.dtype}")
    check_index("seq_lens", seq_lens, 1)
    check_index("block_tables", block_tables, 2)
    check_device(query=query, kv_cache=kv_cache, seq_lens=seq_lens, block_tables=block_tables)
    decode = query_start_loc is None
    num_reqs = seq_lens.shape[0]
    if not decode:
        check_index("query_start_loc", query_start_loc, 1)
        check_device(query=query, query_start_loc=query_start_loc)
        if query_start_loc.shape[0] != num_reqs + 1:
            raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {num_reqs} requests "
                             f"(needs num_reqs + 1)")
    t, width = query.shape
    if width % d or (width // d) % hk:
        raise ValueError(f"query width {width} is not num_heads * head_size with num_heads a multiple "
                         f"of num_kv_heads {hk} (head_size {d})")
    h = width // d
    if block_tables.shape[0] != num_reqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_reqs} requests")
    if block_tables.shape[1] * block_size < max_seq_len:
        raise ValueError(f"block_tables holds {block_tables.shape[1]} blocks of {block_size} tokens, "
                         f"fewer than max_seq_len {max_seq_len}")
    if max_query_len < 1 or max_seq_len < max_query_len:
        raise ValueError(f"need 1 <= max_query_len ({max_query_len}) <= max_seq_len ({max_seq_len})")
    if out is None:
        out = torch.empty(t, width, dtype=query.dtype, device=query.device)
    else:
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} on {query.device}, "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")
        out = as_rows("out", out)
    if num_reqs == 0 or t == 0:
        return out

    plan = _plan(decode=decode, group=h // hk, head_size=d, num_reqs=num_reqs, num_kv_heads=hk,
                 max_query_len=max_query_len, max_seq_len=max_seq_len, num_splits=num_splits,
                 sm_count=num_sms(query.device) if query.device.type == "cuda" else 1)
    if plan.num_splits > 1:
        part_out = torch.empty(t, h, plan.num_splits, d, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(t, h, plan.num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # not read
    qsl = seq_lens if decode else query_start_loc  # a placeholder pointer when decoding
    num_q_tiles = math.ceil(max_query_len / plan.block_q)
    grid = (num_reqs, hk, num_q_tiles * plan.num_splits)
    _paged_attn_kernel[grid](
        query, kv_cache, block_tables, seq_lens, qsl, out, part_out, part_lse,
        scale * _LOG2E,
        query.stride(0), out.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        block_size, plan.partition_size,
        plan.num_splits,
        NUM_HEADS=h, GROUP=h // hk, HEAD_SIZE=d, IS_DECODE=decode, SPLIT=plan.num_splits > 1,
        BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=next_pow2(d),
        DOT_FP32=INTERPRETING, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if plan.num_splits > 1:
        rows = t if not decode else num_reqs
        _reduce_splits_kernel[(rows, h)](
            part_out, part_lse, out, qsl, num_reqs, plan.num_splits, out.stride(0),
            NUM_HEADS=h, HEAD_SIZE=d, IS_DECODE=decode,
            BLOCK_S=max(_MIN_REDUCE_BLOCK_S, next_pow2(plan.num_splits)), BLOCK_D=next_pow2(d),
        )
    return out


def paged_attention(
    query: torch.Tensor,  # (T, H*D) or (T, H, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hk, D)
    query_start_loc: torch.Tensor,  # (num_reqs + 1,) offsets of each request's new tokens
    seq_lens: torch.Tensor,  # (num_reqs,) context length after this step
    block_tables: torch.Tensor,  # (num_reqs, max_blocks)
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,  # (T, H*D) to write into
    num_splits: int | None = None,
) -> torch.Tensor:  # (T, H*D) in query's dtype
    """Causal paged attention for any batch: decode, prefill, chunked prefill, or a mix.

    ``max_query_len``/``max_seq_len`` are host ints (no device sync) and must not be below the
    true maxima. A batch of single tokens takes the decode path (split-K when the batch is small);
    anything else takes the prefill tiling, where decode rows simply fill one token of a tile.
    Tokens after ``query_start_loc[-1]`` (padding) are left unwritten in ``out``.
    """
    if max_query_len == 1 and query.shape[0] == seq_lens.shape[0]:
        return paged_attention_decode(query, kv_cache, seq_lens, block_tables, scale, max_seq_len,
                                      out=out, num_splits=num_splits)
    return paged_attention_prefill(query, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                                   max_query_len, max_seq_len, out=out, num_splits=num_splits)


def paged_attention_decode(
    query: torch.Tensor,  # (num_reqs, H*D): one new token per request
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hk, D)
    seq_lens: torch.Tensor,  # (num_reqs,) context length including the new token
    block_tables: torch.Tensor,  # (num_reqs, max_blocks)
    scale: float,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,  # None: enough splits to fill the device
) -> torch.Tensor:  # (num_reqs, H*D)
    """Attention of one new token per request over its cached context (flash-decoding)."""
    if query.dim() >= 1 and query.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"decode takes one token per request: query has {query.shape[0]} rows "
                         f"for {seq_lens.shape[0]} requests")
    return _run(query, kv_cache, None, seq_lens, block_tables, scale, 1, max_seq_len, out, num_splits)


def paged_attention_prefill(
    query: torch.Tensor,  # (T, H*D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hk, D)
    query_start_loc: torch.Tensor,  # (num_reqs + 1,)
    seq_lens: torch.Tensor,  # (num_reqs,)
    block_tables: torch.Tensor,  # (num_reqs, max_blocks)
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = 1,  # None: split the context when the batch is too small
) -> torch.Tensor:  # (T, H*D)
    """Causal attention of each request's new tokens over its cached prefix plus themselves."""
    if query_start_loc is None:
        raise ValueError("paged_attention_prefill needs query_start_loc")
    return _run(query, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                max_query_len, max_seq_len, out, num_splits)
