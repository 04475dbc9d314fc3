"""The executor of the engine-core process: its workers are other processes.

Every message goes through the supervisor. At start-up it collects each rank's
``WorkerInfo``, sizes the KV cache from the smallest offer, and waits for every rank to
allocate it. Each step fans the SchedulerOutput out to ``workers`` and waits for the
driver's (rank 0) ``MODEL_OUTPUT``; frames from the front end that arrive meanwhile are
kept for the engine loop.
"""

from __future__ import annotations

from collections import deque

from ..config import LoomConfig
from ..ipc import messages as m
from ..ipc.channel import Channel, Message
from ..logger import init_logger
from .executor import num_blocks_for
from .scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)


class WorkerStepError(RuntimeError):
    """A worker raised while running a step."""


class MultiprocExecutor:
    def __init__(self, config: LoomConfig, channel: Channel) -> None:
        self.config = config
        self.channel = channel
        self.pending: deque[Message] = deque()
        world = config.parallel_config.world_size
        infos: dict[int, m.WorkerInfo] = {}
        while len(infos) < world:
            msg = self._recv_from_workers(m.WORKER_INFO)
            infos[msg.body.rank] = msg.body
        # Every rank holds a shard of every layer: size the cache by the tightest rank.
        available = min(i.available_bytes for i in infos.values())
        block_bytes = max(i.block_bytes for i in infos.values())
        block_size = infos[0].block_size
        config.cache_config.block_size = block_size  # the workers' backends may have changed it
        self.num_blocks = num_blocks_for(config, available, block_bytes)
        config.cache_config.num_blocks = self.num_blocks
        channel.send("workers", m.INIT_CACHE, m.InitCache(num_blocks=self.num_blocks, block_size=block_size))
        ready: set[int] = set()
        while len(ready) < world:
            ready.add(self._recv_from_workers(m.CACHE_READY).body.rank)
        logger.info("%d worker(s) allocated %d KV-cache blocks of %d tokens", world, self.num_blocks, block_size)

    def _recv_from_workers(self, kind: str) -> Message:
        while True:
            msg = self.channel.recv()
            if msg is None:
                continue
            if msg.kind == kind:
                return msg
            if msg.kind == m.STEP_ERROR:
                raise WorkerStepError(f"{msg.src}: {msg.body.message}")
            self.pending.append(msg)  # front-end traffic: the engine loop handles it

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.channel.send("workers", m.EXECUTE, scheduler_output)
        return self._recv_from_workers(m.MODEL_OUTPUT).body

    def shutdown(self) -> None:
        pass
