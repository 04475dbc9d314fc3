"""``NcclCommunicator``: tensor-parallel collectives over NCCL, between GPUs of one host."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from loom_plugin_api import TorchDistributedCommunicator

__all__ = ["NcclCommunicator"]


class NcclCommunicator(TorchDistributedCommunicator):
    """``torch.distributed`` collectives on a group whose backend is NCCL.

    The tensors live on this rank's GPU; NCCL runs the collective on the current stream,
    so a recorded CUDA graph replays it too.
    """

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        super().__init__(group, device or torch.device("cuda", torch.cuda.current_device()))
        backend = dist.get_backend(group)
        if backend != "nccl":
            raise RuntimeError(f"NcclCommunicator needs a process group with the nccl backend, got {backend}")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self.group)  # one launch instead of world_size
        return torch.cat(out.unbind(0), dim=dim)
