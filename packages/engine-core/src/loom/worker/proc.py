"""A worker process of ``loom serve``: one tensor-parallel rank.

Start-up (stops 10-11, 14 of the tour, in this process): resolve the platform and run the
general plugins (a fresh interpreter has empty registries), connect to the supervisor,
take the config, let the platform replace Triton kernels, resolve ``worker_cls`` by
name and build it with the engine's ``WorkerServices``, ``init_device``, ``load_model``,
the platform's ``update_block_size_for_backend``, report memory to the engine core,
allocate the KV cache it sizes, freeze the environment, READY. Then run every EXECUTE it
is sent, until the supervisor's stop signal (SIGUSR1), and ``shutdown``.

Overlapped steps: the engine schedules a step before it knows the tokens of the one before,
so a decode may carry ``PENDING_TOKEN``; this process remembers the token it last sampled for
each request and puts it in before the worker sees the step (a platform's worker never sees a
placeholder). After a step fails, the steps already queued behind it build on its tokens: each
is answered with a StepError, unrun, until the engine's RESUME_STEPS.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from loom_plugin_api import WorkerBase, load_general_plugins, tracing
from loom_plugin_api.step import SchedulerOutput

from .. import envs
from ..gc_heap import freeze_long_lived
from ..ipc.channel import Channel
from ..ipc.messages import CacheReady, InitCache, ResumeSteps, StepError
from ..logger import init_logger
from ..platforms import current_platform  # noqa: F401 - importing it resolves the platform, before any plugin
from .sampled_tokens import SampledTokens
from .startup import allocate, build_worker, offer

logger = init_logger("loom.worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom.worker.proc")
    parser.add_argument("--rank", type=int, required=True)
    rank = parser.parse_args(argv).rank
    tracing.mark("main")
    freeze_long_lived()  # the imports: torch's objects stay out of every later collection
    load_general_plugins()  # the platform is resolved: importing current_platform above did it
    channel = Channel.connect("worker", rank)
    config = channel.config()
    worker = build_worker(config, rank, os.environ.get("LOOM_DIST_INIT_METHOD"))
    channel.send("engine_core", offer(worker, config, rank))
    allocate(worker, config, _recv(channel, InitCache).num_blocks)
    envs.enable_envs_cache()
    channel.send("engine_core", CacheReady(rank=rank))
    freeze_long_lived()  # and the model's
    channel.ready()
    logger.info("Worker rank %d is ready", rank)
    # The supervisor stops its children with SIGUSR1 (they ignore SIGTERM and SIGINT, which
    # reach the whole process group: the supervisor drains first): leave the step loop and
    # let the worker release its device (the last call of the lifecycle).
    signal.signal(signal.SIGUSR1, _exit_on_stop_signal)
    try:
        _serve_steps(channel, worker, rank, config.parallel_config.world_size)
    finally:
        worker.shutdown()
        logger.info("Worker rank %d shut down", rank)
    return 0


def _exit_on_stop_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _recv(channel: Channel, tp: type[InitCache]) -> InitCache:
    while True:
        msg = channel.recv()
        if msg is not None and isinstance(msg.body, tp):
            return msg.body


def _serve_steps(channel: Channel, worker: WorkerBase, rank: int, world_size: int) -> None:
    tokens = SampledTokens()
    step = -1  # EXECUTE frames received: every rank receives every step
    failed = False  # a step failed: skip the queued ones until RESUME_STEPS (one worker: steps overlap)
    while True:
        msg = channel.recv()
        if msg is None:
            continue
        body = msg.body
        if isinstance(body, ResumeSteps):
            failed = False
            continue
        if not isinstance(body, SchedulerOutput):
            continue
        step += 1
        if failed:
            channel.send("engine_core", StepError(rank=rank, message="not run: a step before it failed", step=step))
            continue
        try:
            tokens.fill(body)
            output = worker.execute_model(body)
        except Exception as e:  # the engine core aborts the step's requests and goes on
            logger.error("Worker rank %d step failed:\n%s", rank, traceback.format_exc())
            failed = world_size == 1
            channel.send("engine_core", StepError(rank=rank, message=f"{type(e).__name__}: {e}", step=step))
            continue
        if output is not None:
            tokens.record(output)
            channel.send("engine_core", output)


if __name__ == "__main__":
    sys.exit(main())
