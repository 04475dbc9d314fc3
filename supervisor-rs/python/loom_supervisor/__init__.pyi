# Hand-written stub for loom_supervisor; the native part is typed in _native.pyi.
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from . import client as client

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

WIRE_VERSION: int  # the frame format's version; nothing about the messages
__version__: str

class SupervisorError(Exception):
    """Base class of every supervisor error."""

class PlanError(SupervisorError):
    """The launch plan is invalid, or could not be built."""

class SpawnError(SupervisorError):
    """A child process could not be started."""

class SetupError(SupervisorError):
    """The run directory, its socket, the signal handlers or the event loop could not be set up."""

@dataclass(slots=True, kw_only=True)
class ProcessPlan:
    role: Literal["frontend", "engine_core", "worker"]
    argv: Sequence[str]  # argv[0]: an absolute path (the environment is replaced)
    rank: int = 0  # frontend and engine_core are unique anyway
    env: Mapping[str, str] = ...  # the COMPLETE environment (default empty); LOOM_* are added
    def to_wire(self) -> dict[str, Any]: ...

@dataclass(slots=True, kw_only=True)
class Plan:
    processes: Sequence[ProcessPlan]
    config: bytes = b""  # sent unchanged to every child in CONFIG
    startup_timeout_s: float = 300.0  # per start-up phase (HELLO, READY)
    grace_period_s: float = 10.0
    max_frame_bytes: int = 67108864  # 64 MiB; larger frames are dropped
    ready_url: str | None = None  # printed once every process is READY
    messages_version: int = ...  # loom's message schema version, stated by every HELLO; default WIRE_VERSION
    startup_trace_dir: str | None = None  # write supervisor.json (spawn/HELLO/CONFIG/READY times) there
    def to_wire(self) -> dict[str, Any]: ...
    def to_msgpack(self) -> bytes: ...

def run(plan: Plan | Mapping[str, Any] | bytes) -> int:
    """Supervises the plan until the serve ends; returns the exit code to use."""
