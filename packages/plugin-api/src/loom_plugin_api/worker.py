"""``WorkerBase``: the process-side owner of a device, the model and its KV cache.

A platform names its worker class (a qualified name) in
``config.parallel_config.worker_cls`` from ``check_and_update_config``. The engine
resolves it by name in the worker process and calls, in order: ``init_device``,
``load_model``, ``determine_available_memory``, ``initialize_cache``, then
``execute_model`` once per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["WorkerBase"]


class WorkerBase(ABC):
    def __init__(
        self,
        config: Any,
        local_rank: int = 0,
        rank: int = 0,
        distributed_init_method: str | None = None,
        is_driver_worker: bool = True,
    ) -> None:
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker

    @abstractmethod
    def init_device(self) -> None:
        """Select the device, seed it, and join the tensor-parallel group."""

    @abstractmethod
    def load_model(self) -> None:
        """Build the model from the registry and load its weights (this rank's shard)."""

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes this worker can give the KV cache after the model is loaded."""

    @abstractmethod
    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one KV-cache block takes on this worker, across every layer."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV-cache blocks for every attention layer."""

    @abstractmethod
    def execute_model(self, scheduler_output: Any) -> Any:
        """Run one step; the driver worker returns the sampled tokens, others None."""

    def shutdown(self) -> None:
        """Release the device; called once when the engine stops."""
