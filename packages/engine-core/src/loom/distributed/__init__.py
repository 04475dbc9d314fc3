"""Tensor parallelism: the group a worker belongs to and the collectives the layers call."""

from __future__ import annotations

from .parallel_state import (
    TensorParallelGroup,
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    initialize_model_parallel,
    model_parallel_is_initialized,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "TensorParallelGroup",
    "destroy_model_parallel",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
