"""The dummy platform's replacement ops: ``RotaryEmbedding`` (counts its calls) and
``QuantizedLinear`` (prepares its own layout of the weights once, as a vendor's kernel would)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from loom_plugin_api.ops.quantized_linear import QuantizedLinear, QuantizedWeight
from loom_plugin_api.ops.rotary_embedding import RotaryEmbedding

from .logging import logger


@RotaryEmbedding.register_oot
class DummyRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding that runs through ``forward_oot`` on the dummy platform.

    ``forward_oot_calls`` counts calls in this process, so tests can see it ran.
    """

    forward_oot_calls = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.addition_config = True

    def forward_oot(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cls = type(self)
        if cls.forward_oot_calls == 0:  # once per process, so the serve's log shows where it runs
            logger.info("DummyRotaryEmbedding.forward_oot runs in pid %d", os.getpid())
        cls.forward_oot_calls += 1
        return super().forward_oot(*args, **kwargs)


@QuantizedLinear.register_oot
class DummyQuantizedLinear(QuantizedLinear):
    """Quantized linear layers on the dummy device: the layout is made once, when the layer is
    built (here the dequantized weights in the activations' dtype; a real device keeps the codes
    in its kernel's own layout), and ``forward_oot`` multiplies through it. Without a
    replacement (or a kernel) loom keeps such layers dense, since ``forward_native`` would
    dequantize every weight on every call.
    """

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__(weight, dtype)
        # only where forward_oot runs (--custom-ops -quantized_linear picks forward_native)
        self.layout = weight.dequantize(dtype) if self.forward_method_name == "forward_oot" else None

    def forward_oot(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = F.linear(x.to(self.dtype), self.layout, None if bias is None else bias.to(self.dtype))
        return out.to(x.dtype)
