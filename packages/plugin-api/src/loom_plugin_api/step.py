"""The step types: what a worker receives each step, and what the driver worker returns.

The engine core's scheduler builds one ``SchedulerOutput`` per step and sends it to every
worker (a process boundary: these structs hold only plain data and travel as msgpack).
``WorkerBase.execute_model`` takes it; the driver worker (rank 0) returns a
``ModelRunnerOutput``, the others None. ``ModelInput`` is the flat, tensor form of one
step that ``WorkerServices.prepare_inputs`` builds from a ``SchedulerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .attention import AttentionMetadata
from .lora import LoRARequest
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = [
    "ModelInput", "ModelRunnerOutput", "NewRequestData", "PromptLogprobs", "SampledLogprobs", "ScheduledRequest",
    "SchedulerOutput",
]


@dataclass(slots=True, kw_only=True)
class NewRequestData:
    """Sent the first step a request is scheduled (and again after a preemption)."""

    req_id: str
    sampling_params: SamplingParams
    prompt_len: int
    prompt_token_ids: list[int] = field(default_factory=list)
    """For penalties and prompt logprobs (prefix-cached prompt tokens are never scheduled)."""
    eos_token_id: int | None = None
    """The engine's EOS for this request; min_tokens masks it."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model); its id is ``lora_id`` in
    every ``ScheduledRequest`` of the request."""


@dataclass(slots=True, kw_only=True)
class ScheduledRequest:
    """One request's work in this step."""

    req_id: str
    token_ids: list[int]
    """Tokens whose KV is computed this step (a prompt chunk, or the last sampled token)."""
    num_computed_tokens: int
    """Tokens already in the KV cache; the first of ``token_ids`` sits at this position."""
    block_ids: list[int]
    """The request's whole block table."""
    sample: bool
    """True when this step reaches the end of the known tokens, so a token is sampled."""
    num_output_tokens: int = 0
    """Tokens generated so far (for min_tokens)."""
    lora_id: int = 0
    """The ``lora_int_id`` of the request's adapter, 0 for none. A step holds at most
    ``--max-loras`` distinct adapters."""


@dataclass(slots=True, kw_only=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step; workers drop their state."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True, kw_only=True)
class SampledLogprobs:
    """Logprobs of one sampled token: the sampled one and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True, kw_only=True)
class PromptLogprobs:
    """Logprobs of a run of one request's prompt tokens, scored by one prefill chunk.

    Entry ``j`` belongs to prompt token ``start + j``, from the logits of the position before it.
    """

    req_id: str
    start: int
    """Index in the prompt of the first token scored (the first prompt token has no logprob: >= 1)."""
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(slots=True, kw_only=True)
class ModelRunnerOutput:
    req_ids: list[str]
    """Requests that sampled a token this step, in scheduled order."""
    sampled_token_ids: list[int]
    logprobs: list[SampledLogprobs | None] | None = None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    """For requests with ``prompt_logprobs`` whose prompt was (partly) computed this step."""


@dataclass(slots=True)
class ModelInput:
    """One step as tensors on the worker's device (built by ``WorkerServices.prepare_inputs``)."""

    input_ids: torch.Tensor
    """(T,) the step's new tokens, request after request."""
    positions: torch.Tensor
    """(T,) each token's position in its sequence."""
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    """(N,) flat index of the last token of each request that samples this step."""
    sample_req_ids: list[str]
    """The requests that sample this step, in scheduled order."""
    lora_mapping: Any = None
    """The step's adapters, row by row (opaque to a runner; None when no row uses one). The
    runner passes it to ``set_forward_context``, where the model's LoRA layers read it."""
