"""SiLU-and-mul, the gate of a SwiGLU MLP."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float, flatten_tokens, next_pow2, output_rows

__all__ = ["silu_and_mul"]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (T, 2d)
    out_ptr,  # (T, d)
    stride_x, stride_o,
    d,
    BLOCK: tl.constexpr,
):
    # grid: (T, cdiv(d, BLOCK))
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # (..., 2d)
    *,
    out: torch.Tensor | None = None,  # (..., d)
) -> torch.Tensor:  # (..., d)
    """``silu(x[..., :d]) * x[..., d:]`` computed in fp32, returned in x's dtype."""
    check_float("x", x)
    check_device(x=x)
    rows = flatten_tokens("x", x)  # (N, 2d)
    n, width = rows.shape
    if width % 2:
        raise ValueError(f"x must have an even last dimension (gate | up), got {width}")
    d = width // 2
    out_rows = output_rows("out", out, (*x.shape[:-1], d), x)  # (N, d)
    if n > 0 and d > 0:
        block = min(1024, next_pow2(d))
        _silu_and_mul_kernel[(n, triton.cdiv(d, block))](
            rows, out_rows, rows.stride(0), out_rows.stride(0), d, BLOCK=block,
        )
    return out if out is not None else out_rows.view(*x.shape[:-1], d)
