"""Executors: how the engine reaches its workers.

Two implementations sit behind :class:`Executor`:

* ``UniProcExecutor`` (:mod:`.uniproc_executor`): the single worker in the engine's own
  process (tensor-parallel size 1, ``loom.LLM``).
* ``MultiprocExecutor`` (:mod:`.multiproc_executor`): one worker process per rank, reached
  through the supervisor (the engine-core process of ``loom serve``; ``loom.LLM`` with
  ``tensor_parallel_size > 1`` through :mod:`.supervised`).
* ``RayExecutor`` (:mod:`.ray_executor`): one Ray actor per rank, on the nodes of a Ray
  cluster (``--distributed-executor-backend ray``), from either kind of engine process.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING

from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

from ..config import LoomConfig
from ..ipc.messages import WorkerInfo

if TYPE_CHECKING:  # the in-process executors never read a channel
    from ..ipc.channel import Message


class Executor(abc.ABC):
    """Runs each step's ``SchedulerOutput`` on the workers and returns the driver's output."""

    num_blocks: int
    """KV-cache blocks the workers allocated (known once the executor is built)."""
    overlaps_steps: bool = False
    """Whether a second step may be dispatched before the first is collected, its decodes feeding
    ``PENDING_TOKEN`` for the tokens the first samples (the workers fill them in)."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def dispatch(self, scheduler_output: SchedulerOutput) -> None:
        """Start the step, to be finished by :meth:`collect` with the same ``scheduler_output``;
        the engine loop reports the previous step's outputs in between. By default nothing starts
        before ``collect`` (an in-process worker has no other thread to run it on)."""

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The output of the step :meth:`dispatch` started (waiting for it)."""
        return self.execute_model(scheduler_output)

    def resume(self) -> None:
        """After a failed step and the discarded steps behind it: the workers run steps again."""

    def set_aside(self, msg: Message) -> bool:
        """Keep a worker's answer that the engine loop's inbox read while a step was out, for
        :meth:`collect`; False for any other frame (and where answers do not share the inbox)."""
        return False

    @property
    def died(self) -> bool:
        """Whether a rank died in a way the executor has already reported (a Ray actor's
        death goes to the supervisor as a frame; a worker process's the supervisor sees itself)."""
        return False

    def shutdown(self) -> None:
        """Release the workers; the engine calls it once, last."""


def size_kv_cache(config: LoomConfig, infos: Iterable[WorkerInfo]) -> int:
    """The blocks every rank allocates: every rank holds a shard of every layer, so the tightest
    rank decides. Records the block size the workers' backends chose and the count in ``config``."""
    infos = list(infos)
    available = min(i.available_bytes for i in infos)
    block_bytes = max(i.block_bytes for i in infos)
    config.cache_config.block_size = next(i.block_size for i in infos if i.rank == 0)
    num_blocks = num_blocks_for(config, available, block_bytes)
    config.cache_config.num_blocks = num_blocks
    return num_blocks


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
