"""Weight-only quantized linear: ``x @ W.T + bias`` with W as group-wise 4- or 8-bit codes.

The contract's ``QuantizedWeight`` holds one uint8 code per weight and an fp32 scale and zero
per ``group_size`` weights along the input dimension: ``w = (q - 2**(bits-1)) * scale + zero``.
:func:`prepare_quantized_linear` packs it once, at load, into this kernel's layout (4 bits: two
codes a byte, so decoding reads half the bytes); :func:`quantized_linear` then dequantizes each
tile in registers and multiplies it on the tensor cores, accumulating in fp32. The contract
finds the packing step as ``quantized_linear.prepare``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from loom_plugin_api.ops.quantized_linear import QUANTIZED_BITS, QuantizedWeight

from ._common import INTERPRETING, SUPPORTED_DTYPES, check_device, check_float

__all__ = ["PackedQuantizedWeight", "prepare_quantized_linear", "quantized_linear"]

# Fixed tiles (no autotune, so the interpreter runs the same launch). tl.dot needs every dim >= 16.
_BLOCK_M_MAX = 64
_BLOCK_N = 64
_BLOCK_K = 32


@dataclass(frozen=True)
class PackedQuantizedWeight:
    """A ``QuantizedWeight`` in :func:`quantized_linear`'s layout, on the weight's device.

    - ``codes``: uint8; 4 bits: ``(out, in // 2)``, the low nibble holding the even input
      column and the high nibble the odd one; 8 bits: ``(out, in)``, the codes as they are;
    - ``scale``, ``zero``: contiguous float32 ``(out, in // group_size)``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    out_features: int
    in_features: int

    def unpack_codes(self) -> torch.Tensor:
        """The ``(out, in)`` codes, one per byte: ``QuantizedWeight.qweight`` again."""
        if self.bits == 8:
            return self.codes
        low, high = self.codes & 0xF, self.codes >> 4  # (out, in // 2) each
        return torch.stack([low, high], dim=-1).view(self.out_features, self.in_features)


def prepare_quantized_linear(weight: QuantizedWeight, dtype: torch.dtype) -> PackedQuantizedWeight:
    """Pack ``weight`` for :func:`quantized_linear`, once, at load.

    ``dtype`` is the model's compute dtype; it is only checked, as the codes, scales and zeros
    are kept in the same form whatever the activations' dtype.
    """
    if not isinstance(weight, QuantizedWeight):
        raise ValueError(f"weight must be a QuantizedWeight, got {type(weight).__name__}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype is {dtype}; supported: float32, float16, bfloat16")
    if weight.bits not in QUANTIZED_BITS:  # QuantizedWeight checks this too; the packing below relies on it
        raise ValueError(f"weight.bits must be one of {QUANTIZED_BITS}, got {weight.bits}")
    q = weight.qweight
    devices = {t.device for t in (q, weight.scale, weight.zero)}
    if len(devices) > 1:
        raise ValueError(f"weight's qweight, scale and zero must be on one device, got {sorted(map(str, devices))}")
    out_features, in_features = q.shape
    if q.numel() and int(q.max()) >= 2**weight.bits:
        raise ValueError(f"weight.qweight holds codes up to {int(q.max())}, over {2**weight.bits - 1} "
                         f"for {weight.bits} bits")
    if weight.bits == 4:
        if in_features % 2:
            raise ValueError(f"weight's input width must be even to pack 4-bit codes two a byte, got {in_features}")
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # (out, in // 2): even column low, odd column high
    return PackedQuantizedWeight(
        codes=q.contiguous(), scale=weight.scale.contiguous(), zero=weight.zero.contiguous(),
        bits=weight.bits, group_size=weight.group_size, out_features=out_features, in_features=in_features,
    )


@triton.jit
def _quantized_linear_kernel(
    x_ptr,  # (M, K)
    codes_ptr,  # (N, K // 2) uint8 when BITS == 4, else (N, K)
    scale_ptr,  # (N, K // group_size) fp32
    zero_ptr,  # (N, K // group_size) fp32
    bias_ptr,  # (N,); read when HAS_BIAS
    out_ptr,  # (M, N)
    M, N, K,
    group_size,
    stride_xm, stride_cn, stride_sn, stride_om,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,  # group_size % BLOCK_K == 0: one scale per column per K block
    UPCAST: tl.constexpr,  # multiply the same rounded values in fp32 (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # "ieee" for fp32 x (no tf32), else "tf32" (ignored by 16-bit dots)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    row_mask = rows < M
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)  # (BK,)
    offset: tl.constexpr = 1 << (BITS - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # (BM, BK)
        w_mask = k_mask[:, None] & col_mask[None, :]  # (BK, BN)
        if BITS == 4:
            packed = tl.load(codes_ptr + cols[None, :] * stride_cn + (k // 2)[:, None],
                             mask=w_mask, other=0)  # (BK, BN), each byte read for its two columns
            q = (packed.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
        else:
            q = tl.load(codes_ptr + cols[None, :] * stride_cn + k[:, None], mask=w_mask, other=0).to(tl.int32)
        if GROUP_ALIGNED:
            g = k0 // group_size
            scale = tl.load(scale_ptr + cols * stride_sn + g, mask=col_mask, other=0.0)[None, :]  # (1, BN)
            zero = tl.load(zero_ptr + cols * stride_sn + g, mask=col_mask, other=0.0)[None, :]
        else:
            g_offs = cols[None, :] * stride_sn + (k // group_size)[:, None]  # (BK, BN)
            scale = tl.load(scale_ptr + g_offs, mask=w_mask, other=0.0)
            zero = tl.load(zero_ptr + g_offs, mask=w_mask, other=0.0)
        w = (q - offset).to(tl.float32) * scale + zero  # (BK, BN) = W.T's tile, 0 where masked
        w = w.to(x.dtype)  # the dot's inputs are in x's dtype: fp32 stays fp32, half runs on tensor cores
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=PRECISION)  # fp32 accumulation
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def quantized_linear(
    x: torch.Tensor,  # (..., in)
    weight: PackedQuantizedWeight,
    bias: torch.Tensor | None = None,  # (out,)
) -> torch.Tensor:  # (..., out) in x's dtype
    """``x @ W.T + bias`` for W the dequantized ``weight``, accumulated in fp32, returned in x's dtype.

    fp32 ``x`` multiplies the fp32 dequantized weights in full fp32; fp16/bf16 ``x`` multiplies
    them rounded to its dtype (the tensor cores' inputs), so results match a dequantize-then-
    ``F.linear`` in fp32 to within that rounding.
    """
    if not isinstance(weight, PackedQuantizedWeight):
        raise ValueError(f"weight must be a PackedQuantizedWeight (quantized_linear.prepare's result), "
                         f"got {type(weight).__name__}")
    check_float("x", x)
    n_out, k_in = weight.out_features, weight.in_features
    if x.dim() < 1 or x.shape[-1] != k_in:
        raise ValueError(f"x must be (..., {k_in}), got shape {tuple(x.shape)}")
    tensors = {"x": x, "weight.codes": weight.codes, "weight.scale": weight.scale, "weight.zero": weight.zero}
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (n_out,):
            raise ValueError(f"bias must be ({n_out},), got shape {tuple(bias.shape)}")
        bias = bias.contiguous()
        tensors["bias"] = bias
    check_device(**tensors)
    lead = x.shape[:-1]
    m = math.prod(lead)
    rows = x.reshape(m, k_in)  # (M, K), a view where x's layout allows
    if k_in > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()  # the kernel reads each row's K values as one run
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)  # (M, N)
    if m > 0 and n_out > 0:
        block_m = min(_BLOCK_M_MAX, max(16, triton.next_power_of_2(m)))
        grid = (triton.cdiv(m, block_m), triton.cdiv(n_out, _BLOCK_N))
        _quantized_linear_kernel[grid](
            rows, weight.codes, weight.scale, weight.zero, out if bias is None else bias, out,
            m, n_out, k_in, weight.group_size,
            rows.stride(0), weight.codes.stride(0), weight.scale.stride(0), out.stride(0),
            BITS=weight.bits, HAS_BIAS=bias is not None, GROUP_ALIGNED=weight.group_size % _BLOCK_K == 0,
            UPCAST=INTERPRETING, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        )
    return out.view(*lead, n_out)


quantized_linear.prepare = prepare_quantized_linear  # type: ignore[attr-defined]
