"""The connection of the front end's ``EngineClient`` to the engine-core *process*.

Requests go to ``engine_core`` as ADD_REQUEST/ABORT frames through the supervisor; the
front end's event loop reads the frames that come back (a reader on the socket, so a token
costs the front end one wake-up, not a reader thread's plus the loop's): OUTPUTS (routed to
the request streams), ENGINE_READY, SHUTDOWN (drain) and PEER_DIED. When the supervisor
reports a dead process or goes away, every request in flight ends with ``EngineDeadError``
naming the process and the cause, and ``/health`` answers 503 from then on.

Frames are written by a thread of their own, never by the event loop: when the engine core
stops reading (stopped, or slower than the requests come), the supervisor's outbox fills and
a write would block. Up to ``MAX_QUEUED_ADDS`` new requests may wait to be written; past that
``add_request`` refuses with ``EngineOverloadedError`` (a 503 with a retry hint) and the front
end keeps answering. Aborts always queue, in order after the request they abort. A write that
fails ends the engine for the front end as a closed connection does (``on_engine_dead``): with
the writer gone, a request queued after it would otherwise wait forever.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from ..ipc.channel import Channel, Message
from ..ipc.messages import AbortRequests, AddRequest, EngineOutputs, EngineReady, Kind, Shutdown
from ..logger import init_logger
from .client import CoreConnection, EngineClient
from .errors import EngineOverloadedError

logger = init_logger(__name__)


MAX_QUEUED_ADDS = 256


class ProcCoreConnection(CoreConnection):
    thread_name = "loom-core-client"

    def __init__(self, channel: Channel, max_queued_adds: int = MAX_QUEUED_ADDS) -> None:
        self.channel = channel
        self.max_queued_adds = max_queued_adds
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queued_adds = 0
        self._count_lock = threading.Lock()
        self._client: EngineClient | None = None  # told when a write fails (set by ``start``)
        self._write_error: str | None = None  # a failed write's report, kept for ``start`` if it came first
        self._report_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write, name="loom-core-writer", daemon=True)
        self._writer.start()

    def add_request(self, request: AddRequest) -> None:
        with self._count_lock:
            if self._queued_adds >= self.max_queued_adds:
                raise EngineOverloadedError(
                    f"the engine core is not taking requests ({self._queued_adds} are waiting to reach it); "
                    "retry in a moment")
            self._queued_adds += 1
        self._outbox.put(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._outbox.put(AbortRequests(request_ids=request_ids))

    def _write(self) -> None:
        while True:
            msg = self._outbox.get()
            try:
                self.channel.send("engine_core", msg)
            except OSError as e:  # the supervisor is gone (the reader hears it too; the first report wins)
                with self._report_lock:
                    self._write_error = f"the front end could not write to the supervisor ({type(e).__name__}: {e})"
                    client = self._client
                if client is not None:
                    client.on_engine_dead(self._write_error)
                return
            except Exception:  # a message that does not encode: a bug; its request never gets an answer
                logger.exception("The front end could not send a %s", type(msg).__name__)
            finally:
                if isinstance(msg, AddRequest):
                    with self._count_lock:
                        self._queued_adds -= 1

    async def shutdown(self) -> None:
        """Nothing to stop here: the supervisor stops the engine-core process after the front end."""

    def start(self, client: EngineClient) -> None:
        """Read on the running event loop, the ``on_*`` reports running there too; called
        without a running loop (or with a supervisor client that cannot read without blocking),
        on a reader thread of its own (``_run``)."""
        with self._report_lock:
            self._client, failed = client, self._write_error
        if failed is not None:  # the writer ended before there was a client to tell
            client.on_engine_dead(failed)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or not self.channel.nonblocking:
            super().start(client)
            return
        self._loop, self._fd = loop, self.channel.fileno()
        loop.add_reader(self._fd, self._readable, client)
        # Frames that came in with CONFIG are already off the socket: it would never wake us for them.
        loop.call_soon(self._readable, client)

    def _readable(self, client: EngineClient) -> None:
        """The loop's reader callback: the frames of one read of the socket (or those already
        buffered), then back to the loop, which calls again while the socket has more."""
        try:
            msg = self.channel.recv_nowait()
            while msg is not None:
                self._dispatch(client, msg)
                msg = self.channel.recv_nowait(read=False)
        except Exception as e:
            try:
                self._loop.remove_reader(self._fd)
            finally:
                self._failed(client, e)

    def _run(self, client: EngineClient) -> None:
        """The reader thread, where ``start`` found no running loop or an older supervisor client."""
        try:
            while True:
                msg = self.channel.recv()
                if msg is not None:
                    self._dispatch(client, msg)
        except Exception as e:
            self._failed(client, e)

    @staticmethod
    def _dispatch(client: EngineClient, msg: Message) -> None:
        body = msg.body
        if isinstance(body, EngineOutputs):
            client.on_outputs(body)
        elif isinstance(body, EngineReady):
            client.kv_cache_tokens = body.num_blocks * body.block_size
            client.on_engine_ready()
        elif msg.kind is Kind.PEER_DIED:
            client.on_engine_dead(body.describe() if body is not None else
                                  "a process of the serve died (its report did not decode; see the log)")
        elif isinstance(body, Shutdown):
            client.on_shutdown_requested()
        else:
            logger.warning("Front end ignored a %s frame from %s", msg.kind.value, msg.src)

    @staticmethod
    def _failed(client: EngineClient, e: Exception) -> None:
        if isinstance(e, (EOFError, OSError)):
            client.on_engine_dead(f"the supervisor connection closed ({type(e).__name__}: {e})")
        else:  # a bug here must not leave the front end waiting on a silent engine
            logger.error("The front end's engine reader failed", exc_info=e)
            client.on_engine_dead(f"the front end's engine reader failed: {type(e).__name__}: {e}")
