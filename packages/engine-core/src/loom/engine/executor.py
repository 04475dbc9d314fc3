"""Executors: how the engine reaches its workers.

``UniProcExecutor`` runs the single worker in the engine's own process (tensor
parallel size 1). The multi-process executor, driven by the supervisor, comes with
``loom serve``.
"""

from __future__ import annotations

from loom_plugin_api import WorkerBase, resolve_obj_by_qualname

from ..config import LoomConfig
from ..logger import init_logger
from .scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)


def resolve_worker_cls(qualname: str) -> type[WorkerBase]:
    try:
        worker_cls = resolve_obj_by_qualname(qualname)
    except (ImportError, ValueError) as e:
        raise ValueError(f"worker_cls {qualname!r} does not resolve: {e}") from e
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, WorkerBase)):
        raise TypeError(f"worker_cls {qualname!r} is not a subclass of loom_plugin_api.WorkerBase")
    return worker_cls


def num_blocks_for(config: LoomConfig, available_bytes: int, block_bytes: int) -> int:
    """KV-cache blocks for the memory a worker offers, capped at what the engine can use."""
    block_size = config.cache_config.block_size
    max_len = config.model_config.max_model_len or 0
    blocks_per_seq = -(-max_len // block_size)
    useful = config.scheduler_config.max_num_seqs * blocks_per_seq + 1
    num_blocks = min(available_bytes // max(block_bytes, 1), useful)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache fits {num_blocks} blocks of {block_size} tokens, fewer than one request of "
            f"max_model_len {max_len} needs ({blocks_per_seq}); give it more memory "
            "(LOOM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes) or lower --max-model-len"
        )
    return num_blocks


class UniProcExecutor:
    def __init__(self, config: LoomConfig) -> None:
        from ..platforms import current_platform
        from ..worker.services import EngineWorkerServices

        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size > 1 runs one worker process per rank under the supervisor; "
                "the in-process executor supports 1"
            )
        self.config = config
        current_platform.register_triton_kernel_overrides()
        worker_cls = resolve_worker_cls(config.parallel_config.worker_cls)
        logger.info("Resolved worker class %s", config.parallel_config.worker_cls)
        self.worker = worker_cls(config, local_rank=0, rank=0, is_driver_worker=True,
                                 services=EngineWorkerServices())
        self.worker.init_device()
        self.worker.load_model()
        current_platform.update_block_size_for_backend(config)
        available = self.worker.determine_available_memory()
        block_bytes = self.worker.get_kv_cache_block_bytes()
        self.num_blocks = num_blocks_for(config, available, block_bytes)
        config.cache_config.num_blocks = self.num_blocks
        self.worker.initialize_cache(self.num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
