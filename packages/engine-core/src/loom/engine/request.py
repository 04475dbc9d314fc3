"""Request: the scheduler's view of one sequence being generated."""

from __future__ import annotations

import enum

from loom_plugin_api import LoRARequest, SamplingParams
from loom_plugin_api.step import PromptLogprobs, SampledLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status from here on is final; is_finished relies on that order.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence. A prompt with ``n > 1`` becomes n Requests (``f"{id}_{i}"``).

    ``all_token_ids`` is the prompt followed by the generated tokens, kept as one list so
    the scheduler slices chunks out of it without concatenating every step.
    """

    __slots__ = (
        "request_id", "prompt", "prompt_token_ids", "sampling_params", "arrival", "eos_token_id",
        "parent_id", "index", "status", "all_token_ids", "output_token_ids", "max_tokens",
        "num_computed_tokens", "num_cached_tokens", "block_ids", "block_hashes", "num_cached_blocks",
        "logprobs", "cumulative_logprob", "stop_reason", "prompt_logprobs", "lora_request", "lora_id",
        "num_pending",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival: int,
        eos_token_id: int | None = None,
        parent_id: str | None = None,
        index: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival = arrival
        """Position in arrival order; the scheduler serves and preempts by it."""
        self.eos_token_id = eos_token_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        """Which of the parent's n completions this is."""
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        mt = sampling_params.max_tokens
        self.max_tokens: int = mt if mt is not None else 1 << 62  # None: the length cap decides
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (or is being computed in the steps scheduled so far); with
        steps overlapped it may count tokens not sampled yet (``num_pending``)."""
        self.num_pending = 0
        """Tokens this request samples in steps scheduled but not yet collected (overlapped steps:
        the next step is scheduled before the previous one's tokens are known)."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache the first time it was scheduled."""
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        """Chained hashes of the full blocks of all_token_ids, computed once each (prefix cache)."""
        self.num_cached_blocks = 0
        """Leading entries of block_ids registered in the prefix cache."""
        self.logprobs: list[SampledLogprobs] = []
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list[PromptLogprobs] = []
        """Prompt logprobs as the prefill chunks computed them, in prompt order."""
        self.lora_request = lora_request
        self.lora_id = 0 if lora_request is None else lora_request.lora_int_id
        """The adapter's id, 0 for the base model: the scheduler counts adapters by it, the
        prefix cache keys blocks by it."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
