"""One tensor-parallel rank as a Ray actor (``--distributed-executor-backend ray``).

Ray imports this module in the actor's fresh interpreter, which resolves the platform first
(the import of ``current_platform`` below), as in a worker process of ``loom serve``. ``start``
then runs the general plugins, refuses a node whose software differs from the engine's
(another platform resolved, other versions of loom, a plugin, torch or Python), and runs the
worker's start-up (:mod:`.startup`). Ray prefixes each line the actor prints with
``repr(actor)``, its rank and node (``(worker:1@10.0.0.2 pid=123)``), in the engine's output.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import ray
from loom_plugin_api import load_general_plugins, tracing
from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

from .. import envs
from ..config import LoomConfig
from ..distributed.ray_utils import NodeMismatchError, differences, fingerprint
from ..ipc.messages import WorkerInfo
from ..logger import init_logger
from ..platforms import current_platform  # noqa: F401 - importing it resolves the platform, before any plugin
from .startup import allocate, build_worker, offer

logger = init_logger("loom.worker")

WATCH_GROUP = "watch"
"""The actor's second thread: ``watch`` waits there while steps run in the default group."""


@ray.remote(concurrency_groups={WATCH_GROUP: 1})
class RayWorker:
    def __init__(self, rank: int) -> None:
        load_general_plugins()  # before anything of the engine is unpickled here (the config of ``start``)
        self.rank = rank
        self.node_ip = ray.util.get_node_ip_address()
        self.worker: Any = None
        self._stopped = threading.Event()

    def __repr__(self) -> str:  # Ray's prefix of this actor's log lines: rank and node
        return f"worker:{self.rank}@{self.node_ip}"

    def where(self) -> dict[str, Any]:
        """This actor's node and process, for the engine's reports."""
        return {"ip": self.node_ip, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def free_port(self) -> int:
        """A port free on this node now (rank 0's store listens on it)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return int(s.getsockname()[1])

    def start(self, config: LoomConfig, distributed_init_method: str | None,
              engine_fingerprint: dict[str, str], index_on_node: int) -> WorkerInfo:
        mismatch = differences(engine_fingerprint, fingerprint())
        if mismatch:
            raise NodeMismatchError(
                f"worker:{self.rank} on node {self.node_ip} does not run the engine's software: "
                f"{'; '.join(mismatch)}. Install the same wheels (loom, its plugins, torch) on every node")
        self.config = config
        # For the accelerators Ray knows it makes the bundle's device the actor's only visible one
        # (CUDA_VISIBLE_DEVICES for GPUs): device 0 here. Otherwise the ranks of a node share its
        # devices and each takes the one at its index among them.
        isolated = bool(ray.get_runtime_context().get_accelerator_ids().get(current_platform.ray_device_key))
        local_rank = 0 if isolated else index_on_node
        self.worker = build_worker(config, self.rank, distributed_init_method, local_rank=local_rank)
        return offer(self.worker, config, self.rank)

    def allocate(self, num_blocks: int) -> None:
        allocate(self.worker, self.config, num_blocks)
        envs.enable_envs_cache()
        tracing.ready()  # a traced start-up: the serve's LOOM_* variables reached this actor too
        logger.info("Worker rank %d is ready", self.rank)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
            logger.info("Worker rank %d shut down", self.rank)
        self._stopped.set()

    @ray.method(concurrency_group=WATCH_GROUP)
    def watch(self) -> None:
        """Returns when the actor is shut down; while it lives, the engine's wait on this call
        is how it learns within moments that the actor's process died (the call then fails)."""
        self._stopped.wait()
