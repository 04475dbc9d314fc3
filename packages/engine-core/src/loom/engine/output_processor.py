"""Output processing: the engine's sampled tokens become what callers read.

The ``OutputProcessor`` owns the user's view of every request: its ``n`` children, their
text (decoded incrementally when streaming or watching stop strings, else once at the end),
logprob entries, and per request either one final RequestOutput when all ``n`` end, or
(``stream=True``) a delta of the completions that moved at each step, the last ``finished``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loom_plugin_api import LoRARequest, SamplingParams

from ..outputs import CompletionOutput, Logprob, RequestOutput
from .detokenizer import IncrementalDetokenizer, decode_final
from .request import Request, RequestStatus


@dataclass(slots=True)
class _Group:
    """One user request: its n child Requests and what has been reported of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool
    children: list[Request]
    done: dict[int, CompletionOutput] = field(default_factory=dict)
    """Final outputs of finished children, by index (final-only mode)."""
    num_finished: int = 0
    prompt_logprobs_sent: bool = False


@dataclass(slots=True)
class _ChildState:
    group: _Group
    detokenizer: IncrementalDetokenizer | None
    """None: decode once at the end."""
    num_sent_tokens: int = 0
    """Tokens (and logprobs) already sent in streamed deltas."""


class OutputProcessor:
    """Requests' groups and text. ``stop_request(child_id)`` ends a child that hit a stop string."""

    def __init__(self, tokenizer: Any | None, stop_request: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self._stop_request = stop_request
        self._groups: dict[str, _Group] = {}
        self._children: dict[str, _ChildState] = {}
        self._token_text: dict[int, str] = {}

    # ---- requests ---------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    @staticmethod
    def child_ids(request_id: str, n: int) -> list[str]:
        """The ids of a request's ``n`` completions: its own id alone, or ``f"{request_id}_{i}"``."""
        return [request_id] if n == 1 else [f"{request_id}_{i}" for i in range(n)]

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, *,
        stream: bool, arrival: Iterator[int], eos_token_id: int | None, lora_request: LoRARequest | None = None,
    ) -> list[Request]:
        """The request's children (``n > 1`` fans out into ``f"{request_id}_{i}"``), registered here."""
        n = params.n
        children: list[Request] = []
        group = _Group(request_id, prompt, prompt_token_ids, stream, children)
        for i, child_id in enumerate(self.child_ids(request_id, n)):
            if n == 1:
                child_params = params
            else:
                seed = params.seed + i if params.seed is not None else None
                child_params = dataclasses.replace(params, n=1, seed=seed)
            children.append(Request(
                child_id, prompt, prompt_token_ids, child_params, next(arrival),
                eos_token_id=eos_token_id, parent_id=request_id, index=i, lora_request=lora_request,
            ))
        # Requests with neither stop strings nor streaming decode once, at the end.
        incremental = self.tokenizer is not None and (stream or bool(params.stop))
        for child in children:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params) \
                if incremental else None
            self._children[child.request_id] = _ChildState(group, detok)
        self._groups[request_id] = group
        return children

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its children's ids (empty when it is unknown)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        child_ids = [c.request_id for c in group.children]
        for child_id in child_ids:
            self._children.pop(child_id, None)
        return child_ids

    def parent_of(self, child_id: str) -> str | None:
        state = self._children.get(child_id)
        return None if state is None else state.group.request_id

    # ---- one step ---------------------------------------------------------------------------
    def process_outputs(self, updated: list[Request]) -> list[RequestOutput]:
        """The RequestOutputs of the requests a step gave a token (at most one per user request)."""
        touched: dict[str, list[Request]] = {}
        for req in updated:
            state = self._children.get(req.request_id)
            if state is None:
                continue
            if state.detokenizer is not None:
                self._detokenize(req, state.detokenizer)
            touched.setdefault(req.parent_id, []).append(req)
        outputs = []
        for parent_id, reqs in touched.items():
            out = self._make_output(self._groups[parent_id], reqs)
            if out is not None:
                outputs.append(out)
        return outputs

    def _detokenize(self, req: Request, detokenizer: IncrementalDetokenizer) -> None:
        stop_terminated = req.status == RequestStatus.FINISHED_STOPPED
        check_stop = req.num_output_tokens >= req.sampling_params.min_tokens
        stop = detokenizer.update(req.output_token_ids[-1], stop_terminated, check_stop)
        if stop is None:
            return
        if req.is_finished:  # by length in the same token: the stop string is the better reason
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self._stop_request(req.request_id)
        req.stop_reason = stop

    def _make_output(self, group: _Group, reqs: list[Request]) -> RequestOutput | None:
        completions = []
        for req in reqs:
            finished = req.is_finished
            if finished:
                group.num_finished += 1
            if group.stream:
                completions.append(self._delta_completion(req, finished))
            elif finished:
                group.done[req.index] = self._final_completion(req)
        all_done = group.num_finished == len(group.children)
        if all_done:
            del self._groups[group.request_id]
            for child in group.children:
                del self._children[child.request_id]
        if not group.stream:
            if not all_done:
                return None
            completions = [group.done[i] for i in range(len(group.children))]
        prompt_logprobs = None
        if not group.prompt_logprobs_sent:
            # Any child that got a token has its whole prompt scored; the first output carries it.
            prompt_logprobs = self._convert_prompt_logprobs(reqs[0])
            group.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=completions, finished=all_done, num_cached_tokens=group.children[0].num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def _final_completion(self, req: Request) -> CompletionOutput:
        state = self._children[req.request_id]
        if state.detokenizer is not None:
            text = state.detokenizer.output_text
        elif self.tokenizer is not None:
            text = decode_final(
                self.tokenizer, req.prompt_token_ids, req.output_token_ids, req.sampling_params,
                stop_terminated=req.status == RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str),
            )
        else:
            text = ""
        return CompletionOutput(
            index=req.index, text=text, token_ids=req.output_token_ids,
            cumulative_logprob=req.cumulative_logprob if req.sampling_params.logprobs is not None else None,
            logprobs=self._convert_logprobs(req, 0), finish_reason=req.finish_reason, stop_reason=req.stop_reason,
        )

    def _delta_completion(self, req: Request, finished: bool) -> CompletionOutput:
        state = self._children[req.request_id]
        start = state.num_sent_tokens
        state.num_sent_tokens = req.num_output_tokens
        text = state.detokenizer.get_next_output_text(finished, delta=True) if state.detokenizer else ""
        return CompletionOutput(
            index=req.index, text=text, token_ids=req.output_token_ids[start:],
            cumulative_logprob=req.cumulative_logprob if req.sampling_params.logprobs is not None else None,
            logprobs=self._convert_logprobs(req, start),
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
        )

    # ---- logprobs ---------------------------------------------------------------------------
    def _convert_logprobs(self, req: Request, start: int) -> list[dict[int, Logprob]] | None:
        if req.sampling_params.logprobs is None:
            return None
        return [self._logprob_entry(lp.token_id, lp.logprob, lp.rank, lp.top_token_ids, lp.top_logprobs)
                for lp in req.logprobs[start:]]

    def _convert_prompt_logprobs(self, req: Request) -> list[dict[int, Logprob] | None] | None:
        if req.sampling_params.prompt_logprobs is None:
            return None
        prompt = req.prompt_token_ids
        out: list[dict[int, Logprob] | None] = [None]  # nothing precedes the first token
        for chunk in req.prompt_logprobs:
            if chunk.start != len(out):
                raise RuntimeError(f"prompt logprobs of {req.request_id!r} arrived out of order: chunk at "
                                   f"{chunk.start}, expected {len(out)}")
            for j, (value, rank, top_ids, top_values) in enumerate(zip(
                    chunk.logprobs, chunk.ranks, chunk.top_token_ids, chunk.top_logprobs)):
                out.append(self._logprob_entry(prompt[chunk.start + j], value, rank, top_ids, top_values))
        return out

    def _logprob_entry(self, token_id: int, logprob: float, rank: int, top_token_ids: list[int],
                       top_logprobs: list[float]) -> dict[int, Logprob]:
        # The scored token first, then the top alternatives (rank = position + 1).
        entry = {token_id: Logprob(logprob, rank, self._token_text_of(token_id))}
        for top_rank, (tid, value) in enumerate(zip(top_token_ids, top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, top_rank, self._token_text_of(tid))
        return entry

    def _token_text_of(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text
