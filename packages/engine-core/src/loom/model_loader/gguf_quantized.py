"""Load a GGUF file with its quantized linear weights kept quantized (``--quantization gguf``).

Read straight from a memory map of the GGUF file, through the tensor index the conversion cache
keeps (the cache's fp32 safetensors hold dequantized weights):

1. Each linear layer of the model (``LinearBase``) whose checkpoint tensors all have one of the
   block formats of ``gguf_quant.FORMATS`` with one width and group (a fused layer has several:
   q/k/v, gate/up): Q4_0, Q4_1, Q4_K (4-bit, groups of 32), Q8_0 (8-bit, 32) or Q6_K (8-bit,
   16), trades its dense weight for quantized parameters
   (``loom.layers.quantized.make_quantized_params``). Other formats (Q5_K and the other
   K-quants, F16, F32), mixed formats within a fused layer, the embedding, the norms and any
   layer whose per-rank input width is not whole groups load dequantized to the model's dtype,
   as with ``--quantization none``.
2. The tensors are streamed through ``model.load_weights``: a quantized layer's tensor as three,
   ``<name>.qweight/.qscale/.qzero`` (``gguf_quant.split_blocks``, Q/K rows put back in HF
   order), so tensor-parallel slicing and fused shards load as for a dense weight.
3. Each quantized layer's weight becomes its ``QuantizedLinear`` op (``finish_quantized``).
4. When the LM head's tensor (or, for tied embeddings, the embedding's) is in one of those
   formats, the model's ``LogitsProcessor`` gets a ``quantized_head`` over this rank's vocabulary
   rows (padding rows all zero): decoding a few streams reads the head's codes instead of its
   dense copy (SmolLM2's Q8_0 embedding: 30 MB instead of 57 MB per token in bf16). The embedding
   itself stays dense: a step reads only the rows of its tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn as nn
from loom_plugin_api.ops import QuantizedLinear, QuantizedWeight

from ..distributed import get_tensor_model_parallel_rank
from ..layers.linear import LinearBase
from ..layers.logits_processor import LogitsProcessor
from ..layers.quantized import (
    QPARAMS,
    CpuQuantizedWeight,
    finish_quantized,
    make_quantized_params,
    runs_a_kernel,
)
from ..logger import init_logger
from ..progress import progress_bar
from .base import load_weights_into
from .gguf_loader import cached_gguf_entries, dequantized, reverse_permute
from .gguf_quant import FORMATS, split_blocks

logger = init_logger(__name__)

__all__ = ["load_gguf_quantized"]


def _module_of(model: nn.Module, hf_name: str) -> str:
    """The module an HF weight name loads into, after the model's q/k/v and gate/up fusing."""
    base = hf_name.removesuffix(".weight")
    for param_name, weight_name, _ in getattr(model, "stacked_params_mapping", []):
        if base.endswith(weight_name):
            return base[: -len(weight_name)] + param_name
    return base


def _choose_quantized_layers(model: nn.Module, entries: list) -> dict[str, int]:
    """Quantized parameters for every linear layer whose checkpoint tensors share one block
    format's width and group size (q/k/v of Q4_K and Q6_K stay dense: one layer, one group);
    ``{module name: bits}``."""
    kinds: dict[str, set[tuple[int, int] | None]] = {}
    for name, _, tensor, _ in entries:
        if name.endswith(".weight"):
            kinds.setdefault(_module_of(model, name), set()).add(FORMATS.get(tensor.type_name))
    chosen = {}
    for module_name, formats in kinds.items():
        if len(formats) != 1 or None in formats:
            continue
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        bits, group = formats.pop()
        if isinstance(module, LinearBase) and make_quantized_params(module, group):
            chosen[module_name] = bits
    return chosen


