"""Kernel overrides: the GPU kernels behind the ``forward_cuda`` of loom's CustomOps.

loom ships no GPU kernels of its own. A GPU platform installs them here from
``Platform.register_triton_kernel_overrides()`` (once, at the start of each worker, before
the model is built); ``forward_cuda`` calls the installed kernel and falls back to
``forward_native`` when there is none. The signatures, by name:

* ``rms_norm(x, weight, eps, residual=None)`` -> ``out`` or ``(out, x + residual)``
* ``rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style)``
  -> ``(query, key)``, rotated in place
* ``silu_and_mul(x)`` -> ``silu(x[..., :d]) * x[..., d:]``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["KERNEL_NAMES", "clear_kernel_overrides", "get_kernel_override", "register_kernel_override"]

KERNEL_NAMES = ("rms_norm", "rotary_embedding", "silu_and_mul")

_overrides: dict[str, Callable[..., Any]] = {}


def register_kernel_override(name: str, kernel: Callable[..., Any]) -> None:
    """Make ``kernel`` the implementation of ``name`` for every ``forward_cuda`` of this process."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"no kernel named {name!r} can be overridden; known: {', '.join(KERNEL_NAMES)}")
    if not callable(kernel):
        raise TypeError(f"kernel override {name!r} must be callable, got {type(kernel).__name__}")
    _overrides[name] = kernel


def get_kernel_override(name: str) -> Callable[..., Any] | None:
    return _overrides.get(name)


def clear_kernel_overrides() -> None:
    """Forget every override (tests)."""
    _overrides.clear()
