"""loom's process supervisor, from Python.

``run(plan)`` spawns every process of a serve, relays their frames and watches them until
the serve ends; it returns the exit code to use. ``Plan`` and ``ProcessPlan`` are the
launch plan. ``client`` is the other side: what a child process uses to talk to the
supervisor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from . import client
from ._native import WIRE_VERSION, PlanError, SetupError, SpawnError, SupervisorError, __version__
from ._native import run as _run

__all__ = [
    "Plan",
    "PlanError",
    "ProcessPlan",
    "SetupError",
    "SpawnError",
    "SupervisorError",
    "WIRE_VERSION",
    "__version__",
    "client",
    "run",
]

if client.WIRE_VERSION != WIRE_VERSION:  # pragma: no cover - a packaging mistake
    raise ImportError(
        f"loom_supervisor.client speaks wire version {client.WIRE_VERSION} but the native "
        f"supervisor speaks {WIRE_VERSION}; reinstall loom-supervisor"
    )


@dataclass(slots=True, kw_only=True)
class ProcessPlan:
    """One child of the serve.

    ``argv[0]`` should be an absolute path (the environment is replaced, so ``PATH``
    lookup uses this ``env``). ``env`` is the child's COMPLETE environment; the supervisor
    adds ``LOOM_SUPERVISOR_SOCKET``, ``LOOM_ROLE`` and ``LOOM_RANK``, and left empty the
    child gets those three alone. ``rank`` tells workers apart; the frontend and the
    engine core are unique anyway.
    """

    role: Literal["frontend", "engine_core", "worker"]
    argv: Sequence[str]
    rank: int = 0
    env: Mapping[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready map the supervisor reads: ``{role, rank, argv, env}``."""
        return {"role": self.role, "rank": self.rank, "argv": list(self.argv), "env": dict(self.env)}


@dataclass(slots=True, kw_only=True)
class Plan:
    """The launch plan: which processes a serve runs and the limits it runs them under.

    ``processes`` in plan order (also the order of SIGTERM within a role); ``config`` is
    sent unchanged to every child in CONFIG; ``startup_timeout_s`` is the deadline of each
    start-up phase (HELLO after spawn, READY after CONFIG); ``grace_period_s`` how long a
    child gets to exit after SHUTDOWN or SIGTERM; frames over ``max_frame_bytes`` are
    dropped; ``ready_url`` is printed once every process is READY; ``messages_version``
    is the version of the message schema the children exchange (loom's), which every
    HELLO must state; once every process is READY, a child that sends no HEARTBEAT for
    ``heartbeat_timeout_s`` (0: not watched) is reported as not responding, like a death
    (``client.Client.ready`` starts the heartbeats). ``startup_trace_dir``: a directory where
    the supervisor writes ``supervisor.json``, when each child was spawned and its HELLO, CONFIG
    and READY happened (nanoseconds since the epoch, ``time.time_ns()``'s clock), once every
    process is READY or when the serve ends before that; None records nothing. The defaults are
    the ones the supervisor applies to a key left out.
    """

    processes: Sequence[ProcessPlan]
    config: bytes = b""
    startup_timeout_s: float = 300.0
    grace_period_s: float = 10.0
    max_frame_bytes: int = 64 << 20
    heartbeat_timeout_s: float = 0.0
    ready_url: str | None = None
    messages_version: int = WIRE_VERSION
    startup_trace_dir: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready map the supervisor reads, every key given."""
        processes = []
        for i, p in enumerate(self.processes):
            if not isinstance(p, ProcessPlan):
                raise PlanError(f"invalid plan: processes[{i}] is a {type(p).__name__}; expected a ProcessPlan")
            processes.append(p.to_wire())
        return {
            "processes": processes,
            "config": bytes(self.config),
            "startup_timeout_s": self.startup_timeout_s,
            "grace_period_s": self.grace_period_s,
            "max_frame_bytes": self.max_frame_bytes,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "ready_url": self.ready_url,
            "messages_version": self.messages_version,
            "startup_trace_dir": self.startup_trace_dir,
        }

    def to_msgpack(self) -> bytes:
        """The plan as the supervisor takes it (``run``, ``loom-supervisor run-plan``)."""
        try:
            data: bytes = msgpack.packb(self.to_wire(), use_bin_type=True)  # to_wire may raise TypeError too
        except (TypeError, ValueError) as e:
            raise PlanError(f"invalid plan: it cannot be encoded as msgpack: {e}") from e
        return data


def run(plan: Plan | Mapping[str, Any] | bytes) -> int:
    """Supervises ``plan`` until the serve ends; returns the exit code to use.

    ``plan`` is a ``Plan``, its msgpack encoding (``Plan.to_msgpack``) or a mapping with
    the same keys (``Plan.to_wire``; a key left out takes the supervisor's default, an
    unknown key is a ``PlanError``).
    The GIL is released while it runs, and SIGINT/SIGTERM belong to the supervisor
    until it returns (they stop the serve in order; Python's handlers are restored
    afterwards). One serve at a time per process; a second concurrent call raises
    ``SetupError``.
    """
    if isinstance(plan, Plan):
        data = plan.to_msgpack()
    elif isinstance(plan, (bytes, bytearray, memoryview)):
        data = bytes(plan)
    else:
        try:
            data = msgpack.packb(dict(plan), use_bin_type=True)
        except (TypeError, ValueError) as e:
            raise PlanError(f"invalid plan: it cannot be encoded as msgpack: {e}") from e
    return _run(data)
