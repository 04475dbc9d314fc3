"""The executor whose single worker runs in the engine's own process (tensor-parallel size 1)."""

from __future__ import annotations

from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

from ..config import LoomConfig
from ..logger import init_logger
from ..worker.startup import allocate, build_worker, offer
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
        # the same start-up as a worker process's (one place, one set of start-up spans)
        self.worker = build_worker(config, 0, None)
        info = offer(self.worker, config, 0)
        self.num_blocks = num_blocks_for(config, info.available_bytes, info.block_bytes)
        allocate(self.worker, config, self.num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
