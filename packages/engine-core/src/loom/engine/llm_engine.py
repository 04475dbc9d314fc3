"""LLMEngine: requests in, RequestOutputs out.

One ``step()`` is three calls, as in nano-vllm: the scheduler picks the step's work, the
executor runs the model on it, and the output processor turns the sampled tokens into
``RequestOutput``s (see :mod:`.output_processor` for final-only and streamed outputs).
The engine loop (:mod:`.core`) drives it, in the engine-core process and in-process alike.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

from loom_plugin_api import LoRARequest, SamplingParams
from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

from ..config import LoomConfig
from ..logger import init_logger
from ..lora.peft import check_adapter
from ..outputs import RequestOutput
from ..stats import EngineStats
from .block_manager import BlockManager
from .errors import EngineFatalError, EngineStepError
from .executor import Executor
from .output_processor import OutputProcessor
from .request import RequestStatus
from .scheduler import Scheduler

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, config: LoomConfig, executor: Executor, tokenizer: Any | None) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        cache_config = config.cache_config
        cache_config.num_blocks = executor.num_blocks
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.get_vocab_size()
        self.block_manager = BlockManager(
            executor.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        lora = config.lora_config
        self.scheduler = Scheduler(
            config.scheduler_config, cache_config, self.max_model_len, self.block_manager,
            max_loras=lora.max_loras if lora.enable_lora else 0,
        )
        self.lora_requests: dict[int, LoRARequest] = {}
        """Every adapter a request brought, by id (an id names one adapter for the engine's life)."""
        self.broken_loras: dict[int, str] = {}
        """Adapters a worker could not load, by id, with the error: refused from then on."""
        self.output_processor = OutputProcessor(tokenizer, self._stop_request)
        self.eos_token_id = self._find_eos_token_id()
        self._arrival = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.in_flight: deque[tuple[SchedulerOutput, Exception | None]] = deque()
        """Steps started on the workers and not finished yet, oldest first, each with the error its
        dispatch raised (the step then fails when finished)."""
        self.overlap = config.scheduler_config.async_scheduling and executor.overlaps_steps
        """Whether the engine loop schedules a step while the one before runs (see :mod:`.core`)."""
        logger.info(
            "Engine: %d KV-cache blocks of %d tokens (%d tokens, %s), prefix caching %s, eos_token_id=%s, %s",
            executor.num_blocks, cache_config.block_size, executor.num_blocks * cache_config.block_size,
            "K/V in the model's dtype" if cache_config.kv_cache_dtype == "auto" else f"K/V in {cache_config.kv_cache_dtype}",
            "on" if cache_config.enable_prefix_caching else "off", self.eos_token_id,
            "steps overlapped (async scheduling)" if self.overlap else "one step at a time",
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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; ``n > 1`` fans out into children ``f"{request_id}_{i}"``. With
        ``lora_request`` it runs with that adapter (checked here, the first time its id is seen)."""
        self._validate(request_id, prompt_token_ids, sampling_params)
        if lora_request is not None:
            self._check_lora(lora_request)
        n = sampling_params.n
        if any(c in self.scheduler.requests for c in self.output_processor.child_ids(request_id, n)):
            raise ValueError(f"request id {request_id!r} collides with a running request's id")
        children = self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, sampling_params, stream=stream, arrival=self._arrival,
            eos_token_id=self.eos_token_id, lora_request=lora_request,
        )
        try:
            for child in children:
                self.scheduler.add_request(child)
        except BaseException:
            self.abort_request(request_id)  # nothing of a request the engine could not take stays behind
            raise
        self.num_prompt_tokens += len(prompt_token_ids) * n

    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.output_processor:
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
        vocab = self.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in prompt_token_ids):
            bad = [t for t in prompt_token_ids if not (type(t) is int and 0 <= t < vocab)][:5]
            raise ValueError(f"prompt token ids {bad} are outside the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k must be -1, 0 or at most the vocabulary size {vocab}, got {params.top_k}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs without one")

    def _refuse_broken_loras(self, scheduler_output: SchedulerOutput, error: Exception) -> list[str]:
        """A worker could not load the adapter of the request that failed alone: its id is refused
        from now on, and every other request waiting for it ends now (each would fail its step)."""
        if "cannot be loaded" not in str(error):
            return []
        requests = self.scheduler.requests
        broken = {requests[r.req_id].lora_id for r in scheduler_output.scheduled if r.req_id in requests} - {0}
        for lora_id in broken:
            self.broken_loras[lora_id] = str(error)
            logger.error("LoRA adapter id %d is refused from now on: %s", lora_id, error)
        parents = (self.output_processor.parent_of(r.request_id) for r in requests.values() if r.lora_id in broken)
        return [p for p in parents if p is not None]

    def _check_lora(self, request: LoRARequest) -> None:
        lora = self.config.lora_config
        if not lora.enable_lora:
            raise ValueError(f"request names LoRA adapter {request.lora_name!r} but LoRA is off; start the engine "
                             "with --enable-lora (enable_lora=True)")
        broken = self.broken_loras.get(request.lora_int_id)
        if broken is not None:
            raise ValueError(f"{broken}; fix the adapter and load it under a new name")
        known = self.lora_requests.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise ValueError(f"LoRA id {request.lora_int_id} already names adapter {known.lora_name!r} at "
                                 f"{known.lora_path}; give {request.lora_name!r} at {request.lora_path} another id")
            return
        check_adapter(request.lora_path, self.config.model_config.hf_config, lora.max_lora_rank,
                      name=request.lora_name)
        self.lora_requests[request.lora_int_id] = request

    def abort_request(self, request_ids: str | Iterable[str], invalidate_cache: bool = False) -> None:
        """Stop requests (by the ids given to add_request); no output is produced for them."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            child_ids = self.output_processor.abort_request(request_id)
            if child_ids:
                self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED, invalidate_cache)

    def _stop_request(self, child_id: str) -> None:
        self.scheduler.finish_requests([child_id], RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = self.start_step()
        return [] if started is None else self.finish_step(started)

    def start_step(self) -> SchedulerOutput | None:
        """Schedule the next step and start it on the workers (:meth:`Executor.dispatch`); None
        when there is nothing to run. :meth:`finish_step` waits for it and turns its tokens into
        outputs; in between the engine loop reports the previous step's outputs, so the workers
        compute while the front end is told. With :attr:`overlap`, a second step may start before
        the first is finished (its decodes feed the tokens the first samples)."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_req_ids:
            return None
        error = None
        try:
            self.executor.dispatch(scheduler_output)
        except EngineFatalError:
            self.scheduler.discard(scheduler_output)
            raise
        except Exception as e:  # failed like the step itself: finish_step handles it so
            error = e
        self.in_flight.append((scheduler_output, error))
        return scheduler_output

    def can_start_step(self) -> bool:
        """Whether the engine loop may start another step now: none is running, or one is and
        steps overlap (not while failed requests run alone to find the one at fault)."""
        in_flight = self.in_flight
        if not in_flight:
            return True
        # not behind a step whose dispatch failed: the worker never saw the tokens it would sample
        return self.overlap and len(in_flight) < 2 and not self.scheduler.suspects and in_flight[0][1] is None

    def finish_step(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """Wait for the oldest step started, ``scheduler_output``, and turn its tokens into outputs."""
        runner_output = self._execute(scheduler_output)
        if runner_output is None:  # failed, and discarded: its requests run again
            return []
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_generation_tokens += len(updated)
        return self.output_processor.process_outputs(updated)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        started, dispatch_error = self.in_flight.popleft()
        assert started is scheduler_output, "steps finish in the order they started"
        try:
            if dispatch_error is not None:
                raise dispatch_error
            return self.executor.collect(scheduler_output)
        except EngineFatalError:
            raise  # nothing to retry: the engine's process ends
        except Exception as e:
            self._discard_after(scheduler_output)
            parents = (self.output_processor.parent_of(r.req_id) for r in scheduler_output.scheduled)
            failed = sorted({p for p in parents if p is not None})
            if len(failed) > 1:
                # One request may have caused it: the scheduler re-runs each alone to find it,
                # and the others go on (recomputed, as after a preemption).
                logger.warning("Model step of %d requests failed (%s: %s); running each alone to find the one "
                               "that caused it", len(failed), type(e).__name__, e)
                self.scheduler.isolate(r.req_id for r in scheduler_output.scheduled)
                return None
            # The request cannot go on (its KV is incomplete); end it so the engine keeps
            # serving everyone else. The message goes to its client: no other request in it.
            failed = sorted({*failed, *self._refuse_broken_loras(scheduler_output, e)})
            self.abort_request(failed, invalidate_cache=True)
            logger.error("Model step failed for request(s) %s; aborted", failed)
            raise EngineStepError(f"model step failed ({type(e).__name__}: {e})", failed) from e

    def _discard_after(self, failed: SchedulerOutput) -> None:
        """A step failed: its tokens never come, and the steps started after it (overlapped) built
        on them; the worker answers those unrun. They are collected and their requests recomputed;
        then the workers run steps again."""
        self.scheduler.discard(failed)
        while self.in_flight:
            later, dispatch_error = self.in_flight.popleft()
            if dispatch_error is None:
                try:
                    self.executor.collect(later)
                except EngineFatalError:
                    raise
                except Exception:
                    pass  # the worker's answer: unrun after a failed step
            self.scheduler.discard(later, preempt=True)
        self.executor.resume()

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
