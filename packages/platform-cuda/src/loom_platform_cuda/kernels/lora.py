"""Batched LoRA: each row of a step adds its own adapter's product to the base layer's output.

The contract's ``BatchedLoRA`` (``lora(y, x, lora_a, lora_b, mapping)``): adapters stacked in
slots, ``lora_a`` ``(S, R, in)`` and ``lora_b`` ``(S, out, R)`` (scaling folded into ``lora_b``),
and ``mapping.token_slots`` the slot of each row, -1 for none::

    y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T      for every row t whose slot s is not -1

Two kernels, punica's "shrink" and "expand", each one launch for the whole batch whatever mix
of adapters it holds (the slots are gathered per row from ``token_slots``; ``mapping.groups``
is not read, so nothing syncs with the host):

- shrink: ``buf[t] = x[t] @ lora_a[slot[t]].T`` in fp32, ``(T, R)``. When rows and rank give
  too few tiles to fill the GPU (decode), the input dimension is split over programs too
  (split-K); each split writes its own partial ``(split, T, R)``, no atomics, so results do
  not depend on scheduling;
- expand: ``y[t] += buf[t] @ lora_b[slot[t]].T``, summing the partials first. Rows of slot -1
  are neither read nor written; a tile of such rows returns at once.

A tile of rows runs one tensor-core product per distinct slot among its rows (a batch of one
adapter, or a prefill's run of rows of one request: one product), the other rows' inputs
masked to zero. Products accumulate in fp32: 16-bit inputs multiply exactly on the tensor
cores; the fp32 intermediate is split into a high and a low part in the adapter's dtype for
the expand's product (two tensor-core products, relative error about 2**-16 with bf16; fp16
adapters need the intermediate within fp16's range, as every fp16 product does); fp32 inputs
multiply in full fp32 (no tf32). Like the contract's reference, the product is rounded
to ``y``'s dtype, then added to ``y`` (one more rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loom_plugin_api.ops.lora import LoRAMapping

from ._common import INTERPRETING, as_rows, check_device, check_float, check_index, next_pow2, num_sms

__all__ = ["lora"]

# Fixed tiles (no autotune, so the interpreter runs the same launch). tl.dot needs every dim >= 16.
_BLOCK_K = 64  # shrink: input features per step
_BLOCK_N = 64  # expand: output features per program
_BLOCK_R_MAX = 64  # rank per tile (shrink: per program; expand: per step)
_MAX_SPLIT_K = 16
_INTERPRETER_SMS = 4  # the split heuristic's "GPU size" in the interpreter: small, so tests split too


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b``; UPCAST multiplies the same values in fp32 (the interpreter's 16-bit dot is
    wrong, and inputs of two dtypes cannot meet in one tensor-core product)."""
    if UPCAST:  # (an if/else: after a constexpr branch's return, Triton still compiles the code below)
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # (T, K), rows strided, features dense
    a_ptr,  # (S, R, K), K dense
    slot_ptr,  # (T,) int32/int64, -1: no adapter
    buf_ptr,  # (SPLIT_K, T, R) fp32, dense: the partial of each split
    T, R, K,
    k_per_split,  # input features per split, a multiple of BLOCK_K
    stride_xt, stride_as, stride_ar, stride_buf_split, stride_buf_t,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # grid: (cdiv(T, BLOCK_M), cdiv(R, BLOCK_R), SPLIT_K)
    none = 1 << 62  # above any slot
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    row_mask = rows < T
    slots = tl.load(slot_ptr + rows, mask=row_mask, other=-1).to(tl.int64)  # (BM,)
    s = tl.min(tl.where(slots >= 0, slots, none), axis=0)  # the tile's lowest slot
    if s == none:  # no row of the tile has an adapter
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BR,)
    r_mask = r < R
    k_start = tl.program_id(2) * k_per_split
    ks = tl.arange(0, BLOCK_K)  # (BK,)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    while s < none:  # each distinct slot of the tile, lowest first
        sel = row_mask & (slots == s)  # (BM,) the rows of slot s
        a_slot = a_ptr + s * stride_as
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            k = k0 + ks
            k_mask = k < K
            x = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :],
                        mask=sel[:, None] & k_mask[None, :], other=0.0)  # (BM, BK), 0 off slot s
            a = tl.load(a_slot + r[None, :] * stride_ar + k[:, None],
                        mask=r_mask[None, :] & k_mask[:, None], other=0.0)  # (BK, BR) = lora_a[s].T's tile
            acc = _dot(x, a, acc, UPCAST, PRECISION)
        s = tl.min(tl.where(slots > s, slots, none), axis=0)  # the next slot of the tile
    out_mask = (row_mask & (slots >= 0))[:, None] & r_mask[None, :]
    buf_ptrs = buf_ptr + tl.program_id(2) * stride_buf_split + rows[:, None] * stride_buf_t + r[None, :]
    tl.store(buf_ptrs, acc, mask=out_mask)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # (T, N), rows strided, features dense; updated in place
    b_ptr,  # (S, N, R), R dense
    slot_ptr,  # (T,) int32/int64, -1: no adapter
    buf_ptr,  # (SPLIT_K, T, R) fp32, the shrink's partials
    T, N, R,
    SPLIT_K,
    stride_yt, stride_bs, stride_bn, stride_buf_split, stride_buf_t,
    SPLIT_HI_LO: tl.constexpr,  # lora_b is 16-bit: multiply buf as a high and a low part in its dtype
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # grid: (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N))
    none = 1 << 62
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    row_mask = rows < T
    slots = tl.load(slot_ptr + rows, mask=row_mask, other=-1).to(tl.int64)  # (BM,)
    s = tl.min(tl.where(slots >= 0, slots, none), axis=0)
    if s == none:  # no row of the tile has an adapter: y stays as it is
        return
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = n < N
    rs = tl.arange(0, BLOCK_R)  # (BR,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    while s < none:  # each distinct slot of the tile, lowest first
        sel = row_mask & (slots == s)
        b_slot = b_ptr + s * stride_bs
        for r0 in range(0, R, BLOCK_R):
            r = r0 + rs
            r_mask = r < R
            h_mask = sel[:, None] & r_mask[None, :]
            h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # buf's tile, 0 off slot s
            for split in range(0, SPLIT_K):
                h += tl.load(buf_ptr + split * stride_buf_split + rows[:, None] * stride_buf_t + r[None, :],
                             mask=h_mask, other=0.0)
            b = tl.load(b_slot + n[None, :] * stride_bn + r[:, None],
                        mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # (BR, BN) = lora_b[s].T's tile
            if SPLIT_HI_LO:
                hi = h.to(b.dtype)
                lo = (h - hi.to(tl.float32)).to(b.dtype)
                acc = _dot(hi, b, acc, UPCAST, "ieee")  # (16-bit dots ignore the precision)
                acc = _dot(lo, b, acc, UPCAST, "ieee")
            else:
                acc = _dot(h, b, acc, UPCAST, "ieee")  # fp32 lora_b: full fp32, no tf32
        s = tl.min(tl.where(slots > s, slots, none), axis=0)
    out_mask = (row_mask & (slots >= 0))[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_yt + n[None, :]
    y = tl.load(y_ptrs, mask=out_mask, other=0.0)
    delta = acc.to(y.dtype).to(tl.float32)  # the product in y's dtype, as the reference adds it
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=out_mask)


def _split_k(device: torch.device, tiles: int, k_blocks: int) -> int:
    """Splits of the input dimension: enough programs for every SM when the tiles are few."""
    sms = num_sms(device) if device.type == "cuda" else _INTERPRETER_SMS
    return max(1, min(_MAX_SPLIT_K, k_blocks, triton.cdiv(sms, tiles)))


def lora(
    y: torch.Tensor,  # (T, out), updated in place
    x: torch.Tensor,  # (T, in), y's dtype
    lora_a: torch.Tensor,  # (S, R, in)
    lora_b: torch.Tensor,  # (S, out, R), scaling folded in
    mapping: LoRAMapping,
) -> torch.Tensor:
    """``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T`` for each row ``t`` of a slot ``s >= 0``, IN PLACE.

    Returns ``y``. Rows whose slot is -1 are left exactly as they are. ``y``'s and ``x``'s rows
    may be strided (slices of wider tensors) as long as each row is dense. Slots are not checked
    against ``S`` (that would sync with the host): each must be -1 or a slot of ``lora_a``.
    """
    if not isinstance(mapping, LoRAMapping):
        raise ValueError(f"mapping must be a LoRAMapping, got {type(mapping).__name__}")
    slots = mapping.token_slots
    check_float("y", y)
    check_float("x", x)
    check_float("lora_a", lora_a)
    check_float("lora_b", lora_b)
    if y.dim() != 2 or x.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"y and x must be (tokens, out) and (tokens, in), got shapes {tuple(y.shape)} and "
                         f"{tuple(x.shape)}")
    if x.dtype != y.dtype:
        raise ValueError(f"x must have y's dtype {y.dtype}, got {x.dtype}")
    t, n_out = y.shape
    k_in = x.shape[1]
    if lora_a.dim() != 3 or lora_a.shape[2] != k_in:
        raise ValueError(f"lora_a must be (slots, rank, {k_in}), got shape {tuple(lora_a.shape)}")
    num_slots, rank = lora_a.shape[:2]
    if tuple(lora_b.shape) != (num_slots, n_out, rank):
        raise ValueError(f"lora_b must be ({num_slots}, {n_out}, {rank}) (slots, out, rank), got shape "
                         f"{tuple(lora_b.shape)}")
    check_index("mapping.token_slots", slots, 1)
    if slots.shape[0] != t:
        raise ValueError(f"mapping.token_slots must have one slot per row of y ({t}), got {slots.shape[0]}")
    check_device(y=y, x=x, lora_a=lora_a, lora_b=lora_b, token_slots=slots)
    y_rows = as_rows("y", y)  # a view: the kernel writes into y
    if t == 0 or n_out == 0 or rank == 0 or k_in == 0 or num_slots == 0:
        return y  # nothing to add (with no slots, every row must be -1)
    if k_in > 1 and x.stride(1) != 1:
        x = x.contiguous()  # the kernel reads each row's features as one run
    if k_in > 1 and lora_a.stride(2) != 1:
        lora_a = lora_a.contiguous()
    if rank > 1 and lora_b.stride(2) != 1:
        lora_b = lora_b.contiguous()

    block_m = 16 if t <= 16 else 32
    block_r = min(_BLOCK_R_MAX, max(16, next_pow2(rank)))
    row_tiles, r_tiles, k_blocks = triton.cdiv(t, block_m), triton.cdiv(rank, block_r), triton.cdiv(k_in, _BLOCK_K)
    blocks_per_split = triton.cdiv(k_blocks, _split_k(y.device, row_tiles * r_tiles, k_blocks))
    split_k = triton.cdiv(k_blocks, blocks_per_split)  # no empty split
    buf = torch.empty(split_k, t, rank, dtype=torch.float32, device=y.device)
    upcast = INTERPRETING or x.dtype != lora_a.dtype
    _lora_shrink_kernel[(row_tiles, r_tiles, split_k)](
        x, lora_a, slots, buf,
        t, rank, k_in, blocks_per_split * _BLOCK_K,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), buf.stride(0), buf.stride(1),
        UPCAST=upcast, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
    )
    _lora_expand_kernel[(row_tiles, triton.cdiv(n_out, _BLOCK_N))](
        y_rows, lora_b, slots, buf,
        t, n_out, rank, split_k,
        y_rows.stride(0), lora_b.stride(0), lora_b.stride(1), buf.stride(0), buf.stride(1),
        SPLIT_HI_LO=lora_b.dtype != torch.float32, UPCAST=INTERPRETING,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_R=block_r,
    )
    return y
