"""Write the new tokens' K and V into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import as_rows, check_device, check_float, check_index, next_pow2

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,  # (T, Hk*D)
    cache_ptr,  # (2, num_blocks, block_size, Hk, D)
    slot_ptr,  # (T,)
    stride_key_t, stride_value_t,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_pow2(NUM_KV_HEADS)
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_SIZE)
):
    # one program per token: all kv heads at once
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)  # (BLOCK_H, BLOCK_D)
    src = h * HEAD_SIZE + d
    dst = blk * stride_c_blk + off * stride_c_off + h * stride_c_h + d
    k = tl.load(key_ptr + t * stride_key_t + src, mask=mask)
    v = tl.load(value_ptr + t * stride_value_t + src, mask=mask)
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_c_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # (T, Hk*D) or (T, Hk, D)
    value: torch.Tensor,  # like key
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hk, D)
    slot_mapping: torch.Tensor,  # (T,) block_id * block_size + offset; a negative slot is skipped
) -> None:
    """Store each token's K and V at its cache slot, in place in ``kv_cache``.

    key/value may have strided rows (e.g. slices of a fused QKV); each row must be dense.
    """
    key = as_rows("key", key)
    value = as_rows("value", value)
    check_float("key", key)
    check_float("value", value)
    check_float("kv_cache", kv_cache)
    check_index("slot_mapping", slot_mapping, 1)
    check_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be (2, num_blocks, block_size, num_kv_heads, head_size), got {tuple(kv_cache.shape)}"
        )
    _, _, block_size, hk, d = kv_cache.shape
    t = key.shape[0]
    if key.shape != (t, hk * d) or value.shape != (t, hk * d):
        raise ValueError(
            f"key and value must be (T, {hk}*{d}) to match kv_cache, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {t} tokens")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_size")
    if t == 0:
        return
    _reshape_and_cache_kernel[(t,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), value.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_size,
        NUM_KV_HEADS=hk, HEAD_SIZE=d, BLOCK_H=next_pow2(hk), BLOCK_D=next_pow2(d),
    )
