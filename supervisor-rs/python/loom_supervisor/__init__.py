"""loom's process supervisor, from Python.

``run(plan)`` spawns every process of a serve, relays their frames and watches them until
the serve ends; it returns the exit code to use. ``client`` is the other side: what a
child process uses to talk to the supervisor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

import msgpack

from . import client
from ._native import PROTOCOL_VERSION, PlanError, SetupError, SpawnError, SupervisorError, __version__
from ._native import run as _run

__all__ = [
    "PROTOCOL_VERSION",
    "Plan",
    "PlanError",
    "ProcessPlan",
    "SetupError",
    "SpawnError",
    "SupervisorError",
    "__version__",
    "client",
    "run",
]

if client.PROTOCOL_VERSION != PROTOCOL_VERSION:  # pragma: no cover - a packaging mistake
    raise ImportError(
        f"loom_supervisor.client speaks protocol {client.PROTOCOL_VERSION} but the native "
        f"supervisor speaks {PROTOCOL_VERSION}; reinstall loom-supervisor"
    )


class _ProcessPlanRequired(TypedDict):
    role: Literal["frontend", "engine_core", "worker"]
    argv: Sequence[str]


class ProcessPlan(_ProcessPlanRequired, total=False):
    """One child: ``argv[0]`` should be an absolute path (the environment is replaced);
    ``env`` is its COMPLETE environment (the supervisor adds ``LOOM_SUPERVISOR_SOCKET``,
    ``LOOM_ROLE`` and ``LOOM_RANK``); ``rank`` defaults to 0."""

    rank: int
    env: Mapping[str, str]


class _PlanRequired(TypedDict):
    processes: Sequence[ProcessPlan]


class Plan(_PlanRequired, total=False):
    """The launch plan. Defaults: ``config`` empty, ``startup_timeout_s`` 300 (per
    start-up phase: HELLO after spawn, READY after CONFIG), ``grace_period_s`` 10,
    ``max_frame_bytes`` 64 MiB, ``ready_url`` None, ``protocol_version``
    ``PROTOCOL_VERSION`` (what every HELLO must state)."""

    config: bytes
    startup_timeout_s: float
    grace_period_s: float
    max_frame_bytes: int
    ready_url: str | None
    protocol_version: int


def run(plan: Plan | Mapping[str, Any] | bytes) -> int:
    """Supervises ``plan`` until the serve ends; returns the exit code to use.

    ``plan`` is a mapping (or its msgpack encoding) with ``processes`` (a list of
    ``{role, rank, argv, env}``), ``config`` (bytes), ``startup_timeout_s``,
    ``grace_period_s``, ``max_frame_bytes``, ``ready_url`` and ``protocol_version``; see
    ``__init__.pyi``.
    The GIL is released while it runs, and SIGINT/SIGTERM belong to the supervisor
    until it returns (they stop the serve in order; Python's handlers are restored
    afterwards). One serve at a time per process; a second concurrent call raises
    ``SetupError``.
    """
    if isinstance(plan, (bytes, bytearray, memoryview)):
        data = bytes(plan)
    else:
        try:
            data = msgpack.packb(dict(plan), use_bin_type=True)
        except (TypeError, ValueError) as e:
            raise PlanError(f"invalid plan: it cannot be encoded as msgpack: {e}") from e
    return _run(data)
