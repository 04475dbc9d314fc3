"""Per-process context that plugin-side code reads: the platform, the current config and,
while the model runs a step, the step's attention metadata.

``loom_plugin_api`` must not import the engine, so the engine installs a resolver for
the platform (``loom.platforms`` does this on import) and sets the current config
around model construction (``set_current_config``). ``CustomOp`` and attention
backends read both through this module. A model runner wraps each forward pass in
``set_forward_context(attn_metadata, lora_mapping)``; attention layers read it with
``get_forward_context``, LoRA layers the step's adapters with ``current_lora_mapping``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .attention import AttentionMetadata
    from .config import LoomConfigView
    from .platform import Platform

__all__ = [
    "ForwardContext", "current_lora_mapping", "get_current_config", "get_current_platform", "get_forward_context", "set_current_config",
    "set_forward_context", "set_platform_resolver",
]

_platform_resolver: Callable[[], Platform] | None = None
_current_config: Any = None


def set_platform_resolver(resolver: Callable[[], Platform]) -> None:
    """Install the function that returns this process's platform (the engine does this)."""
    global _platform_resolver
    _platform_resolver = resolver


def get_current_platform() -> Platform:
    """This process's platform, resolved by the engine on first use."""
    if _platform_resolver is None:
        # Importing the engine installs its resolver; done here, not at import time,
        # so the contract package stays importable on its own.
        import importlib

        importlib.import_module("loom.platforms")
    if _platform_resolver is None:
        raise RuntimeError("no platform resolver is installed; install loom-engine")
    return _platform_resolver()


@contextlib.contextmanager
def set_current_config(config: LoomConfigView | None) -> Iterator[None]:
    """Make ``config`` (a ``LoomConfig``) current while a model is built."""
    global _current_config
    previous = _current_config
    _current_config = config
    try:
        yield
    finally:
        _current_config = previous


def get_current_config() -> LoomConfigView | None:
    """The ``LoomConfig`` being built for, or None outside ``set_current_config``."""
    return _current_config


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    lora_mapping: Any = None
    """The step's ``ModelInput.lora_mapping`` (None: no adapter in the step)."""


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata, lora_mapping: Any = None) -> Iterator[None]:
    """Make ``attn_metadata`` (and the step's ``lora_mapping``) the current step's while the
    model runs (one forward pass)."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata, lora_mapping)
    try:
        yield
    finally:
        _forward_context = previous


def current_lora_mapping() -> Any:
    """The running step's ``lora_mapping``; None outside a step or when no row uses an adapter."""
    return None if _forward_context is None else _forward_context.lora_mapping


def get_forward_context() -> ForwardContext:
    """The running step's context; attention layers read their metadata from it."""
    if _forward_context is None:
        raise RuntimeError("the model ran outside set_forward_context(); the model runner sets it")
    return _forward_context
