"""What the engine hands back to callers: one RequestOutput per request, n completions each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token at one position, its rank, and its text."""

    logprob: float
    rank: int | None = None
    """1 is the most likely token."""
    decoded_token: str | None = None


@dataclass(slots=True, kw_only=True)
class CompletionOutput:
    """One of a request's ``n`` completions.

    In a streamed request each output is a delta: ``text``, ``token_ids`` and ``logprobs``
    hold only what is new since the previous output of this completion.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    """Sum of the sampled tokens' logprobs; None unless logprobs were requested."""
    logprobs: list[dict[int, Logprob]] | None = None
    """Per generated token: the sampled token and the top alternatives."""
    finish_reason: str | None = None
    """``stop``, ``length`` or ``abort``; None while the completion runs."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (of the first completion)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token (None for the first,
    which nothing precedes), the prompt token and its top alternatives. In a stream, only the
    first output carries it."""


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One delta that says what ``first`` and then ``then`` say (same request, in order).

    A stream whose reader fell behind takes every delta waiting for it as one: under load
    the front end then sends one event per request per read instead of one per token.
    """
    merged = {c.index: c for c in first.outputs}
    for c in then.outputs:
        old = merged.get(c.index)
        if old is None:
            merged[c.index] = c
            continue
        logprobs = old.logprobs
        if c.logprobs is not None:
            logprobs = (logprobs or []) + c.logprobs
        merged[c.index] = CompletionOutput(
            index=c.index, text=old.text + c.text, token_ids=[*old.token_ids, *c.token_ids],
            cumulative_logprob=c.cumulative_logprob, logprobs=logprobs,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        )
    return RequestOutput(
        request_id=first.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
        outputs=list(merged.values()), finished=then.finished, num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=first.prompt_logprobs,
    )
