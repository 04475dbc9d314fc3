"""The model registry: architecture name -> model class, eager or lazy.

* ``register_model("MyOPT", MyOPT)`` (eager): the class is inspected now and its
  ``ModelInfo`` kept; later look-ups cost nothing.
* ``register_model("MyLlama", "my_pkg.my_llama:MyLlama")`` (lazy): nothing is imported
  until the architecture is resolved, so processes that never build that model never pay
  for its import (nor for torch's). Inspecting a lazy entry imports the class in a
  short-lived subprocess and caches its ``ModelInfo`` under ``$LOOM_CACHE_DIR/modelinfos``,
  keyed by the module file's path, size and mtime; a later start reads the cache.

Registrations happen in general plugins, which run once in every process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._qualname import resolve_obj_by_qualname
from .errors import ModelRegistryError

if TYPE_CHECKING:
    import torch.nn as nn

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
        import torch.nn as nn  # lazy: the registry loads in processes without torch (lazy models: a subprocess)

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
            if self.module_name in sys.modules:
                self.load_model_cls()
            else:
                self._info = _inspect_out_of_process(self)
        assert self._info is not None
        return self._info


# Run by ``python -c`` with (module, class, architecture) as arguments.
# The child first registers, lazily, every architecture this process knows: a plugin's
# class may subclass an in-tree one that it reaches through the registry.
_INSPECT_SCRIPT = """
import dataclasses, json, sys
from loom_plugin_api._qualname import resolve_obj_by_qualname
from loom_plugin_api.model_registry import ModelInfo, ModelRegistry
module, cls, arch = sys.argv[1:4]
for known, target in json.loads(sys.argv[4]).items():
    ModelRegistry.register_model(known, target)
info = ModelInfo.from_model_cls(arch, resolve_obj_by_qualname(module + ":" + cls))
print(json.dumps(dataclasses.asdict(info)))
"""


def _cache_path(entry: _LazyRegisteredModel) -> str | None:
    """Where the entry's ``ModelInfo`` is cached; None when its module file is not found."""
    try:
        spec = importlib.util.find_spec(entry.module_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    st = os.stat(spec.origin)
    key = f"{entry.architecture}|{entry.module_name}:{entry.class_name}|{spec.origin}|{st.st_size}|{st.st_mtime_ns}"
    root = os.environ.get("LOOM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "loom")
    return os.path.join(root, "modelinfos", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _inspect_out_of_process(entry: _LazyRegisteredModel) -> ModelInfo:
    """``ModelInfo`` of a lazy entry without importing its module (and torch) here."""
    path = _cache_path(entry)
    if path is not None and os.path.isfile(path):
        try:
            with open(path) as f:
                return ModelInfo(**json.load(f))
        except (OSError, ValueError, TypeError):
            pass  # unreadable or from another version: inspect again
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    known = {arch: _target(e) for arch, e in ModelRegistry.models.items() if arch != entry.architecture}
    argv = [sys.executable, "-c", _INSPECT_SCRIPT, entry.module_name, entry.class_name, entry.architecture,
            json.dumps(known)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        # Import it here after all, so that the caller sees the real error.
        entry.load_model_cls()
        assert entry._info is not None
        return entry._info
    info = ModelInfo(**json.loads(proc.stdout.strip().splitlines()[-1]))
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(info), f)
            os.replace(tmp, path)
        except OSError as e:
            logger.debug("Cannot cache the model info of %s: %s", entry.architecture, e)
    return info


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

        Eager entries answer from what registration computed; lazy ones from the cache or a
        subprocess that imports the class (or from the class, once it is imported here).
        """
        arch = self._first_known(architectures)
        return self.models[arch].inspect(), arch

    def resolve_model_cls(
        self, architectures: str | Iterable[str], model_config: Any = None
    ) -> tuple[type[nn.Module], str]:
        """Return ``(model_cls, arch)`` for the first registered architecture."""
        arch = self._first_known(architectures)
        return self.models[arch].load_model_cls(), arch


def _target(entry: _RegisteredModel | _LazyRegisteredModel) -> str:
    """``module:qualname`` of an entry's class (importable: registered classes are module-level)."""
    if isinstance(entry, _LazyRegisteredModel):
        return f"{entry.module_name}:{entry.class_name}"
    return f"{entry.model_cls.__module__}:{entry.model_cls.__qualname__}"


def _same_target(a: _RegisteredModel | _LazyRegisteredModel, b: _RegisteredModel | _LazyRegisteredModel) -> bool:
    if isinstance(a, _RegisteredModel) and isinstance(b, _RegisteredModel):
        return a.model_cls is b.model_cls
    if isinstance(a, _LazyRegisteredModel) and isinstance(b, _LazyRegisteredModel):
        return (a.module_name, a.class_name) == (b.module_name, b.class_name)
    return False


ModelRegistry = _ModelRegistry()
