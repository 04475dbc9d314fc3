"""LoRA slots on the linear layers: the adapters a layer can apply in one step.

Every linear layer of the decoder layers gets a :class:`LoRASlots` (``layer.lora``) when LoRA is
on. It holds ``max_loras`` slots, each an adapter's A and B for this rank's shard, stacked for the
contract's ``BatchedLoRA`` op, and the layer adds the op's result to its output before any
all-reduce (``layers/linear.py``), so the row-parallel partial products sum like the base ones.

A merged layer (Llama's qkv and gate/up, OPT's qkv) serves one adapted module per slice: slice
``i`` owns rank rows ``[i * R, (i + 1) * R)`` of A (``R`` = ``--max-lora-rank``) and, in B, the
columns of those rows and the output rows of its slice, a block-diagonal B that multiplies the
whole merged output at once. An adapter of rank ``r < R`` fills the first ``r`` rows of its
block; the rest stay zero. Tensor parallelism shards like the base weights: a column-parallel
layer keeps its output rows of B (each slice's own rows; replicated KV heads as the base does)
and all of A, a row-parallel layer its input columns of A and all of B.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from loom_plugin_api.context import current_lora_mapping
from loom_plugin_api.ops.lora import BatchedLoRA

from ..layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

__all__ = ["LoRASlots", "StepAdapters", "slices_of"]


def slices_of(layer: LinearBase) -> list[Any]:
    """The shard ids of a layer's adaptable slices: q/k/v, the merged outputs' indices, or [None]."""
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


def _full_dims(layer: LinearBase, shard_id: Any) -> tuple[int, int]:
    """``(in, out)`` of one slice of the unsharded layer: what a checkpoint's A and B are shaped by."""
    if isinstance(layer, QKVParallelLinear):
        heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
        return layer.input_size, heads * layer.head_size
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.input_size, layer.output_sizes[shard_id]
    return layer.input_size, layer.output_size


class StepAdapters:
    """What the manager prepared for the running step, shared by every layer's slots: a runner
    that drops the step's mapping (a platform's ``run_model`` that does not pass
    ``inputs.lora_mapping`` to ``set_forward_context``) is an error, never the base model's tokens."""

    __slots__ = ("mapping",)

    def __init__(self) -> None:
        self.mapping: Any = None


class LoRASlots(nn.Module):
    """``max_loras`` adapter slots of one linear layer; ``forward(x, y)`` adds the step's adapters to ``y``."""

    def __init__(self, layer: LinearBase, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, state: StepAdapters | None = None) -> None:
        super().__init__()
        self.state = state or StepAdapters()
        self.prefix = layer.prefix
        self.slices = slices_of(layer)
        self.max_rank = max_rank
        self.tp_rank, self.tp_size = layer.tp_rank, layer.tp_size
        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.column_parallel = isinstance(layer, ColumnParallelLinear)
        self._layer = [layer]  # not a submodule: the layer owns this module, not the reverse
        in_features = layer.input_size_per_partition if self.row_parallel else layer.input_size
        out_features = layer.output_size_per_partition if self.column_parallel else layer.output_size
        width = len(self.slices) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, width, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, out_features, width, dtype=dtype, device=device),
                             persistent=False)
        self.op = BatchedLoRA()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mapping = current_lora_mapping()
        if mapping is None:
            if self.state.mapping is not None:
                raise RuntimeError("this step has LoRA adapters, but the model ran without them: the platform's "
                                   "runner must pass ModelInput.lora_mapping to set_forward_context")
            return y
        return self.op(y, x.reshape(-1, x.shape[-1]), self.lora_a, self.lora_b, mapping)

    # ---- loading ------------------------------------------------------------------------------
    def shard(self, index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of slice ``index``'s full ``a`` ``(r, in)`` and ``b`` ``(out, r)``;
        a shape that does not fit the layer is a ValueError naming it."""
        layer = self._layer[0]
        shard_id = self.slices[index]
        d_in, d_out = _full_dims(layer, shard_id)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, d_in) or tuple(b.shape) != (d_out, r):
            what = self.prefix + (f"[{shard_id}]" if shard_id is not None else "")
            raise ValueError(f"LoRA weights for {what} have shapes A {tuple(a.shape)}, B {tuple(b.shape)}; the layer "
                             f"needs A (r, {d_in}) and B ({d_out}, r)")
        if r > self.max_rank:
            raise ValueError(f"LoRA rank {r} is above --max-lora-rank {self.max_rank}")
        if self.row_parallel:
            width = layer.input_size_per_partition
            return a.narrow(1, self.tp_rank * width, width), b
        if isinstance(layer, QKVParallelLinear):
            _, rows, shard_rank = layer._shard_layout(shard_id)
            return a, b.narrow(0, shard_rank * rows, rows)
        if isinstance(layer, MergedColumnParallelLinear):
            rows = layer.output_sizes[shard_id] // self.tp_size
            return a, b.narrow(0, self.tp_rank * rows, rows)
        if self.column_parallel:
            rows = layer.output_size_per_partition
            return a, b.narrow(0, self.tp_rank * rows, rows)
        return a, b

    def _out_rows(self, index: int) -> tuple[int, int]:
        """(offset, rows) of slice ``index`` in this rank's output."""
        layer = self._layer[0]
        shard_id = self.slices[index]
        if isinstance(layer, QKVParallelLinear):
            offset, rows, _ = layer._shard_layout(shard_id)
            return offset, rows
        if isinstance(layer, MergedColumnParallelLinear):
            return sum(layer.output_sizes[:shard_id]) // self.tp_size, layer.output_sizes[shard_id] // self.tp_size
        return 0, self.lora_b.shape[1]

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter in ``slot``: ``weights`` maps a slice index to this rank's ``(a, b)``
        (from :meth:`shard`, scaling folded into ``b``); slices it lacks stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        R = self.max_rank
        for index, (a, b) in weights.items():
            r = a.shape[0]
            offset, rows = self._out_rows(index)
            self.lora_a[slot, index * R:index * R + r].copy_(a)
            self.lora_b[slot, offset:offset + rows, index * R:index * R + r].copy_(b)

    def extra_repr(self) -> str:
        slots, out_features, width = self.lora_b.shape
        return f"slots={slots}, max_rank={self.max_rank}, slices={self.slices}, out={out_features}"
