"""``EngineWorkerServices``: what the engine does for a platform's worker (the contract's
``WorkerServices``), so that no worker imports the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from loom_plugin_api import WorkerServices, set_current_config
from loom_plugin_api.sampling_params import SamplingParams
from loom_plugin_api.step import ModelInput, PromptLogprobs, ScheduledRequest, SchedulerOutput

from .. import platforms
from ..config import LoomConfig
from ..distributed.parallel_state import init_distributed_environment
from ..layers.attention import Attention
from ..layers.sampler import Sampler, SamplingMetadata
from ..lora.manager import LoRAModelManager
from ..model_loader.base import get_model
from . import input_batch, prompt_logprobs

__all__ = ["EngineWorkerServices"]


class EngineWorkerServices(WorkerServices):
    def __init__(self) -> None:
        self.lora: LoRAModelManager | None = None
        """The adapters of the model ``build_model`` built, when the config enables LoRA."""

    def init_distributed(self, config: LoomConfig, rank: int, distributed_init_method: str | None,
                         device: torch.device) -> None:
        # gloo takes no device to bind; backends of devices with their own memory do.
        bind = device if device.type != "cpu" else None
        init_distributed_environment(config.parallel_config.tensor_parallel_size, rank, distributed_init_method,
                                     platforms.current_platform.dist_backend, bind)

    def build_model(self, config: LoomConfig, device: torch.device) -> nn.Module:
        model = get_model(config, device)
        if config.lora_config.enable_lora:
            with set_current_config(config):  # the LoRA ops follow custom_ops like the model's
                self.lora = LoRAModelManager(model, config, device)
        return model

    def attention_layers(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, Attention)]

    def prepare_inputs(self, step: SchedulerOutput, block_size: int, device: torch.device) -> ModelInput:
        inputs = input_batch.prepare_inputs(step, block_size, device)
        if self.lora is not None:
            inputs.lora_mapping = self.lora.prepare(step)
        return inputs

    def new_sampler(self) -> Callable[..., Any]:
        return Sampler()

    def sampling_metadata(self, params: list[SamplingParams], generators: list[torch.Generator | None],
                          num_output_tokens: list[int], eos_token_id: int | None,
                          seen_token_ids: list[list[int]] | None,
                          output_token_ids: list[list[int]] | None) -> Any:
        return SamplingMetadata.from_requests(params, generators, num_output_tokens, eos_token_id, seen_token_ids,
                                              output_token_ids)

    def new_prompt_logprobs_state(self, prompt_token_ids: list[int], num_top: int) -> Any:
        return prompt_logprobs.PromptLogprobsState(prompt_token_ids, num_top)

    def collect_prompt_logprobs(self, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                                hidden_states: torch.Tensor, scheduled: list[ScheduledRequest],
                                states: dict[str, Any]) -> list[PromptLogprobs]:
        return prompt_logprobs.collect_prompt_logprobs(compute_logits, hidden_states, scheduled, states)
