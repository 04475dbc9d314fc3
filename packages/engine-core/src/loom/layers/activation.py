"""Activations: the fused ``SiluAndMul`` of gated MLPs, and plain ones by their HF name."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from loom_plugin_api.ops.activation import SiluAndMul

__all__ = ["SiluAndMul", "get_act_fn"]


# ReLU and SiLU work in place: their input is always a fresh projection output that nothing
# else reads, and a new (T, ffn) tensor per layer costs more in memory traffic than the op.
_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": lambda: nn.ReLU(inplace=True),
    "gelu": nn.GELU,
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": lambda: nn.SiLU(inplace=True),
    "swish": lambda: nn.SiLU(inplace=True),
}


def get_act_fn(name: str) -> nn.Module:
    """The activation module for an HF ``hidden_act``/``activation_function`` name (it may
    overwrite its input)."""
    factory = _ACTIVATIONS.get(name.lower())
    if factory is None:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return factory()
