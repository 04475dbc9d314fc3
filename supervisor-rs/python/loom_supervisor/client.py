"""The child side of the supervisor protocol (stdlib + msgpack only, no native code).

Every process of a serve talks to the others through the supervisor, over the Unix
socket named by ``$LOOM_SUPERVISOR_SOCKET``::

    from loom_supervisor import client

    conn = client.connect()              # role/rank from $LOOM_ROLE / $LOOM_RANK
    config = conn.hello()                # HELLO, then the CONFIG body (bytes)
    ...                                  # build the process from config
    conn.ready()                         # READY ends this process's start-up
    conn.send("engine_core", "ECHO", b"...")
    frame = conn.recv()                  # Frame(version, src, dst, kind, body)

Wire format: a 4-byte big-endian length, then the msgpack array
``[version, src, dst, kind, body]`` with ``body`` as msgpack bin. Addresses are
``frontend``, ``engine_core``, ``worker:<rank>``, ``workers`` (every worker but the
sender; destination only) and ``supervisor``. The supervisor sends ``CONFIG`` (the
plan's config bytes), ``SHUTDOWN`` to the frontend when asked to stop (drain, then
exit 0), and ``PEER_DIED`` to the frontend when another process died (body: msgpack
map ``{role, rank, pid, exit_code, signal, phase, reason, stderr_tail}``).

``encode`` and ``Decoder`` are the framing alone, for event loops that own the socket.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass
from time import monotonic as _monotonic
from typing import Any, overload

import msgpack

__all__ = [
    "PROTOCOL_VERSION", "ENV_SOCKET", "ENV_ROLE", "ENV_RANK", "SUPERVISOR", "WORKERS",
    "HELLO", "CONFIG", "READY", "SHUTDOWN", "PEER_DIED",
    "Frame", "ProtocolError", "Client", "Decoder", "address", "connect", "encode", "decode_body",
]

PROTOCOL_VERSION = 1
"""The wire format version (every frame's first item), equal to the supervisor's
``loom_supervisor.PROTOCOL_VERSION``; also what HELLO states unless told otherwise."""

ENV_SOCKET = "LOOM_SUPERVISOR_SOCKET"
ENV_ROLE = "LOOM_ROLE"
ENV_RANK = "LOOM_RANK"

SUPERVISOR = "supervisor"
WORKERS = "workers"

HELLO = "HELLO"
CONFIG = "CONFIG"
READY = "READY"
SHUTDOWN = "SHUTDOWN"
PEER_DIED = "PEER_DIED"

_PREFIX = struct.Struct(">I")
_RECV_CHUNK = 1 << 16


class ProtocolError(Exception):
    """The supervisor sent something this client does not understand, or closed early."""


@dataclass(frozen=True, slots=True)
class Frame:
    version: int
    src: str
    dst: str
    kind: str
    body: bytes


def address(role: str, rank: int = 0) -> str:
    """The address of a process: ``frontend``, ``engine_core`` or ``worker:<rank>``."""
    if role == "worker":
        return f"worker:{rank}"
    if role in ("frontend", "engine_core"):
        return role
    raise ValueError(f"unknown role {role!r}; expected 'frontend', 'engine_core' or 'worker'")


def encode(src: str, dst: str, kind: str, body: bytes = b"") -> bytes:
    """One frame, length prefix included."""
    payload: bytes = msgpack.packb([PROTOCOL_VERSION, src, dst, kind, bytes(body)], use_bin_type=True)
    return _PREFIX.pack(len(payload)) + payload


def decode_body(frame: Frame) -> Any:
    """The body of a supervisor message (HELLO, PEER_DIED) as Python objects."""
    return msgpack.unpackb(frame.body, raw=False)


class Decoder:
    """Turns a byte stream into frames: ``feed(data)`` returns the frames completed so far."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        frames = []
        while len(self._buf) >= _PREFIX.size:
            (length,) = _PREFIX.unpack_from(self._buf)
            end = _PREFIX.size + length
            if len(self._buf) < end:
                break
            frames.append(_parse(bytes(self._buf[_PREFIX.size:end])))
            del self._buf[:end]
        return frames

    def pending(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)


def _parse(payload: bytes) -> Frame:
    try:
        version, src, dst, kind, body = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"malformed frame from the supervisor: {e}") from e
    return Frame(version, src, dst, kind, body)


