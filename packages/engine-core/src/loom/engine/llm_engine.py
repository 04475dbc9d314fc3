"""LLMEngine: requests in, RequestOutputs out; one ``step()`` = schedule, run the model, update.

The executor is any object with ``execute_model(SchedulerOutput) -> ModelRunnerOutput``,
``num_blocks`` (the KV-cache blocks its workers allocated) and ``shutdown()``.

Outputs come in two kinds, chosen per request at ``add_request``:

* final only (the default): one RequestOutput when all of its ``n`` completions end;
  text is decoded once at the end unless stop strings need it token by token.
* ``stream=True``: every step that gives a completion a token yields a RequestOutput
  holding deltas (the new text, token ids and logprobs) of the completions that moved;
  the last one has ``finished=True``. This is what an OpenAI streaming response sends.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import LoomConfig
from ..logger import init_logger
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import SamplingParams
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer, decode_final
from .request import Request, RequestStatus
from .scheduler import Scheduler
from .scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)


class EngineStepError(RuntimeError):
    """A model step raised; the requests of that step were aborted, the engine goes on."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class Executor(Protocol):
    num_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True, kw_only=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of KV-cache blocks held by requests."""
    prefix_cache_hit_rate: float
    """Prompt tokens found in the prefix cache / prompt tokens looked up, since start."""
    num_prompt_tokens: int
    """Prompt tokens of the requests added, since start."""
    num_generation_tokens: int
    """Tokens generated since start."""
    num_preemptions: int


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


class LLMEngine:
    def __init__(self, config: LoomConfig, executor: Executor, tokenizer: Any | None) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        cache_config = config.cache_config
        cache_config.num_blocks = executor.num_blocks
        self.max_model_len = config.model_config.max_model_len
        self.block_manager = BlockManager(
            executor.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler_config, cache_config, self.max_model_len, self.block_manager
        )
        self.eos_token_id = self._find_eos_token_id()
        self._groups: dict[str, _Group] = {}
        self._children: dict[str, _ChildState] = {}
        self._arrival = itertools.count()
        self._token_text: dict[int, str] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        logger.info(
            "Engine: %d KV-cache blocks of %d tokens (%d tokens), prefix caching %s, eos_token_id=%s",
            executor.num_blocks, cache_config.block_size, executor.num_blocks * cache_config.block_size,
            "on" if cache_config.enable_prefix_caching else "off", self.eos_token_id,
        )

    def _find_eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            hf_config = getattr(self.config.model_config, "hf_config", None)
            eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return eos

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        stream: bool = False,
    ) -> None:
        """Queue a request; ``n > 1`` fans out into children ``f"{request_id}_{i}"``."""
        self._validate(request_id, prompt_token_ids, sampling_params)
        params = sampling_params
        n = params.n
        children: list[Request] = []
        group = _Group(request_id, prompt, prompt_token_ids, stream, children)
        for i in range(n):
            if n == 1:
                child_id, child_params = request_id, params
            else:
                child_id = f"{request_id}_{i}"
                seed = params.seed + i if params.seed is not None else None
                child_params = dataclasses.replace(params, n=1, seed=seed)
            children.append(Request(
                child_id, prompt, prompt_token_ids, child_params, next(self._arrival),
                eos_token_id=self.eos_token_id, parent_id=request_id, index=i,
            ))
        if any(c.request_id in self.scheduler.requests for c in children):
            raise ValueError(f"request id {request_id!r} collides with a running request's id")
        # Requests with neither stop strings nor streaming decode once, at the end.
        incremental = self.tokenizer is not None and (stream or bool(params.stop))
        for child in children:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params) \
                if incremental else None
            self._children[child.request_id] = _ChildState(group, detok)
            self.scheduler.add_request(child)
        self._groups[request_id] = group
        self.num_prompt_tokens += len(prompt_token_ids) * n

    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        num = len(prompt_token_ids)
        if num == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num > self.max_model_len:
            raise ValueError(
                f"prompt of {num} tokens exceeds max_model_len {self.max_model_len}; "
                "shorten it or raise --max-model-len"
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if num + 1 > capacity:
            raise ValueError(
                f"prompt of {num} tokens can never fit the KV cache of {capacity} tokens "
                f"({self.block_manager.num_blocks} blocks); shorten it or give the cache more memory"
            )
        sched = self.config.scheduler_config
        if not sched.enable_chunked_prefill and num > sched.max_num_batched_tokens:
            raise ValueError(
                f"prompt of {num} tokens exceeds --max-num-batched-tokens {sched.max_num_batched_tokens} "
                "with chunked prefill off; shorten it, raise the budget or enable chunked prefill"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs without one")

    def abort_request(self, request_ids: str | Iterable[str], invalidate_cache: bool = False) -> None:
        """Stop requests (by the ids given to add_request); no output is produced for them."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            child_ids = [c.request_id for c in group.children]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED, invalidate_cache)
            for child_id in child_ids:
                self._children.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_req_ids:
            return []
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as e:
            # The step's requests cannot go on (their KV is incomplete); end them so the
            # engine keeps serving everyone else, and say which ones were lost.
            failed = {self._children[r.req_id].group.request_id for r in scheduler_output.scheduled
                      if r.req_id in self._children}
            self.abort_request(failed, invalidate_cache=True)
            raise EngineStepError(
                f"model step failed ({type(e).__name__}: {e}); aborted requests {sorted(failed)}", sorted(failed)
            ) from e
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_generation_tokens += len(updated)
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
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
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

    # ---- stats and shutdown -----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.block_manager.usage,
            prefix_cache_hit_rate=self.block_manager.prefix_hit_rate,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
