"""RMSNorm, alone or fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float, flatten_tokens, next_pow2, output_rows

__all__ = ["rms_norm"]

# Rows up to this many elements (every common hidden size) are normalized from registers
# in one pass; longer rows are walked twice in chunks of this size, and with a residual
# the second walk normalizes the sum as stored (rounded to the dtype), as vLLM's CUDA
# kernel does, so that running in place stays correct.
_MAX_BLOCK = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (T, hidden)
    residual_ptr,  # (T, hidden); read when HAS_RESIDUAL
    weight_ptr,  # (hidden,)
    out_ptr,  # (T, hidden)
    residual_out_ptr,  # (T, hidden) x + residual; written when HAS_RESIDUAL
    stride_x, stride_r, stride_o, stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # hidden <= BLOCK
):
    # one program per row
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = residual_ptr + row * stride_r
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < hidden
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(residual_out_ptr + row * stride_ro + cols, x.to(residual_out_ptr.dtype.element_ty), mask=mask)
        rstd = tl.math.rsqrt(tl.sum(x * x, 0) / hidden + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros([BLOCK], tl.float32)
        for start in range(0, hidden, BLOCK):
            c = start + cols
            mask = c < hidden
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + c, mask=mask, other=0.0).to(tl.float32)
                tl.store(residual_out_ptr + row * stride_ro + c, x.to(residual_out_ptr.dtype.element_ty),
                         mask=mask)
            sum_sq += x * x
        rstd = tl.math.rsqrt(tl.sum(sum_sq, 0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            c = start + cols
            mask = c < hidden
            # Read the stored sum back: the inputs may already be overwritten when running in place.
            if HAS_RESIDUAL:
                x = tl.load(residual_out_ptr + row * stride_ro + c, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
            y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
            tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # (..., hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,  # like x
    *,
    out: torch.Tensor | None = None,  # like x; may be x itself
    residual_out: torch.Tensor | None = None,  # like x; may be residual itself
    max_block: int = _MAX_BLOCK,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``(x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight``, in fp32, returned in x's dtype.

    With ``residual``: returns ``(rms_norm(x + residual), x + residual)``; the sum is taken in
    fp32 and normalized unrounded (rows over ``max_block``: as rounded), and the returned sum
    is cast to x's dtype. Outputs are new tensors unless ``out``/``residual_out`` are given;
    ``out=x, residual_out=residual`` runs fully in place (each program reads its row before
    it writes it).
    """
    check_float("x", x)
    check_float("weight", weight)
    hidden = x.shape[-1] if x.dim() else 0
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous ({hidden},) tensor, got {tuple(weight.shape)}")
    check_device(x=x, weight=weight)
    rows = flatten_tokens("x", x)  # (N, hidden)
    res_rows = rows
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        check_device(x=x, residual=residual)
        res_rows = flatten_tokens("residual", residual)
    out_rows = output_rows("out", out, tuple(x.shape), x)
    res_out_rows = output_rows("residual_out", residual_out, tuple(x.shape), x) if residual is not None else out_rows
    n = rows.shape[0]
    if n > 0:
        block = min(next_pow2(hidden), next_pow2(max_block))
        _rms_norm_kernel[(n,)](
            rows, res_rows, weight, out_rows, res_out_rows,
            rows.stride(0), res_rows.stride(0), out_rows.stride(0), res_out_rows.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, ONE_PASS=hidden <= block,
            num_warps=min(16, max(1, block // 256)),
        )
    normed = out if out is not None else out_rows.view(x.shape)
    if residual is None:
        return normed
    return normed, residual_out if residual_out is not None else res_out_rows.view(x.shape)
