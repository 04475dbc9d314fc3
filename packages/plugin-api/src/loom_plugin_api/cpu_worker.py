"""``CPUWorker``: the worker of platforms that compute in host memory, on torch.

The built-in CPU platform uses it, and an out-of-tree platform that computes on the host
(or any device torch allocates on without a memory budget of its own) may subclass it and
change only what differs. It runs ``model_runner_cls``: the reference ``ModelRunner``, or a
subclass a platform names (one that replays recorded steps in ``run_model``, say).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from .context import get_current_platform
from .model_runner import ModelRunner
from .step import ModelRunnerOutput, SchedulerOutput
from .worker import WorkerBase

__all__ = ["CPUWorker"]

logger = logging.getLogger("loom.worker")

_GiB = 1 << 30


def _keep_large_allocations_in_the_heap() -> None:
    """glibc serves allocations above its mmap threshold with fresh mappings, so every
    step's activations (several MB each) page-fault again. Keep up to 32 MB (glibc's
    maximum) in the heap, and do not trim it back after each step."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


class CPUWorker(WorkerBase):
    model_runner: ModelRunner
    model_runner_cls: type[ModelRunner] = ModelRunner
    """The runner ``load_model`` builds around the model: a platform's subclass of ``ModelRunner``."""

    def init_device(self) -> None:
        _keep_large_allocations_in_the_heap()
        platform = get_current_platform()
        self.device = torch.device(platform.device_type)
        platform.set_device(self.device)
        platform.seed_everything(self.config.model_config.seed)
        self.services.init_distributed(self.config, self.rank, self.distributed_init_method, self.device)
        logger.info("Worker rank %d initialized device %s", self.rank, self.device)

    def load_model(self) -> None:
        model = self.services.build_model(self.config, self.device)
        self.model_runner = self.model_runner_cls(self.config, model, self.device, self.services)

    def determine_available_memory(self) -> int:
        if self.config.cache_config.kv_cache_memory_bytes:
            return self.config.cache_config.kv_cache_memory_bytes
        return min(4 * _GiB, get_current_platform().get_device_available_memory() // 4)

    def get_kv_cache_block_bytes(self) -> int:
        return self.model_runner.kv_cache_block_bytes()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_cache(num_blocks)
        logger.info("Worker rank %d allocated %d KV-cache blocks", self.rank, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.model_runner.execute_model(scheduler_output)
        return output if self.is_driver_worker else None