def _tensors(model: nn.Module, entries: list, chosen: dict[str, int], source: str
             ) -> Iterator[tuple[str, torch.Tensor]]:
    with progress_bar(len(entries), "Loading GGUF weights", "tensor",
                      disable=get_tensor_model_parallel_rank() != 0) as bar:
        for entry in entries:
            yield from _entry_tensors(model, entry, chosen, source)
            bar.update(1)


def _entry_tensors(model: nn.Module, entry: tuple, chosen: dict[str, int], source: str
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    name, shape, tensor, n_head = entry
    if name.endswith(".weight") and _module_of(model, name) in chosen:
        parts = split_blocks(tensor.data.reshape(shape[0], -1), tensor.type_name)
        if n_head is not None:
            parts = tuple(reverse_permute(a, n_head) for a in parts)
        base = name.removesuffix("weight")
        for suffix, array in zip(QPARAMS, parts):
            yield base + suffix, torch.from_numpy(np.ascontiguousarray(array))
        return
    yield name, torch.from_numpy(dequantized(tensor, tensor.type_name, shape, n_head, source))


def _quantized_head(model: nn.Module, entries: list, dtype: torch.dtype) -> QuantizedLinear | None:
    """A ``QuantizedLinear`` over this rank's rows of the LM head, if the file holds it quantized."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None:
        return None
    wanted = "model.embed_tokens.weight" if embed is not None and lm_head.weight is embed.weight else "lm_head.weight"
    found = [(shape, tensor) for name, shape, tensor, _ in entries if name == wanted]
    if len(found) != 1 or found[0][1].type_name not in FORMATS:
        return None
    shape, tensor = found[0]
    bits, group = FORMATS[tensor.type_name]
    if shape[1] % group:
        return None
    q, scale, zero = (torch.from_numpy(np.ascontiguousarray(a))
                      for a in split_blocks(tensor.data.reshape(shape[0], -1), tensor.type_name))
    rows = lm_head.weight.shape[0]
    start, end = lm_head.vocab_start_index, min(lm_head.vocab_end_index, shape[0])
    real = max(end - start, 0)
    codes = torch.full((rows, shape[1]), 2 ** (bits - 1), dtype=torch.uint8)  # padding rows: weights of zero
    scales, zeros = torch.zeros(rows, scale.shape[1]), torch.zeros(rows, scale.shape[1])
    codes[:real], scales[:real], zeros[:real] = q[start:end], scale[start:end], zero[start:end]
    head = QuantizedLinear(QuantizedWeight(codes, scales, zeros, bits, group), dtype)
    if not runs_a_kernel(head):
        return None  # the dense head is faster than dequantizing the whole head every step
    prepared = head.kernel_weight()
    if isinstance(prepared, CpuQuantizedWeight) and not prepared.reads_codes:
        return None  # it would multiply through a dense copy of its own: a second dense head
    head.release_weight()  # the op's reference; a packed 8-bit head's neutral codes go with it
    logger.info("The LM head runs on its %d-bit codes for steps of a few rows", bits)
    return head


def load_gguf_quantized(model: nn.Module, path: str, dtype: torch.dtype) -> dict[str, int]:
    """Load ``path`` into ``model`` with its quantized linear weights kept so; ``{layer: bits}`` of
    the layers that stayed quantized (none where no kernel runs the op: those hold the same values dense)."""
    entries = cached_gguf_entries(path)
    chosen = _choose_quantized_layers(model, entries)
    load_weights_into(model, _tensors(model, entries, chosen, path), path)
    chosen = {name: bits for name, bits in chosen.items() if finish_quantized(model.get_submodule(name), bits, dtype)}
    processors = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    head = _quantized_head(model, entries, dtype) if len(processors) == 1 else None
    if head is not None:
        processors[0].quantized_head = head
    by_bits = {b: sum(1 for v in chosen.values() if v == b) for b in sorted(set(chosen.values()))}
    logger.info("Kept %s linear layers of %s quantized (GGUF blocks); the rest dequantized to %s",
                " and ".join(f"{n} {b}-bit" for b, n in by_bits.items()) or "no", path, dtype)
    return chosen
