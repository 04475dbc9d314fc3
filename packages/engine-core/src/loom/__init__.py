"""loom: a plugin-first LLM inference engine.

``import loom`` is cheap and resolves no platform; ``loom.LLM`` loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loom_plugin_api import ModelRegistry, SamplingParams

from .models.registry import register_builtin_models
from .outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from .entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "ModelRegistry", "RequestOutput", "SamplingParams", "__version__"]

register_builtin_models()


def __getattr__(name: str) -> Any:
    if name == "LLM":  # lazy: the in-process engine loads torch, which `import loom` must not
        return importlib.import_module("loom.entrypoints.llm").LLM
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
