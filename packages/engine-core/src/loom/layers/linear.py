"""Linear layers split across tensor-parallel ranks (vLLM's names and sharding rules).

Weights are ``(out_features, in_features)`` as in ``nn.Linear``. A column-parallel layer
keeps rows ``[rank * out/tp, (rank + 1) * out/tp)`` of the full weight; a row-parallel
layer keeps that slice of the columns and sums the partial outputs over the group.
Each parameter carries ``param.weight_loader(param, loaded_weight, shard_id=None)``,
which copies this rank's slice of a full checkpoint tensor into it. On the CPU, loaded
weights may then be replaced by oneDNN's packed layout (``onednn.prepack_model``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from .onednn import linear, silu_and_mul_linear

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "divide",
]


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}; "
            "choose a --tensor-parallel-size that divides it"
        )
    return numerator // denominator


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"{name}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
            f"shard of shape {tuple(param.shape)}; the checkpoint does not match the model config"
        )
    param.copy_(loaded)


class LinearBase(nn.Module):
    """Shared set-up: sizes, dtype, and this rank's place in the TP group."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.has_bias = bias
        self.lora: nn.Module | None = None
        """The layer's LoRA slots (``loom.lora.layers.LoRASlots``) when adapters are served: called
        ``lora(x, y)`` on this rank's input and output before any all-reduce or gather."""

    def _make_params(self, out_features: int, in_features: int, bias_features: int | None) -> None:
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if self.has_bias and bias_features is not None:
            self.bias = nn.Parameter(torch.empty(bias_features, dtype=self.params_dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.input_size}, out_features={self.output_size}, bias={self.has_bias}, tp_size={self.tp_size}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, params_dtype, prefix)
        self._make_params(output_size, input_size, output_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        with torch.no_grad():
            _copy_checked(param.data, loaded_weight, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)  # (T, out)
        if self.lora is not None:
            out = self.lora(x, out)
        return out


class ColumnParallelLinear(LinearBase):
    """``Y = X A`` with ``A`` split by output rows; ``gather_output`` all-gathers ``Y``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, params_dtype, prefix)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size, f"{prefix or 'layer'} output size")
        self._make_params(self.output_size_per_partition, input_size, self.output_size_per_partition)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        shard = param.shape[0]
        with torch.no_grad():
            _copy_checked(param.data, loaded_weight.narrow(0, self.tp_rank * shard, shard), self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)  # (T, out / tp)
        if self.lora is not None:
            out = self.lora(x, out)
        if self.gather_output:
            out = tensor_model_parallel_all_gather(out, dim=-1)  # (T, out)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (Llama's gate and up projections).

    Each rank's weight is ``[shard 0 of out_0; shard 0 of out_1; ...]``; checkpoint tensors
    load one at a time with ``shard_id`` = their index in ``output_sizes``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype, prefix)
        for size in self.output_sizes:
            divide(size, self.tp_size, f"{prefix or 'layer'} output size")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor
            super().weight_loader(param, loaded_weight)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: shard_id must be an index into {self.output_sizes}, got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        with torch.no_grad():
            _copy_checked(param.data.narrow(0, offset, size),
                          loaded_weight.narrow(0, self.tp_rank * size, size), f"{self.prefix}[{shard_id}]")

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this layer's two outputs in one pass where its weight's form has
        one (``onednn.silu_and_mul_linear``: loom's bf16 GEMM on the CPU), else None: the caller
        runs the layer, then ``SiluAndMul``. Only for two outputs of one size, without LoRA
        (adapters add to the outputs before the activation) or a gathered output."""
        if (self.lora is not None or self.gather_output or len(self.output_sizes) != 2
                or self.output_sizes[0] != self.output_sizes[1]):
            return None
        return silu_and_mul_linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, split by heads.

    With fewer KV heads than ranks, each KV head is replicated on ``tp / num_kv_heads``
    consecutive ranks. Checkpoint tensors load with ``shard_id`` ``"q"``, ``"k"`` or ``"v"``.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = True, params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads, "(replicated KV heads) TP size")
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, False, params_dtype, prefix)

    def _shard_layout(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in this rank's param, rows, index of this rank's slice in the checkpoint)."""
        q_rows = self.num_heads * self.head_size
        kv_rows = self.num_kv_heads * self.head_size
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        layout = {"q": (0, q_rows, self.tp_rank), "k": (q_rows, kv_rows, kv_rank), "v": (q_rows + kv_rows, kv_rows, kv_rank)}
        if shard_id not in layout:
            raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return layout[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:  # an already-fused qkv checkpoint tensor
            for sid, start in (("q", 0), ("k", self.total_num_heads), ("v", self.total_num_heads + self.total_num_kv_heads)):
                heads = self.total_num_heads if sid == "q" else self.total_num_kv_heads
                self.weight_loader(param, loaded_weight.narrow(0, start * self.head_size, heads * self.head_size), sid)
            return
        offset, rows, shard_rank = self._shard_layout(shard_id)
        with torch.no_grad():
            _copy_checked(param.data.narrow(0, offset, rows),
                          loaded_weight.narrow(0, shard_rank * rows, rows), f"{self.prefix}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """``Y = X A`` with ``A`` split by input columns; partial outputs are summed (all-reduce).

    ``input_is_parallel``: ``X`` is already this rank's slice (the output of a
    column-parallel layer); otherwise the layer takes its slice of the full ``X``.
    The bias is added by rank 0 only, so the reduced output holds it once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, params_dtype, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, f"{prefix or 'layer'} input size")
        self._make_params(output_size, self.input_size_per_partition, output_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        with torch.no_grad():
            if param.dim() == 1:  # the bias is replicated
                _copy_checked(param.data, loaded_weight, self.prefix)
                return
            shard = param.shape[1]
            _copy_checked(param.data, loaded_weight.narrow(1, self.tp_rank * shard, shard), self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            shard = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * shard, shard).contiguous()  # (T, in / tp)
        # Only rank 0 adds the bias, so the sum over ranks holds it once.
        bias = self.bias if self.tp_rank == 0 else None
        out = linear(x, self.weight, bias)  # (T, out), this rank's partial sum
        if self.lora is not None:  # its partial product too: B @ (sum over ranks of A_r x_r)
            out = self.lora(x, out)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
