"""Tensor-parallel state of this process: its rank, the group size, and the collectives.

Without ``initialize_model_parallel`` (or with a group of one) every function here is
the identity of a single rank: world size 1, rank 0, collectives that return their
input. A worker with ``--tensor-parallel-size N > 1`` first joins ``torch.distributed``
(its platform's backend: gloo on CPU, NCCL on CUDA), then calls
``initialize_model_parallel(N)``; the layers read the state when they are built.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from loom_plugin_api import resolve_obj_by_qualname

from .. import platforms

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


@dataclass(slots=True)
class TensorParallelGroup:
    """This rank's view of its tensor-parallel group."""

    world_size: int
    rank: int
    group: Any = None  # torch.distributed ProcessGroup; None for a single rank
    communicator: Any = None  # the platform's communicator; None for a single rank


_SINGLE = TensorParallelGroup(world_size=1, rank=0)
_TP: TensorParallelGroup | None = None


def init_distributed_environment(
    world_size: int, rank: int, init_method: str | None, backend: str, device: torch.device | None = None,
) -> None:
    """Join the ``torch.distributed`` group of a serve's workers and record the TP group
    (a worker's ``init_device`` calls it; nothing happens for a single rank)."""
    if world_size == 1:
        return
    kwargs: dict[str, Any] = {"device_id": device} if device is not None else {}
    store = bound_store(init_method, world_size, rank)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(backend, world_size=world_size, rank=rank, **kwargs)
    initialize_model_parallel(world_size)


def bound_store(init_method: str | None, world_size: int, rank: int) -> dist.TCPStore | None:
    """The rendezvous store of ``tcp://HOST:PORT``, listening on HOST's address only.

    torch's own TCPStore server listens on every interface whatever host the URL names, and
    answers anyone who connects: another user of the machine or of its network could join or
    disturb the group. Rank 0 binds the socket itself, to 127.0.0.1 for a serve on one machine
    or to rank 0's node address on Ray, and hands it to the store. Other URLs (``env://``,
    ``file://``) go to torch unchanged."""
    url = urlsplit(init_method or "")
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        return None
    host = "127.0.0.1" if url.hostname == "localhost" else url.hostname
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, url.port))
        sock.listen(world_size)
        listen_fd = sock.detach()  # the store owns it from here
    return dist.TCPStore(host, url.port, world_size, is_master=rank == 0, master_listen_fd=listen_fd,
                         timeout=timedelta(seconds=300))


def initialize_model_parallel(tensor_model_parallel_size: int = 1, communicator_cls: str | None = None) -> None:
    """Record this process's tensor-parallel group (once per worker, after ``init_process_group``).

    With a size of 1 nothing distributed is needed. Otherwise ``torch.distributed`` must be
    initialized and its world size must be a multiple of the TP size; ranks
    ``[k*N, (k+1)*N)`` form a group. ``communicator_cls`` (a qualified name) defaults to
    the current platform's ``get_device_communicator_cls()``.
    """
    global _TP
    tp = tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    if tp == 1:
        _TP = _SINGLE
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"tensor-parallel size {tp} needs torch.distributed; call "
            "torch.distributed.init_process_group() before initialize_model_parallel()"
        )
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"torch.distributed world size {world} is not a multiple of tensor-parallel size {tp}")
    rank = dist.get_rank()
    if world == tp:
        group = dist.group.WORLD
    else:
        # new_group is collective: every rank creates every group, keeps its own.
        group = None
        for start in range(0, world, tp):
            ranks = list(range(start, start + tp))
            g = dist.new_group(ranks)
            if rank in ranks:
                group = g
    if communicator_cls is None:
        communicator_cls = platforms.current_platform.get_device_communicator_cls()
    communicator = resolve_obj_by_qualname(communicator_cls)(group)
    _TP = TensorParallelGroup(world_size=tp, rank=dist.get_rank(group), group=group, communicator=communicator)


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def destroy_model_parallel() -> None:
    """Forget the group (the process group itself belongs to whoever initialized it)."""
    global _TP
    _TP = None


def get_tp_group() -> TensorParallelGroup:
    return _TP if _TP is not None else _SINGLE


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (identity for one rank)."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    return tp.communicator.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate ``x`` of every TP rank along ``dim`` (identity for one rank)."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    return tp.communicator.all_gather(x, dim)
