"""Model implementations (imported lazily through ``ModelRegistry``) and their registration."""

from __future__ import annotations

from .registry import BUILTIN_MODELS, register_builtin_models

__all__ = ["BUILTIN_MODELS", "register_builtin_models"]
