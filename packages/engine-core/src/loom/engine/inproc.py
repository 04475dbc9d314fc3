"""The engine loop on a thread of this process, behind the same ``EngineClient`` as a serve's.

:class:`InprocCoreConnection` runs :meth:`EngineCore.run <loom.engine.core.EngineCore.run>`
on a daemon thread: ``generate`` and ``abort`` queue commands for it, and each report is
handed to the client from that thread. A failed model step fails only that step's
requests; any other exception ends the thread, and the client fails every request (and
every later one) with a message naming this process. ``InprocAsyncLLM`` builds such a
client (tests, serving without the process model).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import envs
from ..ipc.messages import AbortRequests, AddRequest
from ..logger import init_logger
from ..transformers_utils.tokenizer import get_tokenizer
from .client import CoreConnection, EngineClient
from .core import Command, EngineCore
from .llm_engine import LLMEngine

if TYPE_CHECKING:
    from ..config import LoomConfig
    from .arg_utils import EngineArgs
    from .executor import Executor

logger = init_logger(__name__)


class InprocCoreConnection(CoreConnection):
    thread_name = "loom-engine"

    def __init__(self, engine: LLMEngine) -> None:
        self.core = EngineCore(engine)
        self.name = f"engine thread of process {os.getpid()}"
        self._cond = threading.Condition()
        self._commands: list[Command] = []
        self._stopping = False
        self._client: EngineClient | None = None

    def start(self, client: EngineClient) -> None:
        self._client = client
        super().start(client)
        client.on_engine_ready()

    def add_request(self, request: AddRequest) -> None:
        self._push(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._push(AbortRequests(request_ids=request_ids))

    def _push(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join, 30)
        assert self._client is not None
        self._client.on_engine_dead(f"{self.name} was shut down", expected=True)
        self.core.engine.shutdown()

    # ---- the engine thread: the Inbox of EngineCore.run ----------------------------------
    def get(self, block: bool) -> Sequence[Command] | None:
        with self._cond:
            while block and not (self._commands or self._stopping):
                self._cond.wait()
            if self._stopping:
                return None
            commands, self._commands = self._commands, []
        return commands

    def _run(self, client: EngineClient) -> None:
        try:
            self.core.run(self, client.on_outputs)
        except BaseException as e:  # the engine cannot go on; say so to every request
            logger.exception("The engine thread died")
            client.on_engine_dead(f"{self.name} died: {type(e).__name__}: {e}")


class InprocAsyncLLM(EngineClient):
    """An ``EngineClient`` whose engine loop runs on a thread of this process."""

    def __init__(self, config: LoomConfig, executor: Executor, tokenizer: Any, **kwargs: Any) -> None:
        self.engine = LLMEngine(config, executor, tokenizer)
        super().__init__(config, tokenizer, InprocCoreConnection(self.engine), **kwargs)
        self._stats = self.engine.get_stats()  # /metrics has gauges before the first request

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> InprocAsyncLLM:
        """Config, tokenizer and in-process executor built as ``loom.LLM`` builds them."""
        from .uniproc_executor import UniProcExecutor  # lazy: it loads torch (the worker computes here)

        config = engine_args.create_engine_config()
        tokenizer = get_tokenizer(config.model_config)
        client = cls(config, UniProcExecutor(config), tokenizer, **kwargs)
        envs.enable_envs_cache()
        return client
