from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "int8")
"""What ``--kv-cache-dtype`` accepts; whether the platform's backend keeps it is its own to say
(``AttentionBackend.get_kv_cache_dtype``)."""


@dataclass(slots=True, kw_only=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    user_block_size: bool = False
    """True when the user chose ``block_size``; platforms keep it then."""
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    """``auto``: K/V in the model's dtype; ``int8``: 8-bit codes with a scale per token and KV
    head, where the platform's attention backend offers it (the CPU platform does)."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV cache; None lets the worker size it from what is available."""
    gpu_memory_utilization: float = 0.9
    """Share of a GPU's memory that the worker may use in all (weights, activations, KV
    cache); GPU platforms size the cache from it. CPU platforms ignore it."""
    num_blocks: int | None = None
    """Set by the engine after asking the workers."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
