"""``TritonAttentionBackend``: paged attention on the GPU with loom_platform_cuda's kernels.

Cache layout per layer: loom's default, ``(2, num_blocks, block_size, num_kv_heads,
head_size)``. Each layer stores the step's new K/V with ``reshape_and_cache``, then one
``paged_attention`` launch covers the whole batch: decode requests and prefill chunks,
causal over each request's cached prefix.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from loom_plugin_api import AttentionBackend, AttentionImpl, AttentionMetadata

from .kernels import paged_attention, reshape_and_cache

__all__ = ["TritonAttentionBackend", "TritonAttentionImpl"]


def _on_device(md: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's index tensors on ``device``, moved once per step and shared by all layers.

    Tensors already there (a recorded CUDA graph's static buffers) are used as they are.
    """
    cached = md.scratch.get("triton_attn")
    if cached is None:
        cached = tuple(t.to(device, non_blocking=True) for t in (md.query_start_loc, md.seq_lens, md.block_tables))
        md.scratch["triton_attn"] = cached
    return cached  # type: ignore[return-value]


class TritonAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, **extra: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, **extra)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        T = query.shape[0]
        key = key.view(T, -1)
        value = value.view(T, -1)
        slot_mapping = attn_metadata.slot_mapping.to(query.device, non_blocking=True)
        reshape_and_cache(key, value, kv_cache, slot_mapping)
        query_start_loc, seq_lens, block_tables = _on_device(attn_metadata, query.device)
        return paged_attention(
            query.view(T, -1), kv_cache, query_start_loc, seq_lens, block_tables, self.scale,
            attn_metadata.max_query_len, attn_metadata.max_seq_len,
        )


class TritonAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_supported_block_sizes() -> list[int]:
        return [16, 32, 64]
