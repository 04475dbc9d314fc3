"""Per-process context that plugin-side code reads: the platform and the current config.

``loom_plugin_api`` must not import the engine, so the engine installs a resolver for
the platform (``loom.platforms`` does this on import) and sets the current config
around model construction (``set_current_config``). ``CustomOp`` and attention
backends read both through this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .platform import Platform

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
def set_current_config(config: Any) -> Iterator[None]:
    """Make ``config`` (a ``LoomConfig``) current while a model is built."""
    global _current_config
    previous = _current_config
    _current_config = config
    try:
        yield
    finally:
        _current_config = previous


def get_current_config() -> Any:
    """The ``LoomConfig`` being built for, or None outside ``set_current_config``."""
    return _current_config