class Client:
    """A connection to the supervisor. ``send`` and ``recv`` are each safe to call from
    several threads (one lock per direction)."""

    def __init__(self, sock: socket.socket, role: str, rank: int = 0) -> None:
        self._sock = sock
        self.role = role
        self.rank = rank
        self.address = address(role, rank)
        self._decoder = Decoder()
        self._ready: deque[Frame] = deque()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()

    def send(self, dst: str, kind: str, body: bytes = b"") -> None:
        """Sends one frame from this process to ``dst`` (an address or ``workers``)."""
        data = encode(self.address, dst, kind, body)
        with self._send_lock:
            self._sock.sendall(data)

    @overload
    def recv(self, timeout: None = None) -> Frame: ...
    @overload
    def recv(self, timeout: float) -> Frame | None: ...

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame, or None when ``timeout`` seconds pass without one; raises
        ``EOFError`` when the supervisor closed the connection."""
        deadline = None if timeout is None else _monotonic() + timeout
        with self._recv_lock:
            while not self._ready:
                if deadline is not None:
                    left = deadline - _monotonic()
                    if left <= 0 or not select.select([self._sock], [], [], left)[0]:
                        return None
                chunk = self._sock.recv(_RECV_CHUNK)
                if not chunk:
                    raise EOFError("the supervisor closed the connection")
                self._ready.extend(self._decoder.feed(chunk))
            return self._ready.popleft()

    def hello(self, role: str | None = None, rank: int | None = None, protocol_version: int | None = None) -> bytes:
        """Registers this process (HELLO) and returns the body of the CONFIG reply.

        ``role``/``rank`` default to the ones given at ``connect``; they must be what the
        supervisor spawned this process as. ``protocol_version`` (default the wire
        version) must equal the plan's ``protocol_version``: the version of the messages
        the children exchange. A mismatch in any of these stops the serve."""
        if role is not None or rank is not None:
            self.role = role if role is not None else self.role
            self.rank = rank if rank is not None else self.rank
            self.address = address(self.role, self.rank)
        body = msgpack.packb(
            {
                "role": self.role,
                "rank": self.rank,
                "pid": os.getpid(),
                "protocol_version": PROTOCOL_VERSION if protocol_version is None else protocol_version,
            },
            use_bin_type=True,
        )
        self.send(SUPERVISOR, HELLO, body)
        try:
            frame = self.recv()
        except EOFError as e:
            raise ProtocolError(
                "the supervisor closed the connection after HELLO (see its log for the reason)"
            ) from e
        if frame.kind != CONFIG:
            raise ProtocolError(f"expected CONFIG after HELLO, got {frame.kind} from {frame.src}")
        return frame.body

    def ready(self) -> None:
        """Ends this process's start-up: the supervisor reports it ready."""
        self.send(SUPERVISOR, READY)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(path: str | None = None, role: str | None = None, rank: int | None = None) -> Client:
    """Connects to the supervisor; each argument defaults to the variable the supervisor
    set for this process (``LOOM_SUPERVISOR_SOCKET``, ``LOOM_ROLE``, ``LOOM_RANK``)."""
    path = path if path is not None else _env(ENV_SOCKET)
    role = role if role is not None else _env(ENV_ROLE)
    rank = rank if rank is not None else int(os.environ.get(ENV_RANK, "0"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return Client(sock, role, rank)


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"${name} is not set: this process was not started by loom-supervisor")
    return value
