"""Load a GGUF file with its 4-bit linear weights kept as int4 (``--quantization gguf``).

Read straight from a memory map of the GGUF file, through the tensor index the conversion cache
keeps (the cache's fp32 safetensors hold dequantized weights):

1. Each linear layer of the model (``LinearBase``) whose checkpoint tensors are all Q4_0 or
   Q4_1 (a fused layer has several: q/k/v, gate/up) trades its dense weight for int4
   parameters (``loom.layers.quantized.make_int4_params``). Other formats (Q8_0, K-quants,
   F16, F32), the embedding, the norms and any layer whose input width is not whole groups
   of 32 load dequantized to the model's dtype, as with ``--quantization none``.
2. The tensors are streamed through ``model.load_weights``: an int4 layer's tensor as three,
   ``<name>.qweight/.qscale/.qzero`` (``gguf_quant.split_int4_blocks``, Q/K rows put back in
   HF order), so tensor-parallel slicing and fused shards load as for a dense weight.
3. Each int4 layer is packed for the CPU int4 matmul (``finish_int4``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn as nn

from ..layers.linear import LinearBase
from ..layers.quantized import QPARAMS, available, finish_int4, make_int4_params
from ..logger import init_logger
from .base import load_weights_into
from .gguf_loader import cached_gguf_entries, dequantized, reverse_permute
from .gguf_quant import INT4_TYPES, split_int4_blocks

logger = init_logger(__name__)

__all__ = ["load_gguf_int4"]


def _module_of(model: nn.Module, hf_name: str) -> str:
    """The module an HF weight name loads into, after the model's q/k/v and gate/up fusing."""
    base = hf_name.removesuffix(".weight")
    for param_name, weight_name, _ in getattr(model, "stacked_params_mapping", []):
        if base.endswith(weight_name):
            return base[: -len(weight_name)] + param_name
    return base


def _choose_int4_layers(model: nn.Module, entries: list) -> set[str]:
    """Give int4 parameters to every linear layer whose checkpoint tensors are all 4-bit."""
    kinds: dict[str, list[str]] = {}
    for name, _, tensor, _ in entries:
        if name.endswith(".weight"):
            kinds.setdefault(_module_of(model, name), []).append(tensor.type_name)
    chosen = set()
    for module_name, types in kinds.items():
        if not all(t in INT4_TYPES for t in types):
            continue
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        if isinstance(module, LinearBase) and make_int4_params(module):
            chosen.add(module_name)
    return chosen


def _tensors(model: nn.Module, entries: list, chosen: set[str], source: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape, tensor, n_head in entries:
        if name.endswith(".weight") and _module_of(model, name) in chosen:
            parts = split_int4_blocks(tensor.data.reshape(shape[0], -1), tensor.type_name)
            if n_head is not None:
                parts = tuple(reverse_permute(a, n_head) for a in parts)
            base = name.removesuffix("weight")
            for suffix, array in zip(QPARAMS, parts):
                yield base + suffix, torch.from_numpy(np.ascontiguousarray(array))
            continue
        yield name, torch.from_numpy(dequantized(tensor, tensor.type_name, shape, n_head, source))


def load_gguf_int4(model: nn.Module, path: str, dtype: torch.dtype) -> int:
    """Load ``path`` into ``model`` with its 4-bit linear weights as int4; how many layers are."""
    if not available():
        raise RuntimeError("--quantization gguf needs torch's CPU int4 matmul (_weight_int4pack_mm_for_cpu), "
                           f"which torch {torch.__version__} lacks; use --quantization none")
    entries = cached_gguf_entries(path)
    chosen = _choose_int4_layers(model, entries)
    load_weights_into(model, _tensors(model, entries, chosen, path), path)
    for module_name in chosen:
        finish_int4(model.get_submodule(module_name), dtype)
    logger.info("Kept %d linear layers of %s as int4 (GGUF Q4_0/Q4_1); the rest dequantized to %s",
                len(chosen), path, dtype)
    return len(chosen)
