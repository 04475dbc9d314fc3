"""Device communicators: the tensor-parallel collectives a platform provides.

A platform names its communicator class in ``Platform.get_device_communicator_cls()``
(a qualified name). Each worker of a tensor-parallel group of more than one rank asks for
it once, after ``torch.distributed`` is initialized, and builds one instance for its
group: ``cls(group, device)``. The model's parallel layers then call the collectives
below on every step, in every rank, in the same order.

``TorchDistributedCommunicator`` implements them with ``torch.distributed`` on whatever
backend the group uses (gloo for host memory, NCCL for GPUs); a platform whose collective
library is not a ``torch.distributed`` backend subclasses ``DeviceCommunicatorBase``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceCommunicatorBase", "TorchDistributedCommunicator"]


class DeviceCommunicatorBase(ABC):
    """Collectives over one tensor-parallel group. ``world_size`` and ``rank`` are the
    group's; ``device`` is where this rank's tensors live."""

    world_size: int
    rank: int

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group and return the sum (it may be ``x``, reduced in place)."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on each) along ``dim``, in rank order."""

    @abstractmethod
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Give every rank rank ``src``'s ``x``, in place; returns ``x``."""


class TorchDistributedCommunicator(DeviceCommunicatorBase):
    """The collectives through ``torch.distributed``, on the group's own backend."""

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        import torch.distributed as dist  # lazy: torch stays out of the processes that never compute

        super().__init__(group, device)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist  # lazy: torch stays out of the processes that never compute

        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        # lazy: torch stays out of the processes that never compute
        import torch
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        import torch.distributed as dist  # lazy: torch stays out of the processes that never compute

        # ``src`` is a rank of the group; torch.distributed wants the global rank.
        dist.broadcast(x, src=dist.get_global_rank(self.group, src) if self.group is not None else src,
                       group=self.group)
        return x
