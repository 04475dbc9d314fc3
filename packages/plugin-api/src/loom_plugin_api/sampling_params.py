"""SamplingParams: how to pick each next token, and when to stop.

Part of the step input a worker receives (``NewRequestData.sampling_params``); the engine
validates it when a request arrives, so a worker may trust every field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    seed: int | None = None
    max_tokens: int | None = 16
    """None: until max_model_len."""
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Number of top logprobs to return per generated token (plus the sampled one)."""
    prompt_logprobs: int | None = None
    """Number of top logprobs to return per prompt token (plus the prompt token itself)."""
    repetition_penalty: float = 1.0
    """HF semantics, over prompt and output tokens: > 1 discourages repeats."""
    presence_penalty: float = 0.0
    """OpenAI semantics, over output tokens: subtracted once from a token's logit if it occurs."""
    frequency_penalty: float = 0.0
    """OpenAI semantics, over output tokens: subtracted from a token's logit per occurrence."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer or None, got {value!r}")
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 or a positive integer, got {self.top_k}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            # each of the n completions seeds its own generator with seed + i
            (self.seed is None or -(2**63) <= self.seed <= 2**64 - self.n,
             f"seed must be in [-2**63, 2**64 - n], got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
