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
map ``{role, rank, pid, exit_code, signal, phase, reason, stderr_tail}``, plus ``node``
for a remote process, decoded by ``PeerDied.from_frame``).

The engine core reports a process the supervisor did not spawn (a Ray actor) that died
with ``REMOTE_DIED`` to ``supervisor``, its body a PEER_DIED body
(``conn.send(SUPERVISOR, REMOTE_DIED, peer_died.to_body())``); the supervisor then ends
the serve as for a death of its own children. From any other process it is dropped.

``WIRE_VERSION`` versions the frame format only. The messages the children exchange are
loom's; their schema version (``messages_version``) is stated in every HELLO and must
equal the plan's.

``encode`` and ``Decoder`` are the framing alone, for event loops that own the socket.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from time import monotonic as _monotonic
from types import NoneType
from typing import Any, ClassVar, overload

import msgpack

__all__ = [
    "WIRE_VERSION", "ENV_SOCKET", "ENV_ROLE", "ENV_RANK", "SUPERVISOR", "WORKERS",
    "HELLO", "CONFIG", "READY", "SHUTDOWN", "PEER_DIED", "REMOTE_DIED",
    "Frame", "PeerDied", "ProtocolError", "Client", "Decoder", "address", "connect", "encode", "decode_body",
]

WIRE_VERSION = 1
"""The frame format version (every frame's first item), equal to the supervisor's
``loom_supervisor.WIRE_VERSION``. It is also the default ``messages_version`` of a HELLO
and of a plan, but versions nothing about the messages themselves."""

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
REMOTE_DIED = "REMOTE_DIED"
"""Engine core -> supervisor: a remote process died; the body is ``PeerDied.to_body()``."""
HEARTBEAT = "HEARTBEAT"
HEARTBEAT_INTERVAL_S = 1.0
"""How often a ready child tells the supervisor it is alive (a thread of its own)."""

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
    payload: bytes = msgpack.packb([WIRE_VERSION, src, dst, kind, bytes(body)], use_bin_type=True)
    return _PREFIX.pack(len(payload)) + payload


