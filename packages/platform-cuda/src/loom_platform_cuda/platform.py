"""``CudaPlatform``: loom on NVIDIA GPUs, with Triton kernels and NCCL collectives.

loom's built-in ``cuda`` detector names this class when this wheel is installed and torch
sees a CUDA device. An out-of-tree platform that answers on the same host wins over it.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, Any, ClassVar

from loom_plugin_api import LoomConfigView, Platform, PlatformEnum

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("loom.platform_cuda")

ATTENTION_BACKEND = "loom_platform_cuda.attention.TritonAttentionBackend"
WORKER = "loom_platform_cuda.worker.CudaWorker"
COMMUNICATOR = "loom_platform_cuda.communicator.NcclCommunicator"


class CudaPlatform(Platform):
    _enum: ClassVar[PlatformEnum] = PlatformEnum.CUDA
    device_name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dispatch_key: ClassVar[str] = "CUDA"
    dist_backend: ClassVar[str] = "nccl"
    ray_device_key: ClassVar[str] = "GPU"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    supports_tensor_parallel: ClassVar[bool] = True

    @classmethod
    def check_and_update_config(cls, config: LoomConfigView) -> None:
        if config.parallel_config.worker_cls == "auto":
            config.parallel_config.worker_cls = WORKER
        dtype = config.model_config.dtype
        if dtype not in cls.supported_dtypes:
            raise ValueError(f"dtype {dtype} is not supported on CUDA; use --dtype bfloat16, float16 or float32")
        head_size = config.model_config.get_head_size()
        if not 16 <= head_size <= 256 or head_size % 8:
            raise ValueError(
                f"head size {head_size} is not supported by loom's Triton attention; it takes multiples "
                "of 8 from 16 to 256"
            )

    @classmethod
    def update_block_size_for_backend(cls, config: LoomConfigView) -> None:
        from .attention import TritonAttentionBackend  # lazy: triton and torch; only workers call this

        cache = config.cache_config
        supported = TritonAttentionBackend.get_supported_block_sizes()
        if cache.user_block_size:
            if cache.block_size not in supported:
                raise ValueError(f"--block-size {cache.block_size} is not supported on CUDA; use one of {supported}")
            return
        if cache.block_size not in supported:
            cache.block_size = supported[0]

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """Install the Triton kernels behind loom's ``forward_cuda`` (RMSNorm, RoPE, SiLU, the quantized
        linear, batched LoRA)."""
        # lazy: CustomOp is a torch.nn.Module and the kernels import triton; every process of a serve
        # loads this class, only the workers register kernels
        from loom_plugin_api import CustomOp

        from . import kernels  # lazy: triton and torch, as above

        # Triton builds a small C launcher the first time a kernel runs: fail now, with the reason.
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if not compiler:
            raise RuntimeError("loom's CUDA platform needs a C compiler for Triton's kernel launcher: install gcc "
                               "or clang (and the Python headers), or set CC")

        CustomOp.register_kernel("rms_norm", kernels.rms_norm)
        CustomOp.register_kernel("rotary_embedding", kernels.rotary_embedding)
        CustomOp.register_kernel("silu_and_mul", kernels.silu_and_mul)
        CustomOp.register_kernel("quantized_linear", kernels.quantized_linear)  # .prepare packs 4-bit codes
        CustomOp.register_kernel("lora", kernels.lora)
        logger.info("Triton kernels installed for rms_norm, rotary_embedding, silu_and_mul, quantized_linear, lora "
                    "(pid %d)", os.getpid())

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: str | None, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        if selected_backend not in (None, "TRITON_ATTN"):
            raise ValueError(f"attention backend {selected_backend!r} is not available on CUDA; use TRITON_ATTN")
        return ATTENTION_BACKEND

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return COMMUNICATOR

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import torch  # lazy: torch stays out of the front end and engine core, which load this class too

        return int(torch.cuda.get_device_properties(device_id).total_memory)

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        import torch  # lazy: torch stays out of the front end and engine core, which load this class too

        free, _ = torch.cuda.mem_get_info(device_id)
        return int(free)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        import torch  # lazy: torch stays out of the front end and engine core, which load this class too

        torch.cuda.set_device(device)

    @classmethod
    def seed_everything(cls, seed: int | None) -> None:
        super().seed_everything(seed)
        if seed is not None:
            import torch  # lazy: torch stays out of the front end and engine core, which load this class too

            torch.cuda.manual_seed_all(seed)
