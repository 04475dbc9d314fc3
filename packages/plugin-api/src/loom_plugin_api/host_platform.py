"""``HostPlatform``: the hooks every platform computing in host memory shares.

loom's CPU platform and the reference dummy platform build on it; a vendor whose device
computes on host memory (``device_type`` ``"cpu"``) may too, and set only its identity,
worker, attention backend and config checks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

from .platform import Platform

if TYPE_CHECKING:
    import torch

__all__ = ["HostPlatform"]


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


class HostPlatform(Platform):
    device_type: ClassVar[str] = "cpu"
    dispatch_key: ClassVar[str] = "CPU"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    supports_tensor_parallel: ClassVar[bool] = True

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return _meminfo_bytes("MemTotal")

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        return _meminfo_bytes("MemAvailable")

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # Each rank of a tensor-parallel serve owns a share of the cores (the launcher sets
        # LOOM_CPU_NUM_THREADS); torch would take all of them otherwise.
        threads = os.environ.get("LOOM_CPU_NUM_THREADS")
        if threads:
            import torch  # lazy: the platform class loads in processes that never compute

            torch.set_num_threads(int(threads))
