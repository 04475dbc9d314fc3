"""Rotary position embeddings (RoPE), NeoX and GPT-J styles, and ``get_rope``.

``cos_sin_cache`` holds ``[cos | sin]`` of every position, ``(max_position, rotary_dim)``
in fp32; layers with the same settings share one cache tensor. The rotation runs in
fp32 and casts back to the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..custom_op import CustomOp

__all__ = ["Llama3RotaryEmbedding", "LinearScalingRotaryEmbedding", "RotaryEmbedding", "get_rope"]

_COS_SIN_CACHES: dict[tuple[Any, ...], torch.Tensor] = {}


def _apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool) -> torch.Tensor:
    # x: (T, H, rotary_dim); cos, sin: (T, 1, rotary_dim // 2)
    if is_neox_style:  # rotate the two halves
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:  # GPT-J: rotate interleaved pairs
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """``forward(positions (T,), query (T, Hq*D), key (T, Hkv*D)) -> (query, key)`` rotated.

    The first ``rotary_dim`` channels of each head rotate; the rest pass through.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype or torch.float32
        self.register_buffer("cos_sin_cache", self._shared_cos_sin_cache(), persistent=False)

    def _cache_key(self) -> tuple[Any, ...]:
        """What the cache depends on; subclasses with more settings extend it."""
        return (type(self).__qualname__, self.rotary_dim, self.max_position_embeddings, self.base, self.dtype)

    def _shared_cos_sin_cache(self) -> torch.Tensor:
        key = (*self._cache_key(), str(torch.get_default_device()))
        cache = _COS_SIN_CACHES.get(key)
        if cache is None:
            cache = _COS_SIN_CACHES[key] = self._compute_cos_sin_cache()
        return cache

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return 1.0 / (base**exponents)  # (rotary_dim // 2,)

    def _compute_positions(self) -> torch.Tensor:
        return torch.arange(self.max_position_embeddings, dtype=torch.float32)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        freqs = torch.outer(self._compute_positions(), inv_freq)  # (max_pos, rotary_dim // 2)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(self.dtype)  # (max_pos, rotary_dim)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = positions.flatten()
        T = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions).float()  # (T, rotary_dim)
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (T, 1, rotary_dim // 2)
        return self._rotate(query, T, cos, sin), self._rotate(key, T, cos, sin)

    def forward_cuda(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._forward_kernel(positions, query, key)

    def forward_cpu(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._forward_kernel(positions, query, key)

    def _forward_kernel(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The platform's installed ``rotary_embedding`` kernel, else ``forward_native``."""
        kernel = CustomOp.get_kernel("rotary_embedding")
        if kernel is None:
            return self.forward_native(positions, query, key)
        # The kernel rotates in place: q and k are fresh views of this step's QKV output.
        return kernel(positions.flatten(), query, key, self.head_size, self.cos_sin_cache, self.is_neox_style)

    def _rotate(self, x: torch.Tensor, T: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(T, -1, self.head_size)  # (T, H, D)
        rot = _apply_rotary_emb(x[..., : self.rotary_dim].float(), cos, sin, self.is_neox_style)
        x = torch.cat((rot.to(x.dtype), x[..., self.rotary_dim :]), dim=-1)
        return x.reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
            f"is_neox_style={self.is_neox_style}"
        )


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Position interpolation: positions are divided by ``scaling_factor``."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, dtype: torch.dtype | None = None) -> None:
        self.scaling_factor = scaling_factor
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _cache_key(self) -> tuple[Any, ...]:
        return (*super()._cache_key(), self.scaling_factor)

    def _compute_positions(self) -> torch.Tensor:
        return super()._compute_positions() / self.scaling_factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1's frequency-dependent scaling of ``inv_freq`` (``rope_type: llama3``)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, low_freq_factor: float,
                 high_freq_factor: float, orig_max_position: int, dtype: torch.dtype | None = None) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _cache_key(self) -> tuple[Any, ...]:
        return (*super()._cache_key(), self.scaling_factor, self.low_freq_factor,
                self.high_freq_factor, self.orig_max_position)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq(base)
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor
        wave_len = 2 * math.pi / inv_freq
        if self.low_freq_factor != self.high_freq_factor:
            smooth = (self.orig_max_position / wave_len - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
        else:
            smooth = torch.zeros_like(inv_freq)
        scaled = inv_freq / self.scaling_factor
        return torch.where(
            wave_len < high_freq_wavelen,
            inv_freq,
            torch.where(wave_len > low_freq_wavelen, scaled, (1 - smooth) * scaled + smooth * inv_freq),
        )


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    is_neox_style: bool = True,
    rope_scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """Build the rotary embedding for an HF ``rope_scaling``/``rope_parameters`` dict.

    Supported ``rope_type`` (or legacy ``type``): ``default`` (or no dict), ``linear``,
    ``llama3``. Other types raise ``ValueError``.
    """
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
    if rope_type == "default":
        return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, dtype)
    if rope_scaling is None:
        raise ValueError("unreachable: a scaled rope type without a rope_scaling dict")
    factor = float(rope_scaling.get("factor", 1.0))
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, factor, dtype)
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, factor,
            float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"]),
            int(rope_scaling["original_max_position_embeddings"]), dtype,
        )
    raise ValueError(
        f"rope type {rope_type!r} is not supported by loom (supported: default, linear, llama3); "
        "use a model without it or register a model class that builds its own rotary embedding"
    )
