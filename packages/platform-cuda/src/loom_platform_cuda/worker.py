"""``CudaWorker``: one tensor-parallel rank on one GPU.

``init_device`` takes GPU ``local_rank`` and joins the NCCL group; ``load_model`` builds
the model on it; ``determine_available_memory`` profiles the largest step and offers the
KV cache what ``--gpu-memory-utilization`` leaves; ``initialize_cache`` allocates it and,
unless ``--enforce-eager``, records the decode steps as CUDA graphs.
"""

from __future__ import annotations

import logging

import torch
from loom_plugin_api import ModelRunnerOutput, SchedulerOutput, WorkerBase, get_current_platform
from loom_plugin_api.tracing import span

from .model_runner import CudaModelRunner

logger = logging.getLogger("loom.platform_cuda.worker")

_MiB = 1 << 20
# Kept free beside the KV cache for the recorded graphs' buffers and the allocator's slack.
_GRAPH_RESERVE_BYTES = 512 * _MiB


class CudaWorker(WorkerBase):
    model_runner: CudaModelRunner

    def init_device(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaWorker needs a CUDA device, and torch sees none")
        count = torch.cuda.device_count()
        if self.local_rank >= count:
            raise RuntimeError(f"rank {self.rank} needs GPU {self.local_rank}, but only {count} are visible "
                               "(CUDA_VISIBLE_DEVICES); lower --tensor-parallel-size")
        self.device = torch.device("cuda", self.local_rank)
        platform = get_current_platform()
        platform.set_device(self.device)
        platform.seed_everything(self.config.model_config.seed)
        self.services.init_distributed(self.config, self.rank, self.distributed_init_method, self.device)
        name = torch.cuda.get_device_name(self.device)
        logger.info("Worker rank %d initialized device %s (%s)", self.rank, self.device, name)

    def load_model(self) -> None:
        model = self.services.build_model(self.config, self.device)
        self.model_runner = CudaModelRunner(self.config, model, self.device, self.services)

    def determine_available_memory(self) -> int:
        fixed = self.config.cache_config.kv_cache_memory_bytes
        if fixed:
            return fixed
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        profile_kv = self.model_runner.profile_run()  # its KV cache is freed again: not activations
        torch.cuda.synchronize(self.device)
        activation_peak = (torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
                           - profile_kv)
        torch.cuda.empty_cache()
        # Measured after the profile step, so lazily made state (cuBLAS handles, NCCL buffers,
        # Triton modules) counts: weights, CUDA context, other processes on this GPU.
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free
        utilization = self.config.cache_config.gpu_memory_utilization
        reserve = 0 if self.config.compilation_config.enforce_eager else _GRAPH_RESERVE_BYTES
        budget = int(total * utilization) - in_use - max(activation_peak, 0) - reserve
        logger.info(
            "Worker rank %d memory: %.0f MiB total, %.0f MiB in use after loading, %.0f MiB activation peak; "
            "%.0f MiB for the KV cache at --gpu-memory-utilization %.2f",
            self.rank, total / _MiB, in_use / _MiB, activation_peak / _MiB, max(budget, 0) / _MiB, utilization,
        )
        if budget <= 0:
            raise ValueError(
                f"--gpu-memory-utilization {utilization} leaves no memory for the KV cache on GPU "
                f"{self.local_rank} ({in_use / _MiB:.0f} MiB already in use of {total / _MiB:.0f} MiB); raise it, "
                "lower --max-num-batched-tokens, or free the GPU"
            )
        return budget

    def get_kv_cache_block_bytes(self) -> int:
        return self.model_runner.kv_cache_block_bytes()

    def initialize_cache(self, num_blocks: int) -> None:
        with span("allocate the KV cache"):
            self.model_runner.initialize_cache(num_blocks)
        logger.info("Worker rank %d allocated %d KV-cache blocks", self.rank, num_blocks)
        compilation = self.config.compilation_config
        if not compilation.enforce_eager:
            with span("capture CUDA graphs", sizes=len(compilation.cudagraph_capture_sizes)):
                self.model_runner.capture_decode_graphs(compilation.cudagraph_capture_sizes)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.model_runner.execute_model(scheduler_output)
        return output if self.is_driver_worker else None
