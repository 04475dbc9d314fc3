"""The built-in CPU platform."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

from loom_plugin_api import Platform, PlatformEnum

from ..logger import init_logger

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

_TORCH_ATTENTION_BACKEND = "loom.attention.backends.torch_sdpa.TorchSDPABackend"


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


class CpuPlatform(Platform):
    """Computes on the host CPU with torch. An out-of-tree platform that also computes on
    CPU memory may subclass this and change only its identity and hooks."""

    _enum: ClassVar[PlatformEnum] = PlatformEnum.CPU
    device_name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dispatch_key: ClassVar[str] = "CPU"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    supports_tensor_parallel: ClassVar[bool] = True

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
    def get_attn_backend_cls(
        cls, selected_backend: str | None, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        if selected_backend not in (None, "TORCH_SDPA"):
            raise ValueError(f"attention backend {selected_backend!r} is not available on CPU; use TORCH_SDPA")
        return _TORCH_ATTENTION_BACKEND

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "loom_plugin_api.communicator.TorchDistributedCommunicator"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return _meminfo_bytes("MemTotal")

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        return _meminfo_bytes("MemAvailable")

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # Each worker owns a share of the cores; torch picks all of them otherwise.
        threads = os.environ.get("LOOM_CPU_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
