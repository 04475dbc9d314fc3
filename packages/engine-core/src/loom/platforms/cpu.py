"""The built-in CPU platform."""

from __future__ import annotations

from typing import Any, ClassVar

from loom_plugin_api import HostPlatform, PlatformEnum

from ..logger import init_logger

logger = init_logger(__name__)

_ATTENTION_BACKENDS = {  # by --kv-cache-dtype
    "auto": "loom.attention.backends.torch_sdpa.TorchSDPABackend",
    "int8": "loom.attention.backends.torch_sdpa_int8.TorchSDPAInt8Backend",
}


class CpuPlatform(HostPlatform):
    """Computes on the host CPU with torch. An out-of-tree platform that also computes in
    host memory builds on the contract's ``HostPlatform`` (as this one does), not on this class."""

    _enum: ClassVar[PlatformEnum] = PlatformEnum.CPU
    device_name: ClassVar[str] = "cpu"

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        if config.parallel_config.worker_cls == "auto":
            config.parallel_config.worker_cls = "loom.worker.cpu_worker.CPUWorker"
        model_config = config.model_config
        if model_config.dtype not in cls.supported_dtypes:
            raise ValueError(
                f"dtype {model_config.dtype} is not supported on {cls.device_name}; "
                f"use --dtype float32 or bfloat16"
            )

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # Not Triton here: fused C kernels compiled on this machine, behind the ops' forward_cpu, and
        # the quantized matmul (the C 4-bit and 8-bit kernels, a dense copy for batches).
        # Imported here, not at the top: they import torch, which the CLI's platform detection must not.
        from loom_plugin_api import CustomOp  # lazy: CustomOp is a torch module

        from ..layers.quantized import cpu_quantized_linear  # lazy: imports torch
        from .cpu_kernels import install  # lazy: imports torch

        install()
        CustomOp.register_kernel("quantized_linear", cpu_quantized_linear)

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: str | None, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        if selected_backend not in (None, "TORCH_SDPA"):
            raise ValueError(f"attention backend {selected_backend!r} is not available on CPU; use TORCH_SDPA")
        kv_cache_dtype = attn_selector_config.kv_cache_dtype
        if kv_cache_dtype not in _ATTENTION_BACKENDS:
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is not available on CPU; use one of "
                             f"{', '.join(_ATTENTION_BACKENDS)}")
        return _ATTENTION_BACKENDS[kv_cache_dtype]
