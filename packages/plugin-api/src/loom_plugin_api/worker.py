"""Workers: the process-side owner of a device, the model and its KV cache.

A platform names its worker class (a qualified name) in
``config.parallel_config.worker_cls`` from ``check_and_update_config``. In each worker
process (one per tensor-parallel rank; in ``loom.LLM`` with one rank, the engine's own
process) the engine resolves it by name and drives this lifecycle, in order:

==============================  ============================================================
``__init__(config, ...)``       once; ``services`` is the engine's ``WorkerServices``
``init_device()``               once: pick the device, seed it, join the tensor-parallel group
``load_model()``                once: build the model and load this rank's weights
(runtime)                       ``Platform.update_block_size_for_backend(config)``
``determine_available_memory``  once: bytes the KV cache may take (profile a step if needed)
``get_kv_cache_block_bytes``    once: bytes of one block across every layer
``initialize_cache(n)``         once: allocate ``n`` blocks (the engine core chose ``n``)
``execute_model(step)``         once per step, the same ``SchedulerOutput`` on every rank
``shutdown()``                  once, when the engine stops
==============================  ============================================================

A worker never imports the engine: what it needs from it (building the model, turning a
step into tensors, sampling, joining the tensor-parallel group) comes as the
``WorkerServices`` object the engine passes to the constructor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .config import LoomConfigView
    from .sampling_params import SamplingParams
    from .step import (
        ModelInput,
        ModelRunnerOutput,
        PromptLogprobs,
        SampledLogprobs,
        ScheduledRequest,
        SchedulerOutput,
    )

__all__ = ["WorkerBase", "WorkerServices"]


class WorkerServices(ABC):
    """What the engine does for a worker. The engine builds one per worker process.

    Each method runs in the worker's process, on the calling thread; none keeps state
    between calls except what it returns, and the LoRA adapters of the model ``build_model``
    built (``prepare_inputs`` loads the step's adapters into it and sets ``ModelInput.lora_mapping``).
    """

    @abstractmethod
    def init_distributed(self, config: LoomConfigView, rank: int, distributed_init_method: str | None,
                         device: torch.device) -> None:
        """Join the serve's ``torch.distributed`` group (the platform's ``dist_backend``) and
        set up the tensor-parallel group with the platform's communicator
        (``Platform.get_device_communicator_cls``). A no-op for one rank. Call it once,
        from ``init_device``, after the device is current."""

    @abstractmethod
    def build_model(self, config: LoomConfigView, device: torch.device) -> torch.nn.Module:
        """Build the registered architecture for ``config`` on ``device`` (with this
        platform's ops and attention backend) and load this rank's weights."""

    @abstractmethod
    def attention_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The model's attention layers, in order. Each has ``num_kv_heads``, ``head_size``,
        ``attn_backend`` (the ``AttentionBackend`` class) and a ``kv_cache`` tensor that the
        worker binds after it allocates the cache."""

    @abstractmethod
    def prepare_inputs(self, step: SchedulerOutput, block_size: int, device: torch.device) -> ModelInput:
        """The step's tokens, positions and ``AttentionMetadata`` as tensors on ``device``."""

    @abstractmethod
    def new_sampler(self) -> Callable[[torch.Tensor, Any], tuple[list[int], list[SampledLogprobs | None] | None]]:
        """A sampler: ``sampler(logits, metadata) -> (token_ids, logprobs)`` with fp32
        ``logits`` of shape ``(rows, vocab)`` and ``metadata`` from ``sampling_metadata``."""

    @abstractmethod
    def sampling_metadata(self, params: list[SamplingParams], generators: list[torch.Generator | None],
                          num_output_tokens: list[int], eos_token_id: int | None,
                          seen_token_ids: list[list[int]] | None,
                          output_token_ids: list[list[int]] | None) -> Any:
        """Per-row sampling settings for one step (opaque to the worker; it has
        ``all_greedy`` and ``no_processing``). ``seen_token_ids`` (prompt and output tokens,
        for the repetition penalty) and ``output_token_ids`` (frequency and presence
        penalties) are None when no row needs them."""

    @abstractmethod
    def new_prompt_logprobs_state(self, prompt_token_ids: list[int], num_top: int) -> Any:
        """Progress of one request's prompt logprobs (kept across preemptions)."""

    @abstractmethod
    def collect_prompt_logprobs(self, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                                hidden_states: torch.Tensor, scheduled: list[ScheduledRequest],
                                states: dict[str, Any]) -> list[PromptLogprobs]:
        """Score the prompt tokens this step reaches for the requests in ``states`` (a request
        leaves ``states`` once its prompt is scored). Every rank calls it the same way."""


class WorkerBase(ABC):
    def __init__(
        self,
        config: LoomConfigView,
        local_rank: int = 0,
        rank: int = 0,
        distributed_init_method: str | None = None,
        is_driver_worker: bool = True,
        services: WorkerServices | None = None,
    ) -> None:
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        if services is None:
            raise TypeError(f"{type(self).__name__} needs the engine's WorkerServices (services=...)")
        self.services = services

    @abstractmethod
    def init_device(self) -> None:
        """Select the device, seed it, and join the tensor-parallel group."""

    @abstractmethod
    def load_model(self) -> None:
        """Build the model (``services.build_model``) and load its weights (this rank's shard)."""

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes this worker can give the KV cache after the model is loaded. Honour
        ``config.cache_config.kv_cache_memory_bytes`` when it is set."""

    @abstractmethod
    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one KV-cache block takes on this worker, across every layer."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV-cache blocks for every attention layer."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; the driver worker returns the sampled tokens, others None."""

    def shutdown(self) -> None:
        """Release the device and leave the tensor-parallel group; called once when the engine
        stops. The default leaves the ``torch.distributed`` group if this process joined one."""
        import torch.distributed as dist  # lazy: this module loads in processes that never compute

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
