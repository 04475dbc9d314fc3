# Hand-written stub for loom_supervisor; the native part is typed in _native.pyi.
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from . import client as client

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

PROTOCOL_VERSION: int
__version__: str

class SupervisorError(Exception):
    """Base class of every supervisor error."""

class PlanError(SupervisorError):
    """The launch plan is invalid, or could not be built."""

class SpawnError(SupervisorError):
    """A child process could not be started."""

class SetupError(SupervisorError):
    """The run directory, its socket, the signal handlers or the event loop could not be set up."""

class _ProcessPlanRequired(TypedDict):
    role: Literal["frontend", "engine_core", "worker"]
    argv: Sequence[str]  # argv[0]: an absolute path (the environment is replaced)

class ProcessPlan(_ProcessPlanRequired, total=False):
    rank: int  # default 0; frontend and engine_core are unique anyway
    env: Mapping[str, str]  # the COMPLETE environment; LOOM_* are added

class _PlanRequired(TypedDict):
    processes: Sequence[ProcessPlan]

class Plan(_PlanRequired, total=False):
    config: bytes  # sent unchanged to every child in CONFIG
    startup_timeout_s: float  # per start-up phase (HELLO, READY); default 300
    grace_period_s: float  # default 10
    max_frame_bytes: int  # default 64 MiB; larger frames are dropped
    ready_url: str | None  # printed once every process is READY
    protocol_version: int  # every HELLO must state it; default PROTOCOL_VERSION

def run(plan: Plan | Mapping[str, Any] | bytes) -> int:
    """Supervises the plan until the serve ends; returns the exit code to use."""
