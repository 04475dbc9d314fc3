"""The attention layer of every model: asks the selector for a backend, runs its impl."""

from __future__ import annotations

import torch
import torch.nn as nn
from loom_plugin_api import get_current_config
from loom_plugin_api.context import get_forward_context

from ..attention.selector import get_attn_backend


class Attention(nn.Module):
    """Paged attention over this layer's KV cache.

    ``forward(q, k, v)`` takes the step's new tokens, flattened: q ``(T, num_heads *
    head_size)``, k/v ``(T, num_kv_heads * head_size)``. The worker binds
    ``self.kv_cache`` after it allocates the cache.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        config = get_current_config()
        dtype = config.model_config.torch_dtype if config is not None else torch.get_default_dtype()
        block_size = config.cache_config.block_size if config is not None else None
        kv_cache_dtype = config.cache_config.kv_cache_dtype if config is not None else "auto"
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_name = prefix
        self.attn_backend = get_attn_backend(head_size, dtype, kv_cache_dtype, block_size, num_heads)
        self.attn_backend.get_kv_cache_dtype(dtype, kv_cache_dtype)  # refuses a choice it cannot keep, now
        self.impl = self.attn_backend.get_impl_cls()(num_heads, head_size, scale, self.num_kv_heads)
        self.kv_cache = torch.empty(0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        attn_metadata = get_forward_context().attn_metadata
        return self.impl.forward(self, query, key, value, self.kv_cache, attn_metadata)
