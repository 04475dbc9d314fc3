"""A child's connection to the supervisor: typed messages over supervisor frames.

Only processes the supervisor runs import this module (it needs the loom-supervisor wheel).

Every child of a serve starts the same way: connect to the socket the supervisor named
in ``LOOM_SUPERVISOR_SOCKET``, send HELLO (role, rank, pid, ``MESSAGES_VERSION``), receive
CONFIG (the pickled ``LoomConfig`` the CLI process built), and later send READY.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loom_plugin_api import tracing
from loom_plugin_api.tracing import span
from loom_supervisor import client
from loom_supervisor.client import Client, PeerDied, ProtocolError

from ..logger import init_logger
from .codec import encode
from .messages import MESSAGES_VERSION, Kind, Shutdown, decode_body, kind_of

logger = init_logger(__name__)


@dataclass(slots=True)
class Message:
    src: str
    kind: Kind
    body: Any
    """The struct of ``kind`` (``loom_supervisor.client.PeerDied`` for PEER_DIED, None if its body was bad)."""


def role_name(role: str, rank: int | None) -> str:
    return f"worker:{rank}" if role == "worker" else role


class Channel:
    """Blocking send/recv of typed messages through the supervisor (thread-safe per direction)."""

    def __init__(self, conn: Client, name: str, config_bytes: bytes = b"") -> None:
        self.name = name
        self._conn = conn
        self._config_bytes = config_bytes

    @classmethod
    def connect(cls, role: str, rank: int = 0) -> Channel:
        """Connect to the supervisor that spawned this process: HELLO, then CONFIG."""
        with span("connect, HELLO, wait for CONFIG", waits=True):
            conn = client.connect(os.environ[client.ENV_SOCKET], role, rank)
            config_bytes = conn.hello(role, rank, MESSAGES_VERSION)
        return cls(conn, role_name(role, rank), config_bytes)

    def config(self) -> Any:
        """The LoomConfig from CONFIG (built once, in the CLI process)."""
        with span("unpickle the config"):
            return pickle.loads(self._config_bytes)

    def ready(self) -> None:
        """READY to the supervisor; a traced start-up writes this process's spans first."""
        tracing.ready()
        self._conn.ready()

    def send_to_supervisor(self, kind: str, body: bytes) -> None:
        """A frame of the supervisor's own protocol (its kinds, its body encoding)."""
        self._conn.send("supervisor", kind, body)

    def send(self, dst: str, msg: Any) -> None:
        self._conn.send(dst, kind_of(msg).value, encode(msg))

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next message, decoded; None on timeout. ``EOFError`` when the supervisor is gone.

        A frame whose kind is unknown or whose body does not decode is logged and dropped:
        one bad frame must not take the process down (a PEER_DIED still arrives, with body None).
        """
        return _first_message(lambda: self._conn.recv(timeout))

    @property
    def nonblocking(self) -> bool:
        """Whether :meth:`recv_nowait` works: the installed supervisor client has it (a wheel built
        before 2026-12-05 lacks it; the front end then reads on a thread, as it did then)."""
        return hasattr(self._conn, "recv_nowait")

    def recv_nowait(self, read: bool = True) -> Message | None:
        """The next message if one has fully arrived, else None, never blocking (for an event
        loop's reader; :meth:`fileno` is what to watch). With nothing buffered it reads the
        socket once, or with ``read=False`` not at all. Frames that do not decode are dropped
        as by :meth:`recv`."""
        return _first_message(lambda: self._conn.recv_nowait(read))

    def fileno(self) -> int:
        return self._conn.fileno()

    def close(self) -> None:
        self._conn.close()


def _first_message(next_frame: Callable[[], client.Frame | None]) -> Message | None:
    """The first frame from ``next_frame`` that decodes, as a message; None when it gives None."""
    while (frame := next_frame()) is not None:
        msg = _decoded(frame)
        if msg is not None:
            return msg
    return None


def _decoded(frame: client.Frame) -> Message | None:
    """``frame`` as a message; None (logged) for a frame that does not decode, but a PEER_DIED:
    a process died all the same, so the receiver hears it, with body None."""
    try:
        kind = Kind(frame.kind)
        if kind is Kind.PEER_DIED:
            body: Any = PeerDied.from_frame(frame)
        elif kind is Kind.SHUTDOWN:
            body = Shutdown()
        else:
            body = decode_body(kind, frame.body)
    except (ValueError, TypeError, KeyError, ProtocolError) as e:
        # escaped: a peer's text must not forge log lines
        logger.error("Dropped a %a frame from %a that does not decode: %a", frame.kind, frame.src,
                     str(e) or f"{type(e).__name__} (not a msgpack body)")
        if frame.kind != Kind.PEER_DIED.value:
            return None
        body, kind = None, Kind.PEER_DIED
    return Message(frame.src, kind, body)
