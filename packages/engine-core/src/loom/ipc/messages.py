"""Every message that crosses a process boundary of a serve, in one place.

Frames carry ``(src, dst, kind, body)``; ``kind`` names one of the structs below and
``body`` is that struct, msgpack-encoded by :mod:`.codec`. ``PROTOCOL_VERSION`` is
checked at HELLO by the supervisor; bump it when a struct changes.

Who sends what:

=================  =======================  ==============================================
kind               direction                body
=================  =======================  ==============================================
ADD_REQUEST        frontend -> engine_core  AddRequest
ABORT              frontend -> engine_core  AbortRequests
OUTPUTS            engine_core -> frontend  EngineOutputs (deltas, per-request errors, stats)
WORKER_INFO        worker:r -> engine_core  WorkerInfo (memory for the KV cache)
INIT_CACHE         engine_core -> workers   InitCache
CACHE_READY        worker:r -> engine_core  WorkerInfo (echoed, cache allocated)
EXECUTE            engine_core -> workers   SchedulerOutput
MODEL_OUTPUT       worker:0 -> engine_core  ModelRunnerOutput
STEP_ERROR         worker:r -> engine_core  StepError
ENGINE_READY       engine_core -> frontend  EngineReady
=================  =======================  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.llm_engine import EngineStats
from ..engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .codec import decode, encode

PROTOCOL_VERSION = 2  # 2: penalties and prompt logprobs in SamplingParams, runner and request outputs

ADD_REQUEST = "ADD_REQUEST"
ABORT = "ABORT"
OUTPUTS = "OUTPUTS"
WORKER_INFO = "WORKER_INFO"
INIT_CACHE = "INIT_CACHE"
CACHE_READY = "CACHE_READY"
EXECUTE = "EXECUTE"
MODEL_OUTPUT = "MODEL_OUTPUT"
STEP_ERROR = "STEP_ERROR"
ENGINE_READY = "ENGINE_READY"


@dataclass(slots=True, kw_only=True)
class AddRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = True


@dataclass(slots=True, kw_only=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(slots=True, kw_only=True)
class RequestError:
    request_id: str
    message: str
    status: int = 400


@dataclass(slots=True, kw_only=True)
class EngineOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: EngineStats | None = None


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
class StepError:
    rank: int
    message: str


@dataclass(slots=True, kw_only=True)
class EngineReady:
    num_blocks: int
    block_size: int


BODY_TYPES: dict[str, type] = {
    ADD_REQUEST: AddRequest,
    ABORT: AbortRequests,
    OUTPUTS: EngineOutputs,
    WORKER_INFO: WorkerInfo,
    INIT_CACHE: InitCache,
    CACHE_READY: WorkerInfo,
    EXECUTE: SchedulerOutput,
    MODEL_OUTPUT: ModelRunnerOutput,
    STEP_ERROR: StepError,
    ENGINE_READY: EngineReady,
}

__all__ = [
    "BODY_TYPES", "PROTOCOL_VERSION", "AbortRequests", "AddRequest", "EngineOutputs", "EngineReady",
    "InitCache", "RequestError", "StepError", "WorkerInfo", "decode", "decode_body",
    "encode",
]


def decode_body(kind: str, body: bytes) -> object:
    """Decode a frame body by its kind; an unknown kind is an error naming it."""
    try:
        tp = BODY_TYPES[kind]
    except KeyError:
        raise ValueError(f"unknown message kind {kind!r}; known: {', '.join(BODY_TYPES)}") from None
    return decode(tp, body)
