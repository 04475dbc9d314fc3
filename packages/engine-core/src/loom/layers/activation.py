"""Activations: the fused ``SiluAndMul`` of gated MLPs, and plain ones by their HF name."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from loom_plugin_api.ops.activation import SiluAndMul

__all__ = ["SiluAndMul", "get_act_fn"]


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
