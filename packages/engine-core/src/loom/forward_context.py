"""The per-step context that attention layers read while the model runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from loom_plugin_api import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata) -> Iterator[None]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("the model ran outside set_forward_context(); the model runner sets it")
    return _forward_context
