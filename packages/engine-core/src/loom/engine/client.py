"""``EngineClient``: the engine as the front end sees it, wherever the engine runs.

One class for both ways of running the engine; only its :class:`CoreConnection` differs
(``core_client.ProcCoreConnection`` to the engine-core process, ``inproc.InprocCoreConnection``
to an engine thread here). It owns the request streams, the dead-engine error and the stat
loggers (``record`` per report, ``log()`` per ``log_stats_interval`` of activity).

Contract of ``generate``: it yields ``RequestOutput`` deltas (``outputs[i].text``,
``token_ids`` and ``logprobs`` are the new parts of completion ``index``; the last output has
``finished=True``). It raises ``ValueError`` when the engine rejects the request (the
message is for the user: 400), :class:`RequestFailedError` when the engine failed this
request but goes on (500), and :class:`EngineDeadError` when the engine is gone (503; the
message names the dead process and the cause). Leaving the iteration early (``aclose``,
cancellation) aborts the request and frees its KV blocks. An ``abort`` from elsewhere ends
the stream with a finished output whose completions may lack a finish reason ("abort").
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loom_plugin_api import LoRARequest, SamplingParams

from ..ipc.messages import AddRequest, EngineOutputs
from ..logger import init_logger
from ..metrics import load_stat_loggers
from ..outputs import RequestOutput, merge_deltas
from ..stats import EngineStats
from .errors import EngineDeadError, EngineError, RequestFailedError, ShuttingDownError

if TYPE_CHECKING:
    from ..config import LoomConfig

logger = init_logger(__name__)

__all__ = ["CoreConnection", "EngineClient", "EngineDeadError", "EngineError", "RequestFailedError"]


class CoreConnection(abc.ABC):
    """How requests reach an engine loop. ``start(client)`` is called once; from then on the
    connection reports to the client's ``on_*`` methods from its thread, which runs ``_run``
    (or, for the engine-core process, from the client's event loop)."""

    thread_name = "loom-engine-connection"

    def start(self, client: EngineClient) -> None:
        self._thread = threading.Thread(target=self._run, args=(client,), name=self.thread_name, daemon=True)
        self._thread.start()

    @abc.abstractmethod
    def _run(self, client: EngineClient) -> None:
        """The connection's thread: report to ``client`` until the engine is gone."""

    @abc.abstractmethod
    def add_request(self, request: AddRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine loop (in-process) or stop talking to it (the process)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class EngineClient:
    """The front end's engine. Its methods run on the event loop, and ``on_*`` too where the
    connection reads there (the engine-core process's); the in-process one calls them from its
    thread."""

    stream_interval: int = 1
    """Tokens per streamed delta at least (``--stream-interval``); the last delta may hold fewer."""

    def __init__(
        self,
        config: LoomConfig,
        tokenizer: Any,
        connection: CoreConnection,
        *,
        stat_loggers: list[Any] | None = None,
        log_stats_interval: float = 10.0,
        on_engine_ready: Callable[[], None] | None = None,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.connection = connection
        self.stat_loggers = load_stat_loggers(config) if stat_loggers is None else list(stat_loggers)
        self.log_stats_interval = log_stats_interval
        self._on_engine_ready = on_engine_ready
        self.kv_cache_tokens: int | None = None
        """The engine's KV-cache size in tokens, once it said it is ready (its process's EngineReady)."""
        self._on_shutdown = on_shutdown
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._engine_ready = False
        self._stopping = False
        self._dead_error: str | None = None
        self._stats: EngineStats | None = None
        self._stats_seq = 0  # reports recorded; the stats thread logs when it moved
        self._loggers_lock = threading.Lock()  # record() on the connection's side, log() on the stats thread
        self._records: deque[EngineStats] = deque()  # reports not yet record()ed (the lock was busy)
        self._stats_wake = threading.Event()
        self._stats_thread = threading.Thread(target=self._log_stats_loop, name="loom-stats", daemon=True)
        self._stats_thread.start()
        connection.start(self)

    # ---- what the front end calls ---------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        """True once the engine takes requests; False again after it died or shut down."""
        return self._engine_ready and self._dead_error is None and not self._stopping

    @property
    def stopping(self) -> bool:
        """The server is draining: requests in flight finish, new ones are refused."""
        return self._stopping

    @property
    def dead_error(self) -> str | None:
        """Why the engine is gone (names the process and the cause), or None while it lives."""
        return self._dead_error

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def get_stats(self) -> EngineStats | None:
        """The engine's latest stats (after its last step); None before the first report."""
        return self._stats

    async def generate(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], sampling_params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the deltas of one request (see the module docstring for the contract)."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._dead_error is not None:
                raise EngineDeadError(self._dead_error)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        try:
            self.connection.add_request(AddRequest(
                request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                sampling_params=sampling_params, stream=True, lora_request=lora_request,
            ))
        except BaseException:  # refused (overloaded) or failed: nothing of it stays behind
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        async for item in self._stream(request_id, stream.queue):
            yield item

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        self._abort(request_id, end_stream=True)

    async def shutdown(self) -> None:
        """Stop the engine; requests still running end with EngineDeadError."""
        self._stopping = True
        await self.connection.shutdown()
        self.on_engine_dead("the server is shutting down", expected=True)
        self._stats_wake.set()
        await asyncio.to_thread(self._stats_thread.join, 5)

    def end_all(self, message: str) -> int:
        """End every open stream with ``ShuttingDownError(message)`` and abort its request (the
        drain's grace period is running out); the number of streams ended."""
        with self._lock:
            streams, self._streams = self._streams, {}
            alive = self._dead_error is None
        if streams and alive:
            try:
                self.connection.abort_requests(list(streams))
            except OSError:
                pass  # the supervisor is gone; the connection reports it
        _put_all([(stream, ShuttingDownError(message)) for stream in streams.values()])
        return len(streams)

    # ---- streams --------------------------------------------------------------------------
    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        """Yield a request's deltas from its queue until finished; an exception put on the
        queue ends the stream with it. Leaving early aborts the request.

        Deltas that queued up while the reader was busy are yielded as one (``merge_deltas``),
        so a loaded front end sends fewer, larger events instead of falling further behind;
        with ``stream_interval`` N > 1 a delta after the first also waits until it holds N tokens
        (or the end): the first token goes out at once, whatever N (time to first token).
        """
        finished = False
        started = False  # the first delta was yielded
        pending: RequestOutput | BaseException | None = None
        try:
            while not finished:
                item = pending if pending is not None else await queue.get()
                pending = None
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped the request
                    raise item
                while not item.finished and (
                    not queue.empty()
                    or (started and self.stream_interval > 1 and _new_tokens(item) < self.stream_interval)
                ):
                    more = queue.get_nowait() if not queue.empty() else await queue.get()
                    if isinstance(more, BaseException):
                        pending = more
                        break
                    item = merge_deltas(item, more)
                finished, started = item.finished, True
                yield item
        finally:
            if not finished:
                self._abort(request_id, end_stream=False)

    def _abort(self, request_id: str, *, end_stream: bool) -> None:
        """Drop the request's stream and tell the engine; ``end_stream`` ends it with a final output."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            alive = self._dead_error is None
        if stream is None:
            return
        if alive:
            try:
                self.connection.abort_requests([request_id])
            except OSError:
                pass  # the supervisor is gone; the connection reports it
        if end_stream:
            final = RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], outputs=[], finished=True)
            _put_all([(stream, final)])

    # ---- reports from the connection (its thread, or the event loop) -----------------------
    def on_outputs(self, outputs: EngineOutputs) -> None:
        if outputs.stats is not None:
            self._record_stats(outputs.stats)
        items: list[tuple[_Stream, RequestOutput | BaseException]] = []
        with self._lock:
            for out in outputs.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    if out.finished:
                        del self._streams[out.request_id]
                    items.append((stream, out))
            for err in outputs.errors:
                stream = self._streams.pop(err.request_id, None)
                if stream is not None:
                    exc = ValueError(err.message) if err.status < 500 else RequestFailedError(err.message)
                    items.append((stream, exc))
        _put_all(items, direct=True)

    def on_engine_ready(self) -> None:
        self._engine_ready = True
        if self._on_engine_ready is not None:
            self._on_engine_ready()

    def on_engine_dead(self, message: str, *, expected: bool = False) -> None:
        """The engine is gone (the first cause wins); ``expected``: it was shut down (INFO, not ERROR)."""
        with self._lock:
            if self._dead_error is not None:
                return  # the first cause is the one every request hears
            self._dead_error = message
            streams, self._streams = self._streams, {}
        logger.log(logging.INFO if expected else logging.ERROR, "Engine unavailable: %s", message)
        error = EngineDeadError(message)
        _put_all([(stream, error) for stream in streams.values()])

    def on_shutdown_requested(self) -> None:
        self._stopping = True
        if self._on_shutdown is not None:
            self._on_shutdown()

    # ---- stat loggers ---------------------------------------------------------------------
    def _record_stats(self, stats: EngineStats) -> None:
        """Hand ``stats`` to the loggers' ``record()``, never waiting: it may run on the event loop,
        and a logger's ``log()`` on the stats thread may hold the lock for as long as it likes.
        Then the report waits in ``_records``, and whoever holds the lock next passes it on, in order."""
        self._stats = stats
        self._stats_seq += 1
        self._records.append(stats)
        if self._loggers_lock.acquire(blocking=False):
            try:
                self._pass_records()
            finally:
                self._loggers_lock.release()

    def _pass_records(self) -> None:
        """``record()`` every waiting report, oldest first (``_loggers_lock`` held)."""
        while self._records:
            self._call_loggers_locked("record", self._records.popleft())

    def _log_stats_loop(self) -> None:
        """One ``log()`` per interval while reports come in, and a last one at shutdown."""
        logged = 0
        while True:
            stopping = self._stats_wake.wait(max(self.log_stats_interval, 0.01))
            if self._stats_seq != logged:
                logged = self._stats_seq
                self._call_loggers("log")
            if stopping:
                return

    def _call_loggers(self, method: str) -> None:
        """``method()`` of every logger, then the reports that came in meanwhile (on the stats thread)."""
        with self._loggers_lock:  # a logger is never called from two threads at once
            self._pass_records()  # what came before this log() is recorded before it
            self._call_loggers_locked(method)
        while self._records:  # reports that came during log() found the lock held
            with self._loggers_lock:
                self._pass_records()

    def _call_loggers_locked(self, method: str, *args: Any) -> None:
        for stat_logger in list(self.stat_loggers):
            fn = getattr(stat_logger, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:
                # A broken logger must not stop serving; it is dropped, loudly.
                logger.exception("Stat logger %s raised in %s(); it is disabled",
                                 type(stat_logger).__name__, method)
                self.stat_loggers.remove(stat_logger)


def _put_all(items: list[tuple[_Stream, Any]], *, direct: bool = False) -> None:
    """Put each item on its stream's queue, one loop callback per event loop; ``direct``: put
    at once where this runs on the stream's loop (the engine-core process's reports, read on
    the loop). The other puts keep the order of the loop's callbacks, among them the
    in-process engine thread's reports."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    running = None
    if direct:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            pass
    for loop, batch in by_loop.items():
        def put(batch: list[tuple[_Stream, Any]] = batch) -> None:
            for stream, item in batch:
                stream.queue.put_nowait(item)

        if loop is running:  # called on that loop (the front end's reader): no wake-up to send
            put()
            continue
        try:
            loop.call_soon_threadsafe(put)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _new_tokens(output: RequestOutput) -> int:
    return max((len(c.token_ids) for c in output.outputs), default=0)
