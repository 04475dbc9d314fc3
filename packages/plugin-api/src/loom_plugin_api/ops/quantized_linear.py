"""``QuantizedLinear``: a weight-only quantized matmul, and ``QuantizedWeight``, the weights' form.

Quantized checkpoints (GGUF's Q4_0 / Q4_1 / Q8_0) and round-to-nearest quantization at load
(``--quantization int4`` / ``int8``) all reach a platform in one vendor-neutral form,
:class:`QuantizedWeight`: unsigned codes, one scale and one zero per group of ``group_size``
weights along the input dimension. A weight is ``(q - 2**(bits - 1)) * scale + zero``.

A platform supplies the kernel (``CustomOp.register_kernel("quantized_linear", fn)``, called
``fn(x, weight, bias)``). Packing the codes into the kernel's own layout happens once, at load:
a kernel that has a ``prepare`` attribute gets ``fn.prepare(weight, dtype)``'s result as its
``weight`` on every call instead of the :class:`QuantizedWeight` (``dtype`` is the model's
compute dtype). Without a kernel, ``forward_native`` dequantizes and multiplies in plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..custom_op import CustomOp

__all__ = ["QUANTIZED_BITS", "QuantizedLinear", "QuantizedWeight"]

QUANTIZED_BITS = (4, 8)
"""Code widths a :class:`QuantizedWeight` may have."""


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """An ``(out, in)`` weight as group-wise codes.

    ``w[o, i] = (qweight[o, i] - 2**(bits - 1)) * scale[o, i // group_size] + zero[o, i // group_size]``

    - ``qweight``: uint8 ``(out, in)``, codes ``0 .. 2**bits - 1`` (one per byte; a kernel packs
      them as it likes in ``prepare``);
    - ``scale``, ``zero``: float32 ``(out, in // group_size)``;
    - ``bits``: 4 or 8; ``group_size``: weights per scale, a divisor of ``in``.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in QUANTIZED_BITS:
            raise ValueError(f"QuantizedWeight.bits must be one of {QUANTIZED_BITS}, got {self.bits}")
        if self.qweight.dtype != torch.uint8 or self.qweight.dim() != 2:
            raise ValueError(f"QuantizedWeight.qweight must be a 2-D uint8 tensor (out, in), got "
                             f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        out_features, in_features = self.qweight.shape
        if self.group_size <= 0 or in_features % self.group_size:
            raise ValueError(f"QuantizedWeight.group_size {self.group_size} must divide the input width "
                             f"{in_features}")
        groups = (out_features, in_features // self.group_size)
        for name in ("scale", "zero"):
            t = getattr(self, name)
            if t.dtype != torch.float32 or tuple(t.shape) != groups:
                raise ValueError(f"QuantizedWeight.{name} must be float32 {groups}, got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)``."""
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``(out, in)`` weights, computed in fp32 and returned in ``dtype``."""
        out_features, in_features = self.shape
        w = self.qweight.reshape(out_features, in_features // self.group_size, self.group_size).float()
        w.sub_(2 ** (self.bits - 1)).mul_(self.scale.unsqueeze(-1)).add_(self.zero.unsqueeze(-1))  # one fp32 copy
        return w.view(out_features, in_features).to(dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its tensors on ``device``."""
        return QuantizedWeight(self.qweight.to(device), self.scale.to(device), self.zero.to(device),
                               self.bits, self.group_size)


# the methods that run the installed kernel; forward_oot is a replacement class's own
_KERNEL_METHODS = ("forward_cpu", "forward_cuda")


@CustomOp.register("quantized_linear")
class QuantizedLinear(CustomOp):
    """``x @ weight.dequantize().T + bias`` for a :class:`QuantizedWeight`, in ``x``'s dtype.

    Built once per layer after its weights are loaded: ``QuantizedLinear(weight, dtype)``, then
    ``forward(x, bias=None)``. ``dtype`` is the activations' dtype (float32, bfloat16 or float16);
    ``x`` is ``(..., in)``, the output ``(..., out)`` in ``x``'s dtype whatever the bias's float dtype.
    The weight's tensors are on the device the layer computes on (loom's loader builds them in host
    memory, and uses quantized layers on host platforms only so far). On an out-of-tree platform the
    op runs ``forward_oot``, which is ``forward_native`` unless the platform replaces the class; where
    no kernel or replacement would run it, loom's loader keeps the layer dense instead.
    """

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype
        self._kernel: Any = None
        self._prepared: Any = None
        if self.forward_method_name in _KERNEL_METHODS:  # the kernel's layout, made once, at load
            self.kernel_weight()

    def forward_native(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is None:
            raise RuntimeError("QuantizedLinear.forward_native: the weight was released to the kernel's layout")
        w = self.weight.dequantize(torch.float32).to(x.device)
        out = F.linear(x.float(), w, None if bias is None else bias.float())
        return out.to(x.dtype)

    def forward_cuda(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._forward_kernel(x, bias)

    def forward_cpu(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._forward_kernel(x, bias)

    def kernel_weight(self) -> Any:
        """What the installed kernel takes as ``weight``: its ``prepare`` result, made on first use
        (the layer keeps that kernel: the layout is the kernel's own); the ``QuantizedWeight``
        itself where the op runs no installed kernel (``forward_native``, a replacement class's
        ``forward_oot``)."""
        if self.forward_method_name not in _KERNEL_METHODS:
            return self.weight
        if self._kernel is None:
            kernel = CustomOp.get_kernel("quantized_linear")
            if kernel is None:
                return self.weight
            prepare = getattr(kernel, "prepare", None)
            self._prepared = self.weight if prepare is None else prepare(self.weight, self.dtype)
            self._kernel = kernel
        return self._prepared

    def release_weight(self) -> bool:
        """Free the ``QuantizedWeight`` once the kernel's ``prepare`` made its own layout of it, so
        that a layer computing only through that kernel holds its weights once; False, and nothing
        freed, where no kernel prepared one. Afterwards ``weight`` is None and ``forward_native``
        cannot run (the kernel still does)."""
        if self.forward_method_name not in _KERNEL_METHODS:
            return False
        self.kernel_weight()
        if self._kernel is None or self._prepared is self.weight:
            return False
        self.weight = None  # type: ignore[assignment]
        return True

    def _forward_kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The platform's ``quantized_linear`` kernel (the one installed when the layout was made),
        else ``forward_native``."""
        if self._kernel is None:
            self.kernel_weight()
            if self._kernel is None:  # none installed
                return self.forward_native(x, bias)
        return self._kernel(x, self._prepared, bias)

    def extra_repr(self) -> str:
        if self.weight is None:
            return f"released to {type(self._prepared).__name__}"
        out_features, in_features = self.weight.shape
        return f"in={in_features}, out={out_features}, bits={self.weight.bits}, group_size={self.weight.group_size}"
