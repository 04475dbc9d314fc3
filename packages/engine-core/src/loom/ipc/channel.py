"""A child's connection to the supervisor: typed messages over supervisor frames.

Every child of a serve starts the same way: connect to the socket the supervisor named
in ``LOOM_SUPERVISOR_SOCKET``, send HELLO (role, rank, pid, protocol version), receive
CONFIG (the pickled ``LoomConfig`` the CLI process built), and later send READY.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any

from ..logger import init_logger
from .codec import encode
from .messages import BODY_TYPES, PROTOCOL_VERSION, decode_body

logger = init_logger(__name__)


@dataclass(slots=True)
class Message:
    src: str
    kind: str
    body: Any


def role_name(role: str, rank: int | None) -> str:
    return f"worker:{rank}" if role == "worker" else role


class Channel:
    """Blocking send/recv of typed messages through the supervisor (thread-safe per direction)."""

    def __init__(self, role: str, rank: int = 0) -> None:
        from loom_supervisor import client

        self.role = role
        self.rank = rank
        self.name = role_name(role, rank)
        self._client = client
        self._conn = client.connect(os.environ["LOOM_SUPERVISOR_SOCKET"], role, rank)
        self._config_bytes = self._conn.hello(role, rank, PROTOCOL_VERSION)

    def config(self) -> Any:
        """The LoomConfig from CONFIG (built once, in the CLI process)."""
        return pickle.loads(self._config_bytes)

    def ready(self) -> None:
        self._conn.ready()

    def send(self, dst: str, kind: str, msg: Any) -> None:
        self._conn.send(dst, kind, encode(msg))

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next message, decoded; None on timeout. ``EOFError`` when the supervisor is gone.

        A body that does not decode is logged and dropped: one bad frame must not take
        the process down.
        """
        while True:
            frame = self._conn.recv(timeout)
            if frame is None:
                return None
            try:
                if frame.kind in BODY_TYPES:
                    body: Any = decode_body(frame.kind, frame.body)
                elif frame.kind == self._client.PEER_DIED:
                    body = self._client.decode_body(frame)
                else:
                    body = frame.body
            except (ValueError, TypeError, KeyError) as e:
                logger.error("Dropped a %s frame from %s whose body does not decode: %s", frame.kind, frame.src, e)
                continue
            return Message(frame.src, frame.kind, body)

    def close(self) -> None:
        self._conn.close()
