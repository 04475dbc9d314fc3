"""``CustomOp``: layers that a platform or a general plugin may replace.

The replaceable ops, their constructors, forward signatures and reference semantics
(``forward_native``) are in ``loom_plugin_api.ops``. A plugin replaces an op in one of
two ways, both registered here, on ``CustomOp``, once per process:

* a whole class: ``@CustomOp.register_oot(name="RMSNorm")`` (or ``@RMSNorm.register_oot``),
  whose ``forward_oot`` / ``forward_cuda`` / ``forward_cpu`` runs when the op is enabled;
* a kernel behind the in-tree class's ``forward_cuda`` and ``forward_cpu``:
  ``CustomOp.register_kernel("rms_norm", fn)`` with the signature ``KERNEL_SIGNATURES``
  gives (a platform does this from ``Platform.register_triton_kernel_overrides``: the CUDA
  platform installs Triton kernels, the built-in CPU platform C kernels). Without one, those
  methods run ``forward_native``.

The registries:

* ``op_registry`` — in-tree ops, keyed by their op name (``@CustomOp.register("rms_norm")``).
  The op name is what ``custom_ops`` switches (``+rms_norm`` / ``-rms_norm``).
* ``op_registry_oot`` — replacements, keyed by the **class name** of the in-tree class
  they replace (``@RMSNorm.register_oot`` registers under ``"RMSNorm"``).
* ``kernel_registry`` — kernels, keyed by op name.

The exact-name rule: when model code builds ``RotaryEmbedding(...)``, ``__new__`` looks
up ``"RotaryEmbedding"`` in ``op_registry_oot`` and builds the replacement instead. A
subclass with its own name (say ``MRotaryEmbedding``) is *not* replaced, because the
replacement may not implement what the subclass adds. A plugin that does cover
subclasses opts in with ``register_oot(include_subclasses=True)``; then any subclass
without an exact entry of its own is built as the replacement too.

``__init__`` decides once, at construction, which forward runs: if the op is enabled
(``custom_ops`` of the current config: base ``"all"`` or ``"none"``, then ``+name`` /
``-name``), the platform's method from ``FORWARD_METHOD_BY_PLATFORM``; otherwise
``forward_native``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, overload

import torch.nn as nn

from .context import get_current_config, get_current_platform
from .errors import CustomOpError
from .platform import PlatformEnum
from .switches import resolve_custom_ops

logger = logging.getLogger("loom.custom_op")

__all__ = [
    "FORWARD_METHOD_BY_PLATFORM", "KERNEL_SIGNATURES", "CustomOp", "kernel_registry", "op_registry", "op_registry_oot",
    "resolve_custom_ops",
]

_T = TypeVar("_T", bound=type)

op_registry: dict[str, type[CustomOp]] = {}
op_registry_oot: dict[str, type[CustomOp]] = {}
_oot_covers_subclasses: set[str] = set()
kernel_registry: dict[str, Callable[..., Any]] = {}

KERNEL_SIGNATURES: dict[str, str] = {
    "rms_norm": "rms_norm(x, weight, eps, residual=None) -> out, or (out, x + residual) with a residual",
    "rotary_embedding": "rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style) "
                        "-> (query, key), rotated in place",
    "silu_and_mul": "silu_and_mul(x) -> silu(x[..., :d]) * x[..., d:]",
    "quantized_linear": "quantized_linear(x, weight, bias=None) -> x @ W.T (+ bias), W the QuantizedWeight's "
                        "dequantized weights; weight is the QuantizedWeight, or what the kernel's optional "
                        "prepare(weight: QuantizedWeight, dtype) attribute made of it once at load. The kernel may "
                        "round each row of x to 8 bits per group of 32 values first (a step of the group's max|x| / "
                        "127, as llama.cpp's Q8 activations): the conformance kit allows that much error",
    "lora": "lora(y, x, lora_a, lora_b, mapping) -> y, with y[t] += x[t] @ lora_a[s].T @ lora_b[s].T added in "
            "place for each row t of an adapter slot s (mapping: a LoRAMapping)",
    "row_argmax": "row_argmax(x) -> (values, indices) for a (rows, n) tensor: each row's maximum (float32) and "
                  "the index of its first occurrence (int64), as x.max(dim=-1) gives them for rows without NaN; "
                  "or None where the kernel does not take x (torch's max runs then). Greedy sampling's running "
                  "max over the LM head's vocabulary chunks",
}
"""The kernels a platform may install, by op name, with the signature each is called with."""

FORWARD_METHOD_BY_PLATFORM: dict[PlatformEnum, str] = {
    PlatformEnum.CPU: "forward_cpu",
    PlatformEnum.CUDA: "forward_cuda",
    PlatformEnum.OOT: "forward_oot",
}
"""Which method an enabled op runs on each kind of platform (dispatch by table)."""


class CustomOp(nn.Module):
    """Base class of replaceable layers. Subclasses implement ``forward_native`` and may
    implement ``forward_cpu`` / ``forward_cuda`` / ``forward_oot`` (each defaults to
    ``forward_native``)."""

    name: ClassVar[str]

    def __new__(cls, *args: Any, **kwargs: Any) -> CustomOp:
        target = _replacement_for(cls)
        if target is not cls:
            logger.debug("Instantiating custom op: %s using %s", cls.__name__, target.__qualname__)
        obj = super().__new__(target)
        if not isinstance(obj, cls):
            # A subclass replaced under include_subclasses: Python skips __init__ for an
            # object that is not an instance of the class called, so run it here.
            obj.__init__(*args, **kwargs)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = self.dispatch_forward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no forward_native")

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    @property
    def forward_method_name(self) -> str:
        """Name of the forward method chosen at construction (for logs and tests)."""
        return self._forward_method.__name__

    def dispatch_forward(self) -> Callable[..., Any]:
        if not self.enabled():
            return self.forward_native
        platform = get_current_platform()
        method = FORWARD_METHOD_BY_PLATFORM.get(platform._enum, "forward_native")
        return getattr(self, method)

    @classmethod
    def enabled(cls) -> bool:
        """Whether this op runs its platform method under the current ``custom_ops``."""
        config = get_current_config()
        custom_ops = ["all"] if config is None else list(config.compilation_config.custom_ops)
        base, on, off = resolve_custom_ops(custom_ops)
        name = getattr(cls, "name", None)
        if name in on:
            return True
        if name in off:
            return False
        return base == "all"

    # ---- registration ---------------------------------------------------------------
    @classmethod
    def register(cls, name: str) -> Callable[[_T], _T]:
        """Class decorator for an in-tree op: ``@CustomOp.register("rms_norm")``."""

        def decorator(op_cls: _T) -> _T:
            existing = op_registry.get(name)
            if existing is not None and existing is not op_cls:
                raise CustomOpError(
                    f"custom op name {name!r} is already registered by {existing.__qualname__}"
                )
            op_cls.name = name  # type: ignore[attr-defined]
            op_registry[name] = op_cls  # type: ignore[assignment]
            return op_cls

        return decorator

    @overload
    @classmethod
    def register_oot(cls, _decorated: _T) -> _T: ...

    @overload
    @classmethod
    def register_oot(
        cls, _decorated: None = None, *, name: str | None = None, include_subclasses: bool = False
    ) -> Callable[[_T], _T]: ...

    @classmethod
    def register_oot(
        cls,
        _decorated: Any = None,
        *,
        name: str | None = None,
        include_subclasses: bool = False,
    ) -> Any:
        """Register a replacement for this in-tree class.

        ``@RotaryEmbedding.register_oot`` keys it by ``"RotaryEmbedding"``;
        ``@CustomOp.register_oot(name="RotaryEmbedding")`` does the same from the base.
        Registering another class under a taken key is an error; registering the same
        class again is a no-op (plugins load once per process, but may be imported twice).
        """
        key = name or (cls.__name__ if cls is not CustomOp else None)
        if key is None:
            raise CustomOpError("CustomOp.register_oot needs name=<in-tree class name>")

        def decorator(op_cls: _T) -> _T:
            existing = op_registry_oot.get(key)
            if existing is not None and existing is not op_cls:
                raise CustomOpError(
                    f"{key} is already replaced by {existing.__module__}.{existing.__qualname__}; "
                    f"cannot also register {op_cls.__module__}.{op_cls.__qualname__}. Uninstall "
                    f"one of the plugins or leave one out with LOOM_PLUGINS."
                )
            if cls is not CustomOp and not issubclass(op_cls, cls):
                raise CustomOpError(
                    f"{op_cls.__qualname__} replaces {key} and must subclass {cls.__qualname__}"
                )
            op_registry_oot[key] = op_cls  # type: ignore[assignment]
            if include_subclasses:
                _oot_covers_subclasses.add(key)
            logger.debug("Registered out-of-tree op %s for %s", op_cls.__qualname__, key)
            return op_cls

        if _decorated is not None:
            return decorator(_decorated)
        return decorator

    @classmethod
    def register_kernel(cls, name: str, kernel: Callable[..., Any]) -> None:
        """Make ``kernel`` the implementation of op ``name``'s ``forward_cuda`` / ``forward_cpu`` here.

        Call it before the model is built (``Platform.register_triton_kernel_overrides``).
        Registering again replaces the kernel (the last platform hook wins).
        """
        if name not in KERNEL_SIGNATURES:
            raise CustomOpError(f"no kernel named {name!r} can be installed; known: {', '.join(KERNEL_SIGNATURES)}")
        if not callable(kernel):
            raise CustomOpError(f"kernel {name!r} must be callable, got {type(kernel).__name__}")
        kernel_registry[name] = kernel

    @classmethod
    def get_kernel(cls, name: str) -> Callable[..., Any] | None:
        """The kernel installed for op ``name``, or None."""
        return kernel_registry.get(name)

    @classmethod
    def clear_kernels(cls) -> None:
        """Forget every installed kernel (tests)."""
        kernel_registry.clear()


def _replacement_for(cls: type[CustomOp]) -> type[CustomOp]:
    """The class ``__new__`` builds for ``cls``: exact name first, then opted-in bases."""
    replacement = op_registry_oot.get(cls.__name__)
    if replacement is not None:
        return replacement
    if cls in op_registry_oot.values():
        return cls
    for base in cls.__mro__[1:]:
        if base.__name__ in _oot_covers_subclasses:
            return op_registry_oot[base.__name__]
    return cls
