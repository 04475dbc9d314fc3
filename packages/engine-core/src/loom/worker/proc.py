"""A worker process of ``loom serve``: one tensor-parallel rank.

Start-up (stops 10-11, 14 of the tour, in this process): resolve the platform and run the
general plugins (a fresh interpreter has empty registries), connect to the supervisor,
take the config, let the platform replace Triton kernels, resolve ``worker_cls`` by
name and build it with the engine's ``WorkerServices``, ``init_device``, ``load_model``,
the platform's ``update_block_size_for_backend``, report memory to the engine core,
allocate the KV cache it sizes, freeze the environment, READY. Then run every EXECUTE it
is sent, until SIGTERM, and ``shutdown``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING

from loom_plugin_api import WorkerBase, load_general_plugins

from ..logger import init_logger

if TYPE_CHECKING:
    from ..ipc.channel import Channel

logger = init_logger("loom.worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom.worker.proc")
    parser.add_argument("--rank", type=int, required=True)
    rank = parser.parse_args(argv).rank

    from ..platforms import current_platform

    load_general_plugins()
    from .. import envs
    from ..engine.executor import resolve_worker_cls
    from ..ipc import messages as m
    from ..ipc.channel import Channel
    from .services import EngineWorkerServices

    channel = Channel("worker", rank)
    config = channel.config()
    current_platform.register_triton_kernel_overrides()
    worker_cls = resolve_worker_cls(config.parallel_config.worker_cls)
    logger.info("Worker rank %d resolved worker class %s", rank, config.parallel_config.worker_cls)
    worker = worker_cls(
        config, local_rank=rank, rank=rank, distributed_init_method=os.environ.get("LOOM_DIST_INIT_METHOD"),
        is_driver_worker=rank == 0, services=EngineWorkerServices(),
    )
    worker.init_device()
    worker.load_model()
    current_platform.update_block_size_for_backend(config)
    info = m.WorkerInfo(
        rank=rank, available_bytes=worker.determine_available_memory(),
        block_bytes=worker.get_kv_cache_block_bytes(), block_size=config.cache_config.block_size,
    )
    channel.send("engine_core", m.WORKER_INFO, info)
    while True:
        msg = channel.recv()
        if msg is not None and msg.kind == m.INIT_CACHE:
            break
    config.cache_config.num_blocks = msg.body.num_blocks
    worker.initialize_cache(msg.body.num_blocks)
    envs.enable_envs_cache()
    channel.send("engine_core", m.CACHE_READY, info)
    channel.ready()
    logger.info("Worker rank %d is ready", rank)
    # The supervisor stops a serve with SIGTERM: leave the step loop and let the worker
    # release its device (the last call of the lifecycle).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _serve_steps(channel, worker, rank)
    finally:
        worker.shutdown()
        logger.info("Worker rank %d shut down", rank)
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _serve_steps(channel: Channel, worker: WorkerBase, rank: int) -> None:
    from ..ipc import messages as m

    while True:
        msg = channel.recv()
        if msg is None or msg.kind != m.EXECUTE:
            continue
        try:
            output = worker.execute_model(msg.body)
        except Exception as e:  # the engine core aborts the step's requests and goes on
            logger.error("Worker rank %d step failed:\n%s", rank, traceback.format_exc())
            channel.send("engine_core", m.STEP_ERROR, m.StepError(rank=rank, message=f"{type(e).__name__}: {e}"))
            continue
        if output is not None:
            channel.send("engine_core", m.MODEL_OUTPUT, output)

if __name__ == "__main__":
    sys.exit(main())
