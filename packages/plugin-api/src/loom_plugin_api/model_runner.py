"""``ModelRunner``: the reference step of a worker, on any torch device.

Owns the model, binds the KV cache of its attention layers, keeps each request's
sampling state (seeded generators, the tokens penalties need) across steps, and runs one
step: ``services.prepare_inputs``, the forward pass under ``set_forward_context``, prompt
logprobs, then sampling. The CPU worker uses it as it is; a platform's runner may subclass
it and replace ``run_model`` (e.g. to replay recorded graphs) or ``initialize_cache``.
Everything engine-specific comes through the worker's ``WorkerServices``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .context import set_forward_context
from .sampling_params import SamplingParams
from .step import ModelInput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from .config import LoomConfigView
    from .worker import WorkerServices

__all__ = ["ModelRunner"]


@dataclass(slots=True)
class _RequestState:
    sampling_params: SamplingParams
    generator: torch.Generator | None
    seen_token_ids: list[int] | None = field(default=None)
    """Prompt and generated tokens, kept only when a repetition penalty needs them."""
    output_token_ids: list[int] | None = field(default=None)
    """Generated tokens, kept only when a frequency or presence penalty needs them."""


class ModelRunner:
    def __init__(self, config: LoomConfigView, model: nn.Module, device: torch.device,
                 services: WorkerServices) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.services = services
        self.sampler = services.new_sampler()
        self.requests: dict[str, _RequestState] = {}
        self.prompt_logprobs: dict[str, Any] = {}
        """Requests whose prompt logprobs are still being collected."""
        self.eos_token_id: int | None = None  # the engine's, sent with each new request
        self.attn_layers = services.attention_layers(model)
        # Models may offer argmax without materializing the logits (the common greedy case).
        self._fused_greedy = getattr(model, "compute_greedy_token_ids", None)

    # ---- KV cache ---------------------------------------------------------------------
    def _kv_cache_dtype(self, layer: Any) -> torch.dtype:
        return layer.attn_backend.get_kv_cache_dtype(self.config.model_config.torch_dtype,
                                                     self.config.cache_config.kv_cache_dtype)

    def kv_cache_block_bytes(self) -> int:
        block_size = self.config.cache_config.block_size
        total = 0
        for layer in self.attn_layers:
            shape = layer.attn_backend.get_kv_cache_shape(1, block_size, layer.num_kv_heads, layer.head_size)
            total += math.prod(shape) * torch.empty(0, dtype=self._kv_cache_dtype(layer)).element_size()
        return total

    def initialize_cache(self, num_blocks: int) -> None:
        block_size = self.config.cache_config.block_size
        for layer in self.attn_layers:
            shape = layer.attn_backend.get_kv_cache_shape(
                num_blocks, block_size, layer.num_kv_heads, layer.head_size
            )
            # Unwritten slots are never read: the backend only gathers positions in context.
            layer.kv_cache = torch.empty(shape, dtype=self._kv_cache_dtype(layer), device=self.device)

    # ---- one step -----------------------------------------------------------------------
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs.pop(req_id, None)
        for new in scheduler_output.new_requests:
            if new.req_id in self.requests:
                # Resumed after a preemption: keep the seeded generator where it was, so the
                # output does not depend on memory pressure.
                continue
            self.eos_token_id = new.eos_token_id
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.is_greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            seen = list(new.prompt_token_ids) if params.repetition_penalty != 1.0 else None
            output = [] if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0 else None
            self.requests[new.req_id] = _RequestState(params, generator, seen, output)
            if params.prompt_logprobs is not None and len(new.prompt_token_ids) > 1:
                self.prompt_logprobs[new.req_id] = self.services.new_prompt_logprobs_state(
                    list(new.prompt_token_ids), params.prompt_logprobs)

    def run_model(self, inputs: ModelInput) -> torch.Tensor:
        """The forward pass of one step: hidden states ``(T, hidden)``. A platform's runner
        may replace it (e.g. to replay a recorded graph; a step with ``inputs.lora_mapping`` must
        then pass it to ``set_forward_context`` too)."""
        with set_forward_context(inputs.attn_metadata, inputs.lora_mapping):
            return self.model(inputs.input_ids, inputs.positions)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self.services.prepare_inputs(scheduler_output, self.config.cache_config.block_size, self.device)
        hidden_states = self.run_model(inputs)
        prompt_logprobs = self.services.collect_prompt_logprobs(
            self.model.compute_logits, hidden_states, scheduler_output.scheduled, self.prompt_logprobs,
        ) if self.prompt_logprobs else []
        if not inputs.sample_req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=prompt_logprobs)
        hidden = hidden_states[inputs.logits_indices]
        by_id = {r.req_id: r for r in scheduler_output.scheduled}
        states = [self.requests[i] for i in inputs.sample_req_ids]
        metadata = self.services.sampling_metadata(
            [s.sampling_params for s in states],
            [s.generator for s in states],
            [by_id[i].num_output_tokens for i in inputs.sample_req_ids],
            self.eos_token_id,
            [s.seen_token_ids or [] for s in states] if any(s.seen_token_ids is not None for s in states)
            else None,
            [s.output_token_ids or [] for s in states] if any(s.output_token_ids is not None for s in states)
            else None,
        )
        if metadata.all_greedy and metadata.no_processing and self._fused_greedy is not None:
            token_ids, logprobs = self._fused_greedy(hidden).tolist(), None
        else:
            token_ids, logprobs = self.sampler(self.model.compute_logits(hidden).float(), metadata)
        for state, token_id in zip(states, token_ids):
            if state.seen_token_ids is not None:
                state.seen_token_ids.append(token_id)
            if state.output_token_ids is not None:
                state.output_token_ids.append(token_id)
        return ModelRunnerOutput(req_ids=inputs.sample_req_ids, sampled_token_ids=token_ids, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs)
