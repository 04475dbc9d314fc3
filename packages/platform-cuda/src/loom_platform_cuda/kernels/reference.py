"""Plain-torch references of every kernel: the obvious, slow implementation of each spec.

Tests compare the Triton kernels with these, and the benchmark uses them as a floor.
They never mutate their inputs (the kernels may), so a test can run both on the same data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loom_plugin_api.ops.quantized_linear import QuantizedWeight

__all__ = [
    "paged_attention_ref",
    "quantized_linear_ref",
    "reshape_and_cache_ref",
    "rms_norm_ref",
    "rotary_embedding_ref",
    "silu_and_mul_ref",
]


def reshape_and_cache_ref(
    key: torch.Tensor,  # (T, Hk*D)
    value: torch.Tensor,  # (T, Hk*D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hk, D)
    slot_mapping: torch.Tensor,  # (T,) slot = block_id * block_size + offset; < 0 means skip
) -> torch.Tensor:
    """A copy of ``kv_cache`` with each token's K/V written at its slot."""
    out = kv_cache.clone()
    _, num_blocks, block_size, hk, d = out.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    out[0].view(num_blocks * block_size, hk, d)[slots] = key[keep].view(-1, hk, d)
    out[1].view(num_blocks * block_size, hk, d)[slots] = value[keep].view(-1, hk, d)
    return out


def paged_attention_ref(
    query: torch.Tensor,  # (T, H*D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hk, D)
    query_start_loc: torch.Tensor,  # (num_reqs + 1,)
    seq_lens: torch.Tensor,  # (num_reqs,) context length after this step
    block_tables: torch.Tensor,  # (num_reqs, max_blocks)
    scale: float,
) -> torch.Tensor:  # (T, H*D) in query's dtype
    """Causal attention of each request's new tokens over its whole context, one request at a time.

    New token j of a request with context L and q new tokens sits at position L - q + j and
    sees the keys at positions <= its own.
    """
    _, _, block_size, hk, d = kv_cache.shape
    t = query.shape[0]
    h = query.shape[1] // d
    g = h // hk
    out = torch.empty(t, h, d, dtype=query.dtype, device=query.device)
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        pos = torch.arange(ctx, device=query.device)
        blocks = block_tables[i].long()[pos // block_size]
        offsets = pos % block_size
        k = kv_cache[0][blocks, offsets].float().repeat_interleave(g, dim=1)  # (ctx, H, D)
        v = kv_cache[1][blocks, offsets].float().repeat_interleave(g, dim=1)
        q = query[start:end].view(q_len, h, d).float()  # (q, H, D)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (H, q, ctx)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        visible = pos[None, :] <= q_pos[:, None]  # (q, ctx)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out.view(t, h * d)


def quantized_linear_ref(
    x: torch.Tensor,  # (..., in)
    weight: QuantizedWeight,  # (out, in) as codes
    bias: torch.Tensor | None = None,  # (out,)
) -> torch.Tensor:  # (..., out) in x's dtype
    """``x @ W.T + bias`` with W dequantized in fp32 and the product taken in fp32, cast to x's dtype."""
    w = weight.dequantize(torch.float32).to(x.device)  # (out, in)
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


def rms_norm_ref(
    x: torch.Tensor,  # (T, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,  # (T, hidden)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``(x * rsqrt(mean(x^2) + eps)).to(dtype) * weight``; with ``residual``, of ``x + residual``.

    With a residual it returns ``(normed, x + residual)``; the sum is taken in fp32, normalized
    unrounded, and returned rounded to the input dtype.
    """
    dtype = x.dtype
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (normed.to(dtype) * weight).to(dtype)
    if residual is None:
        return out
    return out, xf.to(dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,  # (T,)
    query: torch.Tensor,  # (T, Hq*D)
    key: torch.Tensor,  # (T, Hk*D)
    head_size: int,
    cos_sin_cache: torch.Tensor,  # (max_pos, rotary_dim) = [cos | sin]
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of query and key; only the first rotary_dim channels of each head turn."""
    rd = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # (T, rd/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.reshape(t, -1, head_size)  # (T, heads, D)
        rot, rest = x[..., :rd].float(), x[..., rd:]
        if is_neox_style:
            x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox_style:
            rot = torch.cat([o1, o2], dim=-1)
        else:
            rot = torch.stack([o1, o2], dim=-1).flatten(-2)
        return torch.cat([rot.to(x.dtype), rest], dim=-1).reshape(t, -1)

    return rotate(query), rotate(key)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # (T, 2d) -> (T, d)
    """``silu(x[:, :d]) * x[:, d:]`` in fp32, returned in x's dtype."""
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)
