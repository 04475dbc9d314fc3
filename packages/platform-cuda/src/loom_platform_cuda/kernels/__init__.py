"""Triton kernels of the CUDA platform, and their plain-torch references (``.reference``).

Every wrapper validates its inputs (``ValueError`` naming the bad argument) and launches
with fixed, heuristic block sizes, so the kernels also run in Triton's CPU interpreter
(``TRITON_INTERPRET=1``), which is how the tests run without a GPU. Importing this package
needs triton, not a GPU. Supported dtypes: float32, float16, bfloat16.
"""

from __future__ import annotations

from .activation import silu_and_mul
from .attention import paged_attention, paged_attention_decode, paged_attention_prefill
from .cache import reshape_and_cache
from .layernorm import rms_norm
from .lora import lora
from .quantized_linear import PackedQuantizedWeight, prepare_quantized_linear, quantized_linear
from .rotary import rotary_embedding

__all__ = [
    "PackedQuantizedWeight",
    "lora",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "prepare_quantized_linear",
    "quantized_linear",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
