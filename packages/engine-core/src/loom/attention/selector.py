"""Pick the attention backend: ask the platform once per distinct argument set."""

from __future__ import annotations

import functools

import torch
from loom_plugin_api import AttentionBackend, AttentionSelectorConfig, resolve_obj_by_qualname

from .. import envs, platforms
from ..logger import init_logger

logger = init_logger(__name__)


def get_attn_backend(
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    num_heads: int | None = None,
) -> type[AttentionBackend]:
    """The backend class for these arguments; every layer with the same ones shares it."""
    selector_config = AttentionSelectorConfig(
        head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
    )
    return _cached_get_attn_backend(envs.LOOM_ATTENTION_BACKEND, selector_config, num_heads)


@functools.cache
def _cached_get_attn_backend(
    selected_backend: str | None,
    attn_selector_config: AttentionSelectorConfig,
    num_heads: int | None,
) -> type[AttentionBackend]:
    current_platform = platforms.current_platform
    qualname = current_platform.get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
    if not qualname:
        raise ValueError(f"platform {current_platform.device_name} returned no attention backend")
    backend = resolve_obj_by_qualname(qualname)
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise TypeError(f"{qualname} (from {type(current_platform).__name__}) is not an AttentionBackend")
    logger.info("Using attention backend %s (%s)", backend.name, qualname)
    return backend


def cache_info() -> functools._CacheInfo:
    """How often the platform was asked (misses) and answers reused (hits)."""
    return _cached_get_attn_backend.cache_info()


def _cache_clear() -> None:
    _cached_get_attn_backend.cache_clear()
