"""Scheduler: continuous batching over the KV-cache block pool (vLLM v1's, small).

Each step: running requests first, in arrival order (a decode is one token; a request
still prefilling gets its next chunk), then waiting requests in arrival order, all under
the token budget ``max_num_batched_tokens`` and ``max_num_seqs`` running requests.
Prefill and decode share one step. When blocks run out, the most recently arrived
running request is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed from scratch (prompt and generated tokens alike).

With LoRA, a step holds at most ``max_loras`` distinct adapters: a waiting request whose
adapter would be one too many is passed over (it keeps its place in the queue) until the running
requests of some adapter have all ended. Behind it, base-model requests may start meanwhile, but
no request with an adapter, not even one of an adapter already running: otherwise a steady stream
of one adapter's requests would keep the passed-over one waiting for ever.

When a model step of several requests fails, one of them may have caused it (parameters
that validation let through, a kernel bug met by one input): :meth:`Scheduler.isolate`
preempts every running request and marks the failed step's ones as suspects. Each suspect
then runs alone, in steps of its own, until it has sampled a token; a suspect whose own
step fails is the cause and ends with the error, the others go on as if preempted.

Overlapped steps (``loom serve`` with one worker, see docs/decisions.md): the next step may be
scheduled while the previous one runs, before its tokens are known. A request the running step
samples counts that token in ``num_pending``; its next decode feeds ``PENDING_TOKEN``, which the
worker replaces with the token it sampled for the request (:mod:`loom.worker.proc`). A request
whose pending token reaches its length limit is not scheduled again; one that stops on the pending
token (EOS, a stop token or string) has computed one token too many, which is dropped.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from loom_plugin_api.step import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput

from ..config import CacheConfig, SchedulerConfig
from ..ipc.messages import PENDING_TOKEN
from ..logger import init_logger
from .block_manager import BlockManager
from .request import Request, RequestStatus

logger = init_logger(__name__)


def _arrival(request: Request) -> int:
    return request.arrival


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        block_manager: BlockManager,
        max_loras: int = 0,
    ) -> None:
        self.max_loras = max_loras
        """Distinct adapters a step may hold (0: LoRA is off)."""
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        # A sequence can never outgrow the whole cache; past that it ends as "length".
        self.max_len = min(max_model_len, block_manager.num_blocks * block_manager.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Kept sorted by arrival, so the tail is the one to preempt."""
        self.requests: dict[str, Request] = {}
        """Every unfinished request, waiting or running."""
        self.finished_req_ids: list[str] = []
        """Freed since the last schedule(); the next SchedulerOutput tells the workers."""
        self.num_preemptions = 0
        self.suspects: set[str] = set()
        """Requests of a failed step that must run alone until they sample (see isolate)."""
        self.isolated: Request | None = None
        """The suspect running alone now."""
        self.in_flight: deque[tuple[SchedulerOutput, dict[str, Request]]] = deque()
        """Each step scheduled and not yet updated or discarded, with its requests: a step's tokens
        (and prompt logprobs) go to the request it was scheduled for, even if its id was reused since."""

    # ---- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, invalidate_cache: bool = False
    ) -> list[Request]:
        """End requests from outside the step (abort, or a stop string the engine found).

        ``invalidate_cache``: the step that scheduled them failed; blocks it was to fill
        must not serve later prefix-cache hits.
        """
        finished = []
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req, invalidate_cache)
            finished.append(req)
        return finished

    def _free(self, request: Request, invalidate_cache: bool = False) -> None:
        self.block_manager.free(request, invalidate_cache)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)
        self.suspects.discard(request.request_id)
        if self.isolated is request:
            self.isolated = None

    def isolate(self, req_ids: Iterable[str]) -> None:
        """A step of ``req_ids`` failed: run each of them alone until it samples, to find the one at fault.

        Every running request is preempted (the failed step's blocks may be half written, so
        they are dropped from the prefix cache too) and recomputed when it runs again.
        """
        suspects = [r for r in req_ids if r in self.requests]
        for req in sorted(self.running, key=_arrival, reverse=True):
            self._preempt(req, invalidate=req.request_id in suspects)
        self.running = []
        self.isolated = None
        self.suspects.update(suspects)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.suspects:
            return self._schedule_alone()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequestData] = []
        running = self.running
        num_preemptions = self.num_preemptions

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.num_pending and self._ends_on_pending(req):
                i += 1  # the token in flight is its last: nothing more to compute
                continue
            # 1 for a decode; the rest of the prompt for a request in chunked prefill.
            num_new = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, num_new):
                break  # req itself was preempted, and it was the last one running
            scheduled.append(self._schedule(req, num_new))
            budget -= num_new
            i += 1
        preempted = self.num_preemptions > num_preemptions

        # New work waits while requests are being preempted: admitting it would only take
        # the blocks the preempted ones need back.
        loras = {r.lora_id for r in running if r.lora_id}
        passed_over: list[Request] = []
        while not preempted and self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.lora_id and (passed_over or req.lora_id not in loras and len(loras) >= self.max_loras):
                # one adapter too many for this step; and behind a request passed over so, no adapter
                # request starts (the running adapters' requests must drain for it to get its turn)
                passed_over.append(self.waiting.popleft())
                continue
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(req)
            num_new = req.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break  # FCFS: it waits for a step with room; later requests wait behind it
                num_new = budget
            if not self.block_manager.allocate_slots(req, num_new, computed_blocks):
                break
            self.waiting.popleft()
            new_requests.append(self._admit(req, num_cached))
            scheduled.append(self._schedule(req, num_new))
            budget -= num_new
            if req.lora_id:
                loras.add(req.lora_id)
        self.waiting.extendleft(reversed(passed_over))

        return self._output(new_requests, scheduled)

    def _output(self, new_requests: list[NewRequestData], scheduled: list[ScheduledRequest]) -> SchedulerOutput:
        finished, self.finished_req_ids = self.finished_req_ids, []
        out = SchedulerOutput(new_requests=new_requests, scheduled=scheduled, finished_req_ids=finished)
        if scheduled:  # a step of no request samples nothing: no record
            requests = self.requests
            self.in_flight.append((out, {r.req_id: requests[r.req_id] for r in scheduled}))
        return out

    def _ends_on_pending(self, req: Request) -> bool:
        """Whether the request reaches a length limit with its tokens in flight."""
        return req.num_output_tokens + req.num_pending >= req.max_tokens or req.num_tokens + req.num_pending >= self.max_len

    def _admit(self, req: Request, num_cached: int) -> NewRequestData:
        """A waiting request starts running (blocks allocated); what the workers are told of it."""
        if req.status == RequestStatus.WAITING:
            req.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        bisect.insort(self.running, req, key=_arrival)
        # Sent again after a preemption: the workers start the request over.
        return NewRequestData(
            req_id=req.request_id, sampling_params=req.sampling_params, prompt_len=req.num_prompt_tokens,
            prompt_token_ids=req.prompt_token_ids, eos_token_id=req.eos_token_id, lora_request=req.lora_request,
        )

    def _schedule_alone(self) -> SchedulerOutput:
        """One suspect in the step, nothing else (see isolate)."""
        new_requests = []
        req = self.isolated
        if req is None:
            req = next((r for r in self.waiting if r.request_id in self.suspects), None)
            if req is None:  # cannot happen: suspects wait until they run alone; never stall on it
                logger.error("suspects %s are not waiting; scheduling them normally", sorted(self.suspects))
                self.suspects.clear()
                return self.schedule()
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, self.max_num_batched_tokens)
            self._make_room(req, num_new, computed_blocks)
            self.waiting.remove(req)
            new_requests.append(self._admit(req, num_cached))
            self.isolated = req
        else:
            num_new = min(req.num_tokens - req.num_computed_tokens, self.max_num_batched_tokens)
            self._make_room(req, num_new)
        return self._output(new_requests, [self._schedule(req, num_new)])

    def _make_room(self, req: Request, num_new: int, computed_blocks: list | None = None) -> None:
        """Allocate for the isolated request, preempting the others that ran alone before it."""
        args = () if computed_blocks is None else (computed_blocks,)
        while not self.block_manager.allocate_slots(req, num_new, *args):
            victim = next(r for r in reversed(self.running) if r is not req)  # alone, any request fits
            self.running.remove(victim)
            self._preempt(victim)

    def _allocate_or_preempt(self, req: Request, num_new: int) -> bool:
        """Allocate for a running request, preempting from the tail until it fits.

        False when ``req`` itself had to go. The tail is never a request already scheduled
        this step: those sit before ``req`` in ``running``.
        """
        while not self.block_manager.allocate_slots(req, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, invalidate: bool = False) -> None:
        self.block_manager.free(req, invalidate)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)

    def _schedule(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + num_new
        # Advanced now, as vLLM does: the KV of these tokens is being computed this step.
        req.num_computed_tokens = end
        known = req.num_tokens
        token_ids = req.all_token_ids[start:end]
        if end > known:  # the token a step in flight samples: the worker fills it in
            token_ids.extend([PENDING_TOKEN] * (end - max(start, known)))
        pending = req.num_pending
        sample = end == known + pending
        if sample:
            req.num_pending = pending + 1
        return ScheduledRequest(
            req_id=req.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_ids=req.block_ids,
            sample=sample,
            num_output_tokens=req.num_output_tokens + pending,
            lora_id=req.lora_id,
        )

    def _take(self, scheduler_output: SchedulerOutput) -> dict[str, Request]:
        """The requests of ``scheduler_output``, as recorded when it was scheduled (steps are updated
        or discarded in the order they were scheduled); the tokens it samples are in (or dropped)."""
        if not scheduler_output.scheduled:
            return {}
        out, requests = self.in_flight.popleft()
        assert out is scheduler_output, "steps are updated or discarded in the order they were scheduled"
        for r in out.scheduled:
            if r.sample:
                requests[r.req_id].num_pending -= 1
        return requests

    def discard(self, scheduler_output: SchedulerOutput, preempt: bool = False) -> None:
        """A step that failed or was answered unrun: its tokens will never come, and the K/V it was
        to write never was. ``preempt``: its requests that still run go back to waiting, to be
        recomputed. Blocks it was to fill leave the prefix cache where no request holds them now
        (a request preempted, stopped or aborted while the step was out freed them as written);
        the finished ids it carried go to the workers again."""
        requests = self._take(scheduler_output)
        self.finished_req_ids[:0] = scheduler_output.finished_req_ids  # a worker may not have seen them
        bs = self.block_size
        for r in scheduler_output.scheduled:
            end = r.num_computed_tokens + len(r.token_ids)
            self.block_manager.forget(r.block_ids[r.num_computed_tokens // bs:-(-end // bs)])
        if not preempt:
            return
        victims = [req for req in requests.values() if req.status == RequestStatus.RUNNING]
        for req in sorted(victims, key=_arrival, reverse=True):
            self.running.remove(req)
            self._preempt(req, invalidate=True)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Append the sampled tokens (and prompt logprobs) and check the stop conditions.

        Returns the requests that got a token this step, finished ones included (their
        blocks are already freed). Stop strings are the engine's: it needs the text.
        """
        updated: list[Request] = []
        any_finished = False
        logprobs = model_runner_output.logprobs
        requests = self._take(scheduler_output)
        for chunk in model_runner_output.prompt_logprobs:
            req = requests.get(chunk.req_id)
            if req is not None and not req.is_finished:
                req.prompt_logprobs.append(chunk)
        for k, req_id in enumerate(model_runner_output.req_ids):
            req = requests.get(req_id)
            if req is None or req.is_finished:  # aborted or stopped while the step ran
                continue
            token_id = model_runner_output.sampled_token_ids[k]
            if req is self.isolated:  # it ran alone and sampled: not the one at fault
                self.suspects.discard(req_id)
                self.isolated = None
            req.append_output_token(token_id)
            if req.num_computed_tokens >= req.num_tokens:  # the token's own KV is computed: a step fed it pending
                self.block_manager.cache_computed(req)
            if logprobs is not None:
                lp = logprobs[k]
                if lp is not None:
                    req.logprobs.append(lp)
                    req.cumulative_logprob += lp.logprob
            waiting = req.status != RequestStatus.RUNNING  # preempted while the step ran
            if self._check_stop(req, token_id):
                if waiting:
                    self.waiting.remove(req)
                self._free(req)
                any_finished = True
            updated.append(req)
        if any_finished:
            self.running = [r for r in self.running if not r.status.is_finished]
        return updated

    def _check_stop(self, req: Request, token_id: int) -> bool:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token_id == req.eos_token_id and not params.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token_id
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
