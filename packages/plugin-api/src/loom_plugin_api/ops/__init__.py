"""The replaceable ops: what a platform may replace, and the reference it must match.

Each op is a ``CustomOp`` subclass whose ``forward_native`` is the reference semantics (in
plain torch, fp32 inside, cast back to the input dtype). Model code builds them by class;
a platform replaces one through ``CustomOp.register_oot`` (a class) or
``CustomOp.register_kernel`` (a kernel behind ``forward_cuda``). The conformance kit
(``loom_plugin_api.testing``) checks a replacement against ``forward_native`` over shapes
and dtypes.

==================  ========================  ==================================================
op name             class                     constructor -> forward
==================  ========================  ==================================================
``rms_norm``        ``RMSNorm``               ``(hidden_size, eps=1e-6, dtype=None)`` ->
                                              ``forward(x, residual=None)``: ``x`` or
                                              ``(normed(x + residual), x + residual)``
``layer_norm``      ``LayerNorm``             ``(hidden_size, eps=1e-5, elementwise_affine=True,
                                              bias=True, dtype=None)`` -> ``forward(x)``
``rotary_embedding``  ``RotaryEmbedding``     ``(head_size, rotary_dim, max_position, base,
                                              is_neox_style=True, dtype=None)`` ->
                                              ``forward(positions, query, key)`` -> ``(query, key)``
``silu_and_mul``    ``SiluAndMul``            ``()`` -> ``forward(x)``: ``silu(x[..., :d]) * x[..., d:]``
``quantized_linear``  ``QuantizedLinear``     ``(weight: QuantizedWeight, dtype)`` ->
                                              ``forward(x, bias=None)``:
                                              ``x @ weight.dequantize().T + bias``
``lora``            ``BatchedLoRA``           ``()`` -> ``forward(y, x, lora_a, lora_b, mapping)``:
                                              ``y[t] += x[t] @ lora_a[s].T @ lora_b[s].T`` for the
                                              rows ``t`` of each adapter slot ``s`` in ``mapping``
==================  ========================  ==================================================

``QuantizedWeight`` is the vendor-neutral form of group-wise quantized weights (codes, scales,
zeros); a ``quantized_linear`` kernel may pack it once through its ``prepare`` attribute.
``LoRAMapping`` gives each row of a step its adapter slot (``LoRAMapping.from_token_slots``).

``LinearScalingRotaryEmbedding`` and ``Llama3RotaryEmbedding`` subclass
``RotaryEmbedding`` (``get_rope`` picks one from an HF ``rope_scaling`` dict); they are
replaced with it only under ``register_oot(include_subclasses=True)``.

The classes import torch, so they load on first use of their name here.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "REPLACEABLE_OPS",
    "BatchedLoRA",
    "LayerNorm",
    "Llama3RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "LoRAMapping",
    "QuantizedLinear",
    "QuantizedWeight",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "get_rope",
]

REPLACEABLE_OPS: dict[str, str] = {
    "rms_norm": "RMSNorm",
    "layer_norm": "LayerNorm",
    "rotary_embedding": "RotaryEmbedding",
    "silu_and_mul": "SiluAndMul",
    "quantized_linear": "QuantizedLinear",
    "lora": "BatchedLoRA",
}
"""Op name (what ``custom_ops`` switches and ``register_kernel`` keys) -> class name
(what ``register_oot`` keys)."""

_LAZY = {
    "RMSNorm": "layernorm",
    "LayerNorm": "layernorm",
    "RotaryEmbedding": "rotary_embedding",
    "LinearScalingRotaryEmbedding": "rotary_embedding",
    "Llama3RotaryEmbedding": "rotary_embedding",
    "get_rope": "rotary_embedding",
    "SiluAndMul": "activation",
    "QuantizedLinear": "quantized_linear",
    "QuantizedWeight": "quantized_linear",
    "BatchedLoRA": "lora",
    "LoRAMapping": "lora",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loom_plugin_api.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
