"""CPU linear layers on weights prepacked for oneDNN.

``F.linear`` on the CPU hands torch's ``(out, in)`` weight to the GEMM library on every call,
which re-lays it out for its micro-kernels each time. oneDNN can do that once: after the
weights are loaded, ``prepack_model`` replaces each linear layer's weight with oneDNN's
blocked copy (``torch.ops.mkldnn._reorder_linear_weight``) and the layer multiplies through
``torch.ops.mkldnn._linear_pointwise``. The result is the same matmul (bit-identical in bf16
on the machines measured, within float rounding in fp32); ``bench/roofline.py`` prints the
per-shape rates of both.

The packed weight replaces the dense one (no second copy); ``weight.to_dense()`` and the
model's ``state_dict()`` give the dense tensor back. The LM head, whose weight is often the
embedding table as well, is packed as a separate copy in vocabulary chunks (``PackedHead``),
since the embedding gathers rows.

Only on the CPU, for float32 and bfloat16 (bf16 where oneDNN packs it on this CPU: ``packs``),
where torch was built with oneDNN;
``LOOM_CPU_PREPACK=0`` keeps ``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from loom_plugin_api.ops.quantized_linear import QuantizedLinear

from .. import envs
from ..logger import init_logger

logger = init_logger("loom.layers.onednn")

__all__ = ["PackedHead", "available", "linear", "pack_weight", "prepack_model"]

DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any row count still works


@functools.cache
def available() -> bool:
    """Whether this torch can pack and run oneDNN linear weights (x86 and Arm builds can)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU: its bf16 reorder needs AVX512 (bw, vl,
    dq) or AVX-NE-CONVERT, which an AVX2-only CPU lacks; asked once, by trying it."""
    if dtype not in DTYPES or not available():
        return False
    try:
        pack_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as e:
        logger.info("oneDNN does not pack %s weights on this CPU (%s): F.linear instead", dtype, e)
        return False
    return True


def enabled_for(weight: torch.Tensor) -> bool:
    return (envs.LOOM_CPU_PREPACK and weight.device.type == "cpu" and not weight.is_mkldnn
            and packs(weight.dtype))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a dense ``(out, in)`` weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a dense or a packed weight, or through a quantized layer's op
    (``layers/quantized.py``)."""
    if isinstance(weight, QuantizedLinear):
        return weight(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedHead:
    """The LM head's weight packed in vocabulary chunks: ``[(lo, hi, packed rows lo:hi)]``."""

    def __init__(self, weight: torch.Tensor, chunk: int) -> None:
        # every row of this rank's shard, padding too: forward() gathers whole shards across ranks
        self.chunk = chunk
        rows = weight.shape[0]
        self.chunks = [(lo, min(lo + chunk, rows), pack_weight(weight[lo:lo + chunk])) for lo in range(0, rows, chunk)]


def prepack_model(model: nn.Module) -> int:
    """Pack every linear layer's weight (and the LM head) of a loaded CPU model; how many."""
    # here, not at the top: both modules import this one for ``linear`` and ``PackedHead``
    from .linear import LinearBase
    from .logits_processor import LogitsProcessor

    packed = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearBase) and isinstance(module.weight, QuantizedLinear):
                continue  # its kernel's layouts were made when the layer was built (layers/quantized.py)
            if isinstance(module, LinearBase) and enabled_for(module.weight):
                loader = getattr(module.weight, "weight_loader", None)
                module.weight = nn.Parameter(pack_weight(module.weight), requires_grad=False)
                if loader is not None:
                    module.weight.weight_loader = loader  # type: ignore[attr-defined]
                module.register_state_dict_post_hook(_dense_state)
                packed += 1
        lm_head = getattr(model, "lm_head", None)
        for module in model.modules():
            if (isinstance(module, LogitsProcessor) and module.packed_head is None and lm_head is not None
                    and enabled_for(lm_head.weight)):
                module.packed_head = PackedHead(lm_head.weight, module.chunk)
                packed += 1
    if packed:
        _return_freed_memory()
        logger.info("Prepacked %d linear weights for oneDNN (LOOM_CPU_PREPACK=0 to keep F.linear)", packed)
    return packed


def _return_freed_memory() -> None:
    """Give the dense weights' freed pages back to the OS: the CPU worker tells glibc not to
    trim its heap between steps, so without this they would stay in the worker's RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _dense_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict()`` keeps showing the dense ``(out, in)`` weight of a packed layer."""
    key = prefix + "weight"
    if key in state_dict and state_dict[key].is_mkldnn:
        state_dict[key] = state_dict[key].to_dense()
