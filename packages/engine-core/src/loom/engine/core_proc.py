"""The engine-core process of ``loom serve``: scheduler, KV-cache manager, the engine loop.

Start-up (stop 9): platform and general plugins again (a fresh interpreter), connect to
the supervisor, take the config, build the executor (it waits for every worker to load
and sizes the KV cache from the smallest offer), freeze the environment, READY. Then the
engine loop (:class:`~loom.engine.core.EngineCore`) runs on the front end's ADD_REQUEST and
ABORT frames and sends each report back as one OUTPUTS frame.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence

from loom_plugin_api import load_general_plugins, tracing
from loom_plugin_api.tracing import span
from loom_supervisor.client import REMOTE_DIED, PeerDied

from .. import envs
from ..config import LoomConfig
from ..gc_heap import freeze_long_lived
from ..ipc.channel import Channel, Message
from ..ipc.messages import AbortRequests, AddRequest, EngineReady
from ..logger import init_logger
from ..platforms import current_platform  # noqa: F401 - importing it resolves the platform, before any plugin
from ..transformers_utils.tokenizer import get_tokenizer
from .core import Command, EngineCore
from .errors import EngineFatalError
from .executor import Executor
from .llm_engine import LLMEngine
from .multiproc_executor import MultiprocExecutor

logger = init_logger("loom.engine_core")


class ChannelInbox:
    """The engine loop's commands from the front end's frames (and any the executor kept aside)."""

    def __init__(self, channel: Channel, executor: Executor) -> None:
        self.channel = channel
        self.executor = executor

    def get(self, block: bool) -> Sequence[Command]:
        kept = getattr(self.executor, "pending", None)  # frames a MultiprocExecutor read during a step
        messages = list(kept or ())
        if kept:
            kept.clear()
        msg = self.channel.recv(timeout=None if block and not messages else 0)
        while msg is not None:
            # a worker's answer to a step still out (overlapped steps): the executor's
            if not self.executor.set_aside(msg):
                messages.append(msg)
            msg = self.channel.recv(timeout=0)
        return [cmd for cmd in map(self._command, messages) if cmd is not None]

    @staticmethod
    def _command(msg: Message) -> Command | None:
        if isinstance(msg.body, (AddRequest, AbortRequests)):
            return msg.body
        logger.warning("Engine core ignored a %s frame from %s", msg.kind.value, msg.src)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom.engine.core_proc")
    parser.add_argument("--step-timeout", type=float, default=0.0, help="seconds a model step may take (0: no limit)")
    args = parser.parse_args(argv)
    tracing.mark("main")
    freeze_long_lived()  # the imports stay out of every later collection
    load_general_plugins()
    channel = Channel.connect("engine_core")
    config = channel.config()
    with span("load tokenizer"):
        tokenizer = get_tokenizer(config.model_config)
    with span("start the executor: workers load, KV cache sized", waits=True):
        executor = _executor(config, channel, args.step_timeout)
    with span("build the engine"):
        core = EngineCore(LLMEngine(config, executor, tokenizer))
    envs.enable_envs_cache()
    channel.send("frontend", EngineReady(num_blocks=executor.num_blocks, block_size=config.cache_config.block_size))
    freeze_long_lived()  # and the tokenizer, the engine, the executor
    channel.ready()
    logger.info("Engine core is ready")
    # The supervisor stops its children with SIGUSR1: leave the loop through ``finally``, so
    # that the executor releases its workers (Ray actors and their placement group included).
    # Exit 1 if a Ray rank died: during a drain the supervisor judges the end by exit codes.
    signal.signal(signal.SIGUSR1, lambda signum, frame: _exit(1 if executor.died else 0))
    try:
        core.run(ChannelInbox(channel, executor), lambda out: channel.send("frontend", out))
    except EngineFatalError as e:
        logger.error("%s", e)
        if executor.died:
            # The death went to the supervisor as a REMOTE_DIED frame: exiting now could let our
            # exit reach it first and be reported instead. It stops us once it has read the frame.
            time.sleep(REPORT_WAIT_S)
        return 1
    finally:
        executor.shutdown()
    return 0


REPORT_WAIT_S = 10.0


def _exit(code: int) -> None:
    raise SystemExit(code)


def _executor(config: LoomConfig, channel: Channel, step_timeout: float) -> Executor:
    if not config.parallel_config.uses_ray:
        return MultiprocExecutor(config, channel, step_timeout=step_timeout)
    from .ray_executor import RankDeath, RayExecutor  # lazy: Ray is an optional dependency

    def report(death: RankDeath) -> None:
        """The supervisor reports a rank that died on Ray like a worker process of its own."""
        body = PeerDied(role="worker", rank=death.rank, pid=death.pid, exit_code=None, signal=None,
                        phase="running", reason=f"worker:{death.rank} died: {death.cause}", stderr_tail=death.log_tail,
                        node=death.node_ip)
        channel.send_to_supervisor(REMOTE_DIED, body.to_body())

    return RayExecutor(config, step_timeout=step_timeout, on_death=report)


if __name__ == "__main__":
    sys.exit(main())
