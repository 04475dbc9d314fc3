"""Activations: the fused ``SiluAndMul`` of gated MLPs, and plain ones by their HF name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from loom_plugin_api import CustomOp

from .kernels import get_kernel_override

__all__ = ["SiluAndMul", "get_act_fn"]


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2 * d`` (gate, up)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]  # (T, d)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        kernel = get_kernel_override("silu_and_mul")
        return self.forward_native(x) if kernel is None else kernel(x)


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "swish": nn.SiLU,
}


def get_act_fn(name: str) -> nn.Module:
    """The activation module for an HF ``hidden_act``/``activation_function`` name."""
    factory = _ACTIVATIONS.get(name.lower())
    if factory is None:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return factory()
