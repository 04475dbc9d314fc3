"""An 8-bit KV cache for the CPU platform (``--kv-cache-dtype int8``): layout and reference.

Each cache slot holds one row per layer and per K or V: the ``Hk * D`` int8 codes of its KV
heads, head after head, then the ``Hk`` fp32 scales (little-endian, 4 bytes each), so a row is
``Hk * (D + 4)`` bytes and a layer's cache is ``(2, num_blocks, block_size, Hk * (D + 4))``
uint8. A head's vector is ``scale * codes``: symmetric, one scale per (token, KV head), the
head's largest magnitude mapped to 127 (``scale = amax / 127``, codes rounded to nearest, ties
to even; an all-zero head has scale 0). Half the bytes of a bf16 cache plus 4 per head: decode
attention, which reads the whole context every step, reads about half as much.

The functions here are the reference in torch ops: the backend's path where no compiled kernel
takes a shape, and the answer the kernels are tested against.
"""

from __future__ import annotations

import torch

QMAX = 127.0


def row_bytes(num_kv_heads: int, head_size: int) -> int:
    """Bytes of one slot's row of K (or V) for one layer."""
    return num_kv_heads * (head_size + 4)


def quantize_rows(x: torch.Tensor, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """(T, Hk * D) rows of any float dtype -> (T, Hk * (D + 4)) uint8 cache rows."""
    t, hk, d = x.shape[0], num_kv_heads, head_size
    xf = x.reshape(t, hk, d).float()
    amax = xf.abs().amax(-1)  # (T, Hk)
    inv = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    out = torch.empty(t, hk * (d + 4), dtype=torch.uint8)
    out[:, : hk * d] = codes.view(t, hk * d).view(torch.uint8)
    out[:, hk * d:] = (amax / QMAX).contiguous().view(torch.uint8)
    return out


def dequantize_rows(rows: torch.Tensor, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(*S, Hk * (D + 4)) uint8 cache rows -> (*S, Hk, D) in ``dtype``."""
    hk, d = num_kv_heads, head_size
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, hk * (d + 4))
    codes = flat[:, : hk * d].contiguous().view(torch.int8).view(-1, hk, d)
    scales = flat[:, hk * d:].contiguous().view(torch.float32)  # (N, Hk)
    return (codes.float() * scales.unsqueeze(-1)).to(dtype).view(*lead, hk, d)
