"""The executor whose single worker runs in the engine's own process (tensor-parallel size 1)."""

from __future__ import annotations

from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

from .. import platforms
from ..config import LoomConfig
from ..logger import init_logger
from ..worker.resolve import resolve_worker_cls
from ..worker.services import EngineWorkerServices
from .executor import Executor, num_blocks_for

logger = init_logger(__name__)


class UniProcExecutor(Executor):
    def __init__(self, config: LoomConfig) -> None:
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size > 1 runs one worker process per rank under the supervisor; "
                "the in-process executor supports 1"
            )
        self.config = config
        current_platform = platforms.current_platform  # resolved by now: the config was built with it
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
