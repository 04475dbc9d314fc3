"""The CPU platform's worker: the model, the KV cache and the step loop on host memory."""

from __future__ import annotations

import ctypes

import torch
from loom_plugin_api import WorkerBase

from .. import envs
from ..distributed.parallel_state import init_distributed_environment
from ..logger import init_logger
from ..platforms import current_platform
from .model_runner import ModelRunner

logger = init_logger(__name__)

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

    def init_device(self) -> None:
        _keep_large_allocations_in_the_heap()
        self.device = torch.device(current_platform.device_type)
        current_platform.set_device(self.device)
        current_platform.seed_everything(self.config.model_config.seed)
        init_distributed_environment(self.config.parallel_config.tensor_parallel_size, self.rank,
                                     self.distributed_init_method, current_platform.dist_backend)
        logger.info("Worker rank %d initialized device %s", self.rank, self.device)

    def load_model(self) -> None:
        from ..model_loader import get_model

        model = get_model(self.config)
        self.model_runner = ModelRunner(self.config, model, self.device)
        current_platform.update_block_size_for_backend(self.config)

    def determine_available_memory(self) -> int:
        space = envs.LOOM_CPU_KVCACHE_SPACE
        if space:
            return int(float(space) * _GiB)
        if self.config.cache_config.kv_cache_memory_bytes:
            return self.config.cache_config.kv_cache_memory_bytes
        return min(4 * _GiB, current_platform.get_device_available_memory() // 4)

    def get_kv_cache_block_bytes(self) -> int:
        return self.model_runner.kv_cache_block_bytes()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_cache(num_blocks)
        logger.info("Worker rank %d allocated %d KV-cache blocks", self.rank, num_blocks)

    def execute_model(self, scheduler_output):  # type: ignore[no-untyped-def]
        output = self.model_runner.execute_model(scheduler_output)
        return output if self.is_driver_worker else None
