"""Every message that crosses a process boundary of a serve, in one place.

Frames carry ``(src, dst, kind, body)``. Each message is a dataclass with exactly one
:class:`Kind` (``KIND_OF``), so a sender passes the struct alone and a receiver matches on
its type; ``body`` is the struct msgpack-encoded by :mod:`.codec`. ``MESSAGES_VERSION``
versions these structs (the supervisor checks that every HELLO states the plan's); bump it
when one changes. The frame format itself is the supervisor's (``loom_supervisor.WIRE_VERSION``).

=================  =======================  ==============================================
kind               direction                body
=================  =======================  ==============================================
ADD_REQUEST        frontend -> engine_core  AddRequest
ABORT              frontend -> engine_core  AbortRequests
OUTPUTS            engine_core -> frontend  EngineOutputs (deltas, per-request errors, stats)
ENGINE_READY       engine_core -> frontend  EngineReady
WORKER_INFO        worker:r -> engine_core  WorkerInfo (memory for the KV cache)
INIT_CACHE         engine_core -> workers   InitCache
CACHE_READY        worker:r -> engine_core  CacheReady (cache allocated)
EXECUTE            engine_core -> workers   SchedulerOutput
MODEL_OUTPUT       worker:0 -> engine_core  ModelRunnerOutput
STEP_ERROR         worker:r -> engine_core  StepError
RESUME_STEPS       engine_core -> workers   ResumeSteps (after a failed step)
SHUTDOWN           supervisor -> frontend   Shutdown (drain, then exit 0)
PEER_DIED          supervisor -> frontend   loom_supervisor.client.PeerDied
=================  =======================  ==============================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from loom_plugin_api import LoRARequest, SamplingParams
from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

from ..outputs import RequestOutput
from ..stats import EngineStats
from .codec import decode, encode

MESSAGES_VERSION = 5  # 5: overlapped steps (PENDING_TOKEN in EXECUTE, RESUME_STEPS); 4: LoRA requests

PENDING_TOKEN = -1
"""In an EXECUTE's token ids: the token the step before sampled for this request, not known when
the engine scheduled this one (overlapped steps); the worker process puts it in."""


class Kind(str, enum.Enum):
    """A frame's kind: which message its body holds."""

    ADD_REQUEST = "ADD_REQUEST"
    ABORT = "ABORT"
    OUTPUTS = "OUTPUTS"
    ENGINE_READY = "ENGINE_READY"
    WORKER_INFO = "WORKER_INFO"
    INIT_CACHE = "INIT_CACHE"
    CACHE_READY = "CACHE_READY"
    EXECUTE = "EXECUTE"
    MODEL_OUTPUT = "MODEL_OUTPUT"
    STEP_ERROR = "STEP_ERROR"
    RESUME_STEPS = "RESUME_STEPS"
    # from the supervisor (its own wire names)
    SHUTDOWN = "SHUTDOWN"
    PEER_DIED = "PEER_DIED"


@dataclass(slots=True, kw_only=True)
class AddRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = True
    lora_request: LoRARequest | None = None


@dataclass(slots=True, kw_only=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(slots=True, kw_only=True)
class RequestError:
    request_id: str
    message: str
    status: int = 400
    """400: the engine rejected the request; 500: it failed the request and serves the others."""


@dataclass(slots=True, kw_only=True)
class EngineOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: EngineStats | None = None


@dataclass(slots=True, kw_only=True)
class EngineReady:
    num_blocks: int
    block_size: int


@dataclass(slots=True, kw_only=True)
class WorkerInfo:
    rank: int
    available_bytes: int
    block_bytes: int
    block_size: int


@dataclass(slots=True, kw_only=True)
class InitCache:
    num_blocks: int
    block_size: int


@dataclass(slots=True, kw_only=True)
class CacheReady:
    rank: int


@dataclass(slots=True, kw_only=True)
class StepError:
    rank: int
    message: str
    step: int = -1
    """Which EXECUTE failed, counted by the worker from 0 (-1: not known): a rank's error about a
    step the engine already finished is stale, not the next step's."""


@dataclass(slots=True, kw_only=True)
class ResumeSteps:
    """After a failed step a worker answers every EXECUTE with a StepError, unrun, until this: the
    steps the engine scheduled before it knew of the failure build on the failed one's tokens and
    KV; the engine discards them, then sends this."""


@dataclass(slots=True, kw_only=True)
class Shutdown:
    """The supervisor asks the front end to drain (its frame has an empty body)."""


BODY_TYPES: dict[Kind, type] = {
    Kind.ADD_REQUEST: AddRequest,
    Kind.ABORT: AbortRequests,
    Kind.OUTPUTS: EngineOutputs,
    Kind.ENGINE_READY: EngineReady,
    Kind.WORKER_INFO: WorkerInfo,
    Kind.INIT_CACHE: InitCache,
    Kind.CACHE_READY: CacheReady,
    Kind.EXECUTE: SchedulerOutput,
    Kind.MODEL_OUTPUT: ModelRunnerOutput,
    Kind.STEP_ERROR: StepError,
    Kind.RESUME_STEPS: ResumeSteps,
}
"""The structs peers exchange, by kind (SHUTDOWN and PEER_DIED come from the supervisor)."""

SUPERVISOR_KINDS: dict[Kind, type | None] = {Kind.SHUTDOWN: Shutdown, Kind.PEER_DIED: None}
"""Kinds the supervisor sends; PEER_DIED's body is ``loom_supervisor.client.PeerDied``."""

KIND_OF: dict[type, Kind] = {tp: kind for kind, tp in BODY_TYPES.items()}

__all__ = [
    "BODY_TYPES", "KIND_OF", "MESSAGES_VERSION", "PENDING_TOKEN", "SUPERVISOR_KINDS", "AbortRequests", "AddRequest", "CacheReady", "EngineOutputs",
    "EngineReady", "InitCache", "Kind", "RequestError", "ResumeSteps", "Shutdown", "StepError", "WorkerInfo", "decode",
    "decode_body", "encode", "kind_of",
]


def kind_of(msg: object) -> Kind:
    """The kind a message travels as; a type without one is an error naming it."""
    for tp in type(msg).__mro__:
        kind = KIND_OF.get(tp)
        if kind is not None:
            return kind
    raise TypeError(f"{type(msg).__name__} is not a message type; known: "
                    f"{', '.join(tp.__name__ for tp in KIND_OF)}")


def decode_body(kind: str, body: bytes) -> object:
    """Decode a frame body by its kind; an unknown kind is an error naming it."""
    try:
        tp = BODY_TYPES[Kind(kind)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown message kind {kind!r}; known: {', '.join(BODY_TYPES)}") from None
    return decode(tp, body)
