"""``CoreClient``: the front end's EngineClient for the engine-core *process*.

Requests go to ``engine_core`` as ADD_REQUEST/ABORT frames through the supervisor; a
reader thread takes OUTPUTS frames and routes each delta to its request's asyncio queue.
When the supervisor reports a dead process (PEER_DIED) or goes away, every request in
flight ends with :class:`EngineDeadError` naming the process and the cause, and
``/health`` answers 503 from then on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..config import LoomConfig
from ..ipc import messages as m
from ..ipc.channel import Channel
from ..logger import init_logger
from ..metrics import load_stat_loggers
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .async_llm import EngineClient, EngineDeadError, RequestFailedError
from .llm_engine import EngineStats

logger = init_logger(__name__)


def describe_peer_death(info: dict[str, Any]) -> str:
    """One line from a PEER_DIED body: which process, how it ended, in which phase, why."""
    who = info.get("role", "?") + (f":{info['rank']}" if info.get("role") == "worker" else "")
    how = f"signal {info['signal']}" if info.get("signal") else f"exit code {info.get('exit_code')}"
    tail = [ln for ln in (info.get("stderr_tail") or []) if ln.strip()]
    cause = info.get("reason") or (tail[-1].strip() if tail else "")
    text = f"{who} (pid {info.get('pid')}) died with {how} during {info.get('phase', 'running')}"
    return text + (f": {cause}" if cause else "")


class CoreClient(EngineClient):
    def __init__(
        self, config: LoomConfig, tokenizer: Any, channel: Channel, *,
        on_engine_ready: Callable[[], None] | None = None,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.channel = channel
        self.stat_loggers = load_stat_loggers(config)
        self._on_engine_ready = on_engine_ready
        self._on_shutdown = on_shutdown
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._engine_ready = False
        self._stopping = False
        self._dead_error: str | None = None
        self._stats: EngineStats | None = None
        self._thread = threading.Thread(target=self._read, name="loom-core-client", daemon=True)
        self._thread.start()

    # ---- EngineClient -------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._engine_ready and self._dead_error is None and not self._stopping

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    def get_stats(self) -> EngineStats | None:
        return self._stats

    async def generate(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], sampling_params: SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            if self._dead_error is not None:
                raise EngineDeadError(self._dead_error)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self.channel.send("engine_core", m.ADD_REQUEST, m.AddRequest(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params, stream=True,
        ))
        async for item in self._stream(request_id, queue):
            yield item

    def _abort(self, request_id: str, *, end_stream: bool) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if self._dead_error is None:
            try:
                self.channel.send("engine_core", m.ABORT, m.AbortRequests(request_ids=[request_id]))
            except OSError:
                pass  # the supervisor is gone; the reader thread reports it
        if end_stream:
            final = RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], outputs=[], finished=True)
            self._put(stream, final)

    async def shutdown(self) -> None:
        self._stopping = True
        self._fail_all("the server is shutting down", only_if_alive=True, level=logging.INFO)

    # ---- the reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = self.channel.recv()
                if msg is None:
                    continue
                if msg.kind == m.OUTPUTS:
                    self._deliver(msg.body)
                elif msg.kind == m.ENGINE_READY:
                    self._engine_ready = True
                    if self._on_engine_ready is not None:
                        self._on_engine_ready()
                elif msg.kind == "PEER_DIED":
                    self._fail_all(describe_peer_death(msg.body))
                elif msg.kind == "SHUTDOWN":
                    self._stopping = True
                    if self._on_shutdown is not None:
                        self._on_shutdown()
                else:
                    logger.warning("Front end ignored a %s frame from %s", msg.kind, msg.src)
        except (EOFError, OSError) as e:
            self._fail_all(f"the supervisor connection closed ({type(e).__name__}: {e})", only_if_alive=True)

    def _deliver(self, body: m.EngineOutputs) -> None:
        if body.stats is not None:
            self._stats = body.stats
            for stat_logger in list(self.stat_loggers):
                try:
                    stat_logger.record(self._stats)
                except Exception:
                    logger.exception("Stat logger %s raised in record(); it is disabled", type(stat_logger).__name__)
                    self.stat_loggers.remove(stat_logger)
        with self._lock:
            items = []
            for out in body.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    if out.finished:
                        del self._streams[out.request_id]
                    items.append((stream, out))
            for err in body.errors:
                stream = self._streams.pop(err.request_id, None)
                if stream is not None:
                    exc = ValueError(err.message) if err.status < 500 else RequestFailedError(err.message)
                    items.append((stream, exc))
        for stream, item in items:
            self._put(stream, item)

    def _fail_all(self, message: str, only_if_alive: bool = False, level: int = logging.ERROR) -> None:
        with self._lock:
            if only_if_alive and self._dead_error is not None:
                return
            if self._dead_error is None:
                self._dead_error = message
                logger.log(level, "Engine unavailable: %s", message)
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            self._put(stream, EngineDeadError(self._dead_error))

    @staticmethod
    def _put(stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]], item: Any) -> None:
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed
