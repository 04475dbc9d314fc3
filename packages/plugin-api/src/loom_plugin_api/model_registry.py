"""The model registry: architecture name -> model class, eager or lazy.

* ``register_model("MyOPT", MyOPT)`` (eager): the class is inspected now and its
  ``ModelInfo`` kept; later look-ups cost nothing.
* ``register_model("MyLlama", "my_pkg.my_llama:MyLlama")`` (lazy): nothing is imported
  until the architecture is inspected or resolved, so processes that never build that
  model never pay for its import.

Registrations happen in general plugins, which run once in every process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ._qualname import resolve_obj_by_qualname
from .errors import ModelRegistryError

logger = logging.getLogger("loom.model_registry")

__all__ = ["ModelInfo", "ModelRegistry", "_ModelRegistry"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """What the engine needs to know about a model class without building it."""

    architecture: str
    class_name: str
    module: str
    is_text_generation: bool
    supports_tensor_parallel: bool

    @classmethod
    def from_model_cls(cls, architecture: str, model_cls: type[nn.Module]) -> ModelInfo:
        if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
            raise ModelRegistryError(
                f"model class for {architecture!r} must be a torch.nn.Module subclass, "
                f"got {model_cls!r}"
            )
        return cls(
            architecture=architecture,
            class_name=model_cls.__qualname__,
            module=model_cls.__module__,
            is_text_generation=callable(getattr(model_cls, "compute_logits", None)),
            supports_tensor_parallel=bool(getattr(model_cls, "supports_tensor_parallel", True)),
        )


@dataclass(slots=True)
class _RegisteredModel:
    model_cls: type[nn.Module]
    info: ModelInfo

    def load_model_cls(self) -> type[nn.Module]:
        return self.model_cls

    def inspect(self) -> ModelInfo:
        return self.info


@dataclass(slots=True)
class _LazyRegisteredModel:
    architecture: str
    module_name: str
    class_name: str
    _info: ModelInfo | None = None

    @property
    def is_imported(self) -> bool:
        return self._info is not None

    def load_model_cls(self) -> type[nn.Module]:
        cls = resolve_obj_by_qualname(f"{self.module_name}:{self.class_name}")
        if self._info is None:
            self._info = ModelInfo.from_model_cls(self.architecture, cls)
        return cls

    def inspect(self) -> ModelInfo:
        if self._info is None:
            self.load_model_cls()
        assert self._info is not None
        return self._info


class _ModelRegistry:
    """Architecture name -> registered model. One instance per process: ``ModelRegistry``."""

    def __init__(self) -> None:
        self.models: dict[str, _RegisteredModel | _LazyRegisteredModel] = {}

    def register_model(self, model_arch: str, model_cls: type[nn.Module] | str) -> None:
        """Register ``model_arch``; a string ``"pkg.module:Class"`` registers lazily.

        Registering an architecture again replaces the earlier entry with a warning
        (a plugin may override an in-tree model on purpose).
        """
        if not isinstance(model_arch, str) or not model_arch:
            raise ModelRegistryError(f"architecture name must be a non-empty string, got {model_arch!r}")
        entry: _RegisteredModel | _LazyRegisteredModel
        if isinstance(model_cls, str):
            module_name, sep, class_name = model_cls.partition(":")
            if not sep or not module_name or not class_name:
                raise ModelRegistryError(
                    f"lazy model {model_arch!r} must be given as 'pkg.module:Class', got {model_cls!r}"
                )
            entry = _LazyRegisteredModel(model_arch, module_name, class_name)
        elif isinstance(model_cls, type):
            entry = _RegisteredModel(model_cls, ModelInfo.from_model_cls(model_arch, model_cls))
        else:
            raise ModelRegistryError(
                f"model {model_arch!r} must be registered with a class or 'pkg.module:Class', "
                f"got {type(model_cls).__name__}"
            )
        old = self.models.get(model_arch)
        if old is not None and _same_target(old, entry):
            return
        if old is not None:
            logger.warning("Model architecture %s is already registered; it is overwritten", model_arch)
        self.models[model_arch] = entry

    def get_supported_archs(self) -> list[str]:
        return sorted(self.models)

    def is_registered(self, model_arch: str) -> bool:
        return model_arch in self.models

    def _first_known(self, architectures: str | Iterable[str]) -> str:
        archs = [architectures] if isinstance(architectures, str) else list(architectures)
        for arch in archs:
            if arch in self.models:
                return arch
        raise ModelRegistryError(
            f"architecture(s) {archs} are not supported; registered: "
            f"{', '.join(self.get_supported_archs()) or '(none)'}"
        )

    def inspect_model_cls(
        self, architectures: str | Iterable[str], model_config: Any = None
    ) -> tuple[ModelInfo, str]:
        """Return ``(model_info, arch)`` for the first registered architecture.

        Eager entries answer from what registration computed; lazy ones import their
        module now (once).
        """
        arch = self._first_known(architectures)
        return self.models[arch].inspect(), arch

    def resolve_model_cls(
        self, architectures: str | Iterable[str], model_config: Any = None
    ) -> tuple[type[nn.Module], str]:
        """Return ``(model_cls, arch)`` for the first registered architecture."""
        arch = self._first_known(architectures)
        return self.models[arch].load_model_cls(), arch


def _same_target(a: _RegisteredModel | _LazyRegisteredModel, b: _RegisteredModel | _LazyRegisteredModel) -> bool:
    if isinstance(a, _RegisteredModel) and isinstance(b, _RegisteredModel):
        return a.model_cls is b.model_cls
    if isinstance(a, _LazyRegisteredModel) and isinstance(b, _LazyRegisteredModel):
        return (a.module_name, a.class_name) == (b.module_name, b.class_name)
    return False


ModelRegistry = _ModelRegistry()
