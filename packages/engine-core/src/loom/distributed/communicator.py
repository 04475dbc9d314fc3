"""``TorchDistributedCommunicator``: tensor-parallel collectives through ``torch.distributed``.

A platform names its communicator class in ``Platform.get_device_communicator_cls()``;
the CPU platform uses this one (over gloo), a GPU platform may name one that calls its
own collective library. The interface is the two collectives that the layers need.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TorchDistributedCommunicator"]


class TorchDistributedCommunicator:
    """All-reduce and all-gather over one process group (gloo, NCCL, ...)."""

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group; returns the reduced tensor (``x`` itself, in place)."""
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)
