"""loom: a plugin-first LLM inference engine.

``import loom`` is cheap and resolves no platform: the public names below load on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loom_plugin_api import ModelRegistry

from .models.registry import register_builtin_models

if TYPE_CHECKING:
    from .entrypoints.llm import LLM
    from .outputs import CompletionOutput, RequestOutput
    from .sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "ModelRegistry", "RequestOutput", "SamplingParams", "__version__"]

register_builtin_models()

_LAZY = {
    "LLM": ("loom.entrypoints.llm", "LLM"),
    "SamplingParams": ("loom.sampling_params", "SamplingParams"),
    "RequestOutput": ("loom.outputs", "RequestOutput"),
    "CompletionOutput": ("loom.outputs", "CompletionOutput"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
