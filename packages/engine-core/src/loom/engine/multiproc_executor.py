"""The executor of the engine-core process: its workers are other processes.

Every message goes through the supervisor. At start-up it collects each rank's
``WorkerInfo``, sizes the KV cache from the smallest offer, and waits for every rank to
allocate it. Each step fans the SchedulerOutput out to ``workers`` and waits for the
driver's (rank 0) ``MODEL_OUTPUT``; frames from the front end that arrive meanwhile are
kept for the engine loop, and the workers' answers the engine loop reads while a step runs
(overlapped steps) are kept for ``collect``. With one worker, steps overlap: the worker
process fills in each decode's ``PENDING_TOKEN`` (:mod:`loom.worker.proc`). A step whose output
does not come within ``step_timeout`` seconds (a worker alive, sending heartbeats, but stuck in
a kernel or a collective) raises
``StepTimeoutError``: the engine core ends and the supervisor reports it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TypeVar

from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

from ..config import LoomConfig
from ..ipc.channel import Channel, Message
from ..ipc.messages import CacheReady, InitCache, ResumeSteps, StepError, WorkerInfo
from ..logger import init_logger
from .errors import StepTimeoutError, WorkerStepError
from .executor import Executor, size_kv_cache

logger = init_logger(__name__)

T = TypeVar("T")


class MultiprocExecutor(Executor):
    done = 0
    """Steps collected (or failed), counted as the workers count the EXECUTE frames they receive:
    a StepError about an earlier step is stale."""

    def __init__(self, config: LoomConfig, channel: Channel, step_timeout: float | None = None) -> None:
        self.config = config
        self.channel = channel
        self.step_timeout = step_timeout or None
        """Seconds a model step may take (None: no limit)."""
        self.pending: deque[Message] = deque()
        """Front-end frames read while waiting for the workers: the engine loop's."""
        self.answers: deque[Message] = deque()
        """The workers' answers the engine loop read while a step ran: ``collect``'s."""
        world = config.parallel_config.world_size
        # Only a single worker knows every token it sampled; ranks > 0 return nothing.
        self.overlaps_steps = world == 1
        infos: dict[int, WorkerInfo] = {}
        while len(infos) < world:
            info = self._recv_from_workers(WorkerInfo)
            infos[info.rank] = info
        self.num_blocks = size_kv_cache(config, infos.values())
        block_size = config.cache_config.block_size
        channel.send("workers", InitCache(num_blocks=self.num_blocks, block_size=block_size))
        ready: set[int] = set()
        while len(ready) < world:
            ready.add(self._recv_from_workers(CacheReady).rank)
        logger.info("%d worker(s) allocated %d KV-cache blocks of %d tokens", world, self.num_blocks, block_size)

    def _recv_from_workers(self, tp: type[T], timeout: float | None = None, step: int = -1) -> T:
        """The next ``tp`` from the workers. For a step (``step`` >= 0): rank 0 answers every step
        once (its output or its StepError), another rank only when it fails; a failure of another
        rank is raised once rank 0 has answered too, so that answer is not taken for the next step's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failed: StepError | None = None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise StepTimeoutError(
                    f"a model step has run {timeout:g} s without the workers' output (--step-timeout): a worker is "
                    "stuck in the step although its process answers; stopping the serve")
            msg = self.answers.popleft() if self.answers else self.channel.recv(timeout=left)
            if msg is None:
                continue
            if isinstance(msg.body, tp):
                if failed is not None:
                    raise WorkerStepError(f"worker:{failed.rank}: {failed.message}")
                return msg.body
            if isinstance(msg.body, StepError):
                if 0 <= msg.body.step < step:  # another rank's error about a step already failed
                    logger.debug("stale step error from %s: %s", msg.src, msg.body.message)
                    continue
                failed = failed or msg.body
                if step >= 0 and msg.body.rank != 0:
                    continue  # rank 0's answer to this step is still to come
                raise WorkerStepError(f"worker:{failed.rank}: {failed.message}")
            self.pending.append(msg)  # front-end traffic: the engine loop handles it

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.dispatch(scheduler_output)
        return self.collect(scheduler_output)

    def dispatch(self, scheduler_output: SchedulerOutput) -> None:
        self.channel.send("workers", scheduler_output)

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        step = self.done
        self.done += 1
        return self._recv_from_workers(ModelRunnerOutput, self.step_timeout, step)

    def resume(self) -> None:
        self.channel.send("workers", ResumeSteps())

    def set_aside(self, msg: Message) -> bool:
        if isinstance(msg.body, (ModelRunnerOutput, StepError)):
            self.answers.append(msg)
            return True
        return False
