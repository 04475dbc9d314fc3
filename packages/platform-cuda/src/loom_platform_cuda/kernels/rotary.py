"""Rotary position embedding (neox halves and GPT-J interleaved pairs), in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import as_rows, check_device, check_float, check_index, next_pow2

__all__ = ["rotary_embedding"]


@triton.jit
def _rotate_heads(
    row_ptr,  # one token's (num_heads*D,) row
    num_heads,
    cos, sin,  # (BLOCK_R,) fp32
    r, r_ok,  # (BLOCK_R,) index of each rotated pair, and which exist
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    if IS_NEOX:
        i1 = r  # x1 = x[:rd/2], x2 = x[rd/2:rd]
        i2 = r + HALF
    else:
        i1 = 2 * r  # x1 = x[0::2], x2 = x[1::2]
        i2 = 2 * r + 1
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < num_heads)[:, None] & r_ok[None, :]  # (BLOCK_H, BLOCK_R)
        p1 = row_ptr + h[:, None] * HEAD_SIZE + i1[None, :]
        p2 = row_ptr + h[:, None] * HEAD_SIZE + i2[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(p1, o1.to(row_ptr.dtype.element_ty), mask=mask)
        tl.store(p2, o2.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # (T,)
    q_ptr,  # (T, Hq*D)
    k_ptr,  # (T, Hk*D)
    cos_sin_ptr,  # (max_pos, rotary_dim) = [cos | sin]
    stride_q, stride_k, stride_cs,
    num_q_heads, num_k_heads,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next_pow2(HALF)
):
    # one program per token: every query and key head
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + r, mask=r_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + r, mask=r_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_q, num_q_heads, cos, sin, r, r_ok, HEAD_SIZE, HALF, IS_NEOX, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_k, num_k_heads, cos, sin, r, r_ok, HEAD_SIZE, HALF, IS_NEOX, BLOCK_H)


def rotary_embedding(
    positions: torch.Tensor,  # (T,)
    query: torch.Tensor,  # (T, Hq*D) or (T, Hq, D)
    key: torch.Tensor,  # (T, Hk*D) or (T, Hk, D)
    head_size: int,
    cos_sin_cache: torch.Tensor,  # (max_pos, rotary_dim) = [cos | sin], each rotary_dim // 2 wide
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim channels of every head of query and key, IN PLACE.

    Returns ``(query, key)``, the same tensors. Their rows may be strided (e.g. slices of a
    fused QKV) as long as each row is dense. Math in fp32, stored in the input dtype.
    """
    check_index("positions", positions, 1)
    q_rows = as_rows("query", query)  # (T, Hq*D), a view: the kernel writes through it
    k_rows = as_rows("key", key)
    check_float("query", query)
    check_float("key", key)
    check_float("cos_sin_cache", cos_sin_cache)
    check_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    t = positions.shape[0]
    if q_rows.shape[0] != t or k_rows.shape[0] != t:
        raise ValueError(f"{t} positions for query of {q_rows.shape[0]} and key of {k_rows.shape[0]} tokens")
    if q_rows.shape[1] % head_size or k_rows.shape[1] % head_size:
        raise ValueError(f"query width {q_rows.shape[1]} and key width {k_rows.shape[1]} must be multiples "
                         f"of head_size {head_size}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be a (max_pos, rotary_dim) tensor dense in its last dim, "
                         f"got shape {tuple(cos_sin_cache.shape)}")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_size {head_size}")
    if t > 0:
        half = rotary_dim // 2
        block_r = next_pow2(half)
        block_h = max(1, min(next_pow2(max(q_rows.shape[1], k_rows.shape[1]) // head_size), 4096 // block_r))
        _rotary_kernel[(t,)](
            positions, q_rows, k_rows, cos_sin_cache,
            q_rows.stride(0), k_rows.stride(0), cos_sin_cache.stride(0),
            q_rows.shape[1] // head_size, k_rows.shape[1] // head_size,
            HEAD_SIZE=head_size, HALF=half, IS_NEOX=is_neox_style, BLOCK_H=block_h, BLOCK_R=block_r,
        )
    return query, key