def decode_body(frame: Frame) -> Any:
    """The msgpack body of a frame (a HELLO, say) as plain Python objects; for PEER_DIED
    use ``PeerDied.from_frame``, which also checks its shape."""
    return msgpack.unpackb(frame.body, raw=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerDied:
    """The body of PEER_DIED: the supervisor tells the lead process that another one
    failed, before it stops them all.

    ``exit_code`` is set when the process exited, ``signal`` (a name: ``"SIGKILL"``)
    when a signal killed it; both are None when the supervisor stopped it (a missed
    start-up deadline, a HELLO that did not match). ``phase`` is where it was: ``spawned``,
    ``hello``, ``config``, ``ready`` or ``running``. ``reason`` is the supervisor's one
    line (``"worker:1 exited with code 1"``); ``stderr_tail`` its last stderr lines.
    ``node`` is where a remote process ran (a Ray node's IP), None for the supervisor's
    own children; bodies without it decode as before.
    """

    role: str
    rank: int
    pid: int
    exit_code: int | None
    signal: str | None
    phase: str
    reason: str
    stderr_tail: tuple[str, ...]
    node: str | None = None

    # Field name -> accepted types, in the order of the body (see supervisor-rs/src/report.rs).
    _FIELDS: ClassVar[dict[str, tuple[type, ...]]] = {
        "role": (str,), "rank": (int,), "pid": (int,), "exit_code": (int, NoneType), "signal": (str, NoneType),
        "phase": (str,), "reason": (str,), "stderr_tail": (list, tuple),
    }

    @classmethod
    def from_frame(cls, frame: Frame) -> PeerDied:
        """Decodes a PEER_DIED frame; ``ProtocolError`` (naming the field) when its body
        is not the map the supervisor sends. Keys this client does not know are ignored."""
        if frame.kind != PEER_DIED:
            raise ProtocolError(f"expected a {PEER_DIED} frame, got {frame.kind} from {frame.src}")
        try:
            body = msgpack.unpackb(frame.body, raw=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise ProtocolError(f"{PEER_DIED} body is not msgpack: {e}") from e
        if not isinstance(body, dict):
            raise ProtocolError(f"{PEER_DIED} body is a {type(body).__name__}; expected a map")
        values: dict[str, Any] = {}
        for name, types in cls._FIELDS.items():
            if name not in body:
                raise ProtocolError(f"{PEER_DIED} body has no {name!r}")
            value = body[name]
            # bool is an int subclass, but never a rank, pid or exit code.
            if not isinstance(value, types) or isinstance(value, bool):
                expected = " or ".join("None" if t is NoneType else t.__name__ for t in types)
                raise ProtocolError(f"{PEER_DIED} body field {name!r} is {value!r}; expected {expected}")
            values[name] = value
        tail = values["stderr_tail"]
        if not all(isinstance(line, str) for line in tail):
            raise ProtocolError(f"{PEER_DIED} body field 'stderr_tail' holds a non-string: {tail!r}")
        values["stderr_tail"] = tuple(tail)
        node = body.get("node")
        if not isinstance(node, (str, NoneType)):
            raise ProtocolError(f"{PEER_DIED} body field 'node' is {node!r}; expected str or None")
        return cls(**values, node=node)

    def to_body(self) -> bytes:
        """The msgpack map ``from_frame`` reads (``node`` only when set): the body of a
        REMOTE_DIED the engine core sends to the supervisor."""
        body: dict[str, Any] = {name: getattr(self, name) for name in self._FIELDS}
        body["stderr_tail"] = list(self.stderr_tail)
        if self.node is not None:
            body["node"] = self.node
        data: bytes = msgpack.packb(body, use_bin_type=True)
        return data

    def describe(self) -> str:
        """One line: which process, how it ended, in which phase, why. For example
        ``worker:1 (pid 123) died with signal SIGKILL during running: worker:1 was killed
        by SIGKILL``; a process the supervisor stopped (no exit code, no signal) "was
        stopped" instead; a remote one is ``worker:1 (pid 123 on node 10.0.0.2) ...``."""
        who = self.address
        if self.signal:
            how = f"died with signal {self.signal}"
        elif self.exit_code is not None:
            how = f"died with exit code {self.exit_code}"
        elif self.node:  # a remote process: its engine saw it die, no exit status reaches us
            how = "died"
        else:
            how = "was stopped"
        tail = [line for line in self.stderr_tail if line.strip()]
        cause = self.reason or (tail[-1].strip() if tail else "")
        where = f"pid {self.pid} on node {self.node}" if self.node else f"pid {self.pid}"
        text = f"{who} ({where}) {how} during {self.phase}"
        return text + (f": {cause}" if cause else "")

    @property
    def address(self) -> str:
        """The dead process's address (``worker:1``, ``engine_core``)."""
        return f"{self.role}:{self.rank}" if self.role == "worker" else self.role


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
        """Sends one frame from this process to ``dst`` (an address or ``workers``), waiting
        while the socket is full, even where something made it non-blocking: an event loop
        reading it (uvloop's ``add_reader`` does), which ``sendall`` would answer with
        ``BlockingIOError`` part-way through a frame."""
        data = memoryview(encode(self.address, dst, kind, body))
        with self._send_lock:
            while data:
                try:
                    data = data[self._sock.send(data):]
                except (BlockingIOError, InterruptedError):
                    writable = select.poll()  # (select.select refuses descriptors past 1023)
                    writable.register(self._sock, select.POLLOUT)
                    writable.poll()

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

    def recv_nowait(self, read: bool = True) -> Frame | None:
        """The next frame if one has fully arrived, else None, never blocking: for an event
        loop's reader callback (``loop.add_reader(conn.fileno(), ...)``). With nothing buffered
        it reads what the socket holds, once (``read=False``: not at all, so a callback can take
        one read's frames and give the loop a turn). ``EOFError`` when the supervisor closed the
        connection."""
        with self._recv_lock:
            if not self._ready and read:
                try:
                    chunk = self._sock.recv(_RECV_CHUNK, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return None
                if not chunk:
                    raise EOFError("the supervisor closed the connection")
                self._ready.extend(self._decoder.feed(chunk))
            return self._ready.popleft() if self._ready else None

    def hello(self, role: str | None = None, rank: int | None = None, messages_version: int | None = None) -> bytes:
        """Registers this process (HELLO) and returns the body of the CONFIG reply.

        ``role``/``rank`` default to the ones given at ``connect``; they must be what the
        supervisor spawned this process as. ``messages_version`` (default
        ``WIRE_VERSION``, as is the plan's) must equal the plan's ``messages_version``:
        the version of the message schema the children exchange. A mismatch in any of
        these stops the serve."""
        if role is not None or rank is not None:
            self.role = role if role is not None else self.role
            self.rank = rank if rank is not None else self.rank
            self.address = address(self.role, self.rank)
        body = msgpack.packb(
            {
                "role": self.role,
                "rank": self.rank,
                "pid": os.getpid(),
                "messages_version": WIRE_VERSION if messages_version is None else messages_version,
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
        """Ends this process's start-up: the supervisor reports it ready. From now on a thread
        sends a HEARTBEAT every ``HEARTBEAT_INTERVAL_S``: a process that stops (SIGSTOP, a
        frozen VM) falls silent and the supervisor reports it as not responding."""
        self.send(SUPERVISOR, READY)
        threading.Thread(target=self._beat, name="loom-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            try:
                self.send(SUPERVISOR, HEARTBEAT)
            except (OSError, ValueError):  # closed: the process is ending
                return

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
