"""The engine as the front end sees it: requests in, a stream of deltas out per request.

:class:`EngineClient` is the interface the OpenAI server is written against. Two
implementations fit it:

* :class:`InprocAsyncLLM` (here) drives an ``LLMEngine`` in a background thread of the
  calling process: tests, and serving without the process model.
* the client of the engine-core process (``loom serve``), which sends each request over the
  supervisor and routes the engine core's output frames to the same per-request streams.

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
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..logger import init_logger
from ..metrics import load_stat_loggers
from ..outputs import RequestOutput, merge_deltas
from ..sampling_params import SamplingParams
from .llm_engine import EngineStats, EngineStepError, LLMEngine

if TYPE_CHECKING:
    from ..config import LoomConfig
    from .arg_utils import EngineArgs
    from .llm_engine import Executor

logger = init_logger(__name__)

__all__ = ["EngineClient", "EngineDeadError", "EngineError", "InprocAsyncLLM", "RequestFailedError"]


class EngineError(RuntimeError):
    """The engine could not serve a request."""


class EngineDeadError(EngineError):
    """The engine is gone; no request can be served. The message names the process and cause."""


class RequestFailedError(EngineError):
    """The engine failed this request (e.g. its model step raised) and serves the others."""


class EngineClient(abc.ABC):
    """What the OpenAI front end needs from an engine. All methods run on the event loop."""

    stream_interval: int = 1
    """Tokens per streamed delta at least (``--stream-interval``); the last delta may hold fewer."""

    config: LoomConfig
    tokenizer: Any

    @property
    @abc.abstractmethod
    def is_ready(self) -> bool:
        """True once the engine takes requests; False again after it died or shut down."""

    @property
    @abc.abstractmethod
    def dead_error(self) -> str | None:
        """Why the engine is gone (names the process and the cause), or None while it lives."""

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @abc.abstractmethod
    def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the deltas of one request (see the module docstring for the contract)."""

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        """Yield a request's deltas from its queue until finished; an exception put on the
        queue ends the stream with it. Leaving early aborts the request.

        Deltas that queued up while the reader was busy are yielded as one (``merge_deltas``),
        so a loaded front end sends fewer, larger events instead of falling further behind;
        with ``stream_interval`` N > 1 a delta also waits until it holds N tokens (or the end).
        """
        finished = False
        pending: RequestOutput | BaseException | None = None
        try:
            while not finished:
                item = pending if pending is not None else await queue.get()
                pending = None
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped the request
                    raise item
                while not item.finished and (
                    not queue.empty() or (self.stream_interval > 1 and _new_tokens(item) < self.stream_interval)
                ):
                    more = queue.get_nowait() if not queue.empty() else await queue.get()
                    if isinstance(more, BaseException):
                        pending = more
                        break
                    item = merge_deltas(item, more)
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort(request_id, end_stream=False)

    def _abort(self, request_id: str, *, end_stream: bool) -> None:
        """Drop the request's stream and tell the engine; ``end_stream`` ends it with a final output.
        Implementations that use ``_stream``/``abort`` as given provide it."""
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        self._abort(request_id, end_stream=True)

    @abc.abstractmethod
    def get_stats(self) -> EngineStats | None:
        """The engine's latest stats (after its last step); None before the first report."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine; requests still running end with EngineDeadError."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass(slots=True)
class _Abort:
    request_id: str


class InprocAsyncLLM(EngineClient):
    """An ``LLMEngine`` stepped by a thread of this process.

    The thread owns the engine: it applies queued adds and aborts between steps, steps while
    requests are unfinished, and sleeps on a condition when idle. Deltas reach each request's
    asyncio queue through ``loop.call_soon_threadsafe``, one call per loop per step. A failed
    model step (``EngineStepError``) fails only that step's requests; any other exception
    kills the engine, and every request (and every later one) gets :class:`EngineDeadError`.
    Stat loggers (built-in and ``loom.stat_logger_plugins``) record after every step.
    """

    def __init__(
        self,
        config: LoomConfig,
        executor: Executor,
        tokenizer: Any,
        *,
        stat_loggers: list[Any] | None = None,
        log_stats_interval: float = 10.0,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.engine = LLMEngine(config, executor, tokenizer)
        self.stat_loggers = load_stat_loggers(config) if stat_loggers is None else list(stat_loggers)
        self.log_stats_interval = log_stats_interval
        self.process_name = f"engine thread of process {os.getpid()}"
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._streams: dict[str, _Stream] = {}
        self._stats: EngineStats | None = self.engine.get_stats()
        self._dead_error: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="loom-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> InprocAsyncLLM:
        """Config, tokenizer and in-process executor built as ``loom.LLM`` builds them."""
        from .. import envs
        from ..transformers_utils.tokenizer import get_tokenizer
        from .executor import UniProcExecutor

        config = engine_args.create_engine_config()
        tokenizer = get_tokenizer(config.model_config)
        client = cls(config, UniProcExecutor(config), tokenizer, **kwargs)
        envs.enable_envs_cache()
        return client

    # ---- EngineClient ---------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._dead_error is None and not self._stopping

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    def get_stats(self) -> EngineStats | None:
        return self._stats

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if self._dead_error is not None:
                raise EngineDeadError(self._dead_error)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._commands.append(_Add(request_id, prompt, prompt_token_ids, sampling_params))
            self._cond.notify()
        async for item in self._stream(request_id, stream.queue):
            yield item

    def _abort(self, request_id: str, *, end_stream: bool) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            self._commands.append(_Abort(request_id))
            self._cond.notify()
        if end_stream:
            final = RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], outputs=[],
                                  finished=True)
            _put_all(stream.loop, [(stream, final)])

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join, 30)
        self._fail_all(f"{self.process_name} was shut down")
        self.engine.shutdown()

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the engine cannot go on; say so to every request
            logger.exception("The engine thread died")
            self._fail_all(f"{self.process_name} died: {type(e).__name__}: {e}")

    def _loop(self) -> None:
        engine = self.engine
        last_log = time.monotonic()
        log_pending = False
        while True:
            with self._cond:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    if not self._cond.wait(self.log_stats_interval if log_pending else None):
                        self._log_stats()  # one last line after a burst of activity
                        log_pending, last_log = False, time.monotonic()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            deliveries: list[tuple[str, RequestOutput | BaseException]] = []
            for command in commands:
                self._apply(command, deliveries)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except EngineStepError as e:
                    outputs = []
                    error = RequestFailedError(str(e))
                    deliveries.extend((request_id, error) for request_id in e.request_ids)
                deliveries.extend((out.request_id, out) for out in outputs)
                log_pending = True
            if commands or log_pending:  # an abort alone changes the queues too
                self._record_stats(engine.get_stats())
            self._deliver(deliveries)
            if log_pending and time.monotonic() - last_log >= self.log_stats_interval:
                self._log_stats()
                log_pending, last_log = False, time.monotonic()

    def _apply(self, command: _Add | _Abort, deliveries: list) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return
        if command.request_id not in self._streams:
            return  # aborted before it reached the engine
        try:
            self.engine.add_request(command.request_id, command.prompt, command.prompt_token_ids,
                                    command.sampling_params, stream=True)
        except ValueError as e:
            deliveries.append((command.request_id, ValueError(str(e))))
        except Exception as e:
            deliveries.append((command.request_id, RequestFailedError(f"{type(e).__name__}: {e}")))

    def _deliver(self, deliveries: list[tuple[str, RequestOutput | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
        with self._cond:
            for request_id, item in deliveries:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue  # aborted meanwhile
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[request_id]
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            _put_all(loop, items)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            if self._dead_error is None:
                self._dead_error = message
            streams, self._streams = self._streams, {}
            self._stopping = True
        error = EngineDeadError(message)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in streams.values():
            by_loop.setdefault(stream.loop, []).append((stream, error))
        for loop, items in by_loop.items():
            _put_all(loop, items)

    def _record_stats(self, stats: EngineStats) -> None:
        self._stats = stats
        for stat_logger in list(self.stat_loggers):
            try:
                stat_logger.record(stats)
            except Exception:
                # A broken logger must not stop serving; it is dropped, loudly.
                logger.exception("Stat logger %s raised in record(); it is disabled", type(stat_logger).__name__)
                self.stat_loggers.remove(stat_logger)

    def _log_stats(self) -> None:
        for stat_logger in list(self.stat_loggers):
            log = getattr(stat_logger, "log", None)
            if log is None:
                continue
            try:
                log()
            except Exception:
                logger.exception("Stat logger %s raised in log(); it is disabled", type(stat_logger).__name__)
                self.stat_loggers.remove(stat_logger)


def _put_all(loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, Any]]) -> None:
    def put() -> None:
        for stream, item in items:
            stream.queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _new_tokens(output: RequestOutput) -> int:
    return max((len(c.token_ids) for c in output.outputs), default=0)
