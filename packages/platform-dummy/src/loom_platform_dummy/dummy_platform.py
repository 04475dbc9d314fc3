"""DummyPlatform: an out-of-tree platform whose "device" is host memory.

Why ``device_type`` is ``"cpu"`` and not the tour's ``"privateuseone"``: torch can only
allocate and compute on ``PrivateUse1`` when a backend registers kernels for it (a C++
extension with an allocator and operator implementations). Without one, every tensor
op on that device fails. This platform keeps the out-of-tree identity (``PlatformEnum.OOT``,
its own name, worker, attention backend and ops) and computes on CPU memory, so it is
complete: ``loom.LLM`` generates correct text on it.

It is built on ``loom_plugin_api`` alone, as a vendor's platform must be.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

from loom_plugin_api import LoomConfigView, Platform, PlatformEnum

from .logging import logger

if TYPE_CHECKING:
    import torch

WORKER = "loom_platform_dummy.worker.DummyWorker"
ATTENTION_BACKEND = "loom_platform_dummy.dummy_attention_backend.DummyAttentionBackend"


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


class DummyPlatform(Platform):
    _enum: ClassVar[PlatformEnum] = PlatformEnum.OOT
    device_name: ClassVar[str] = "DummyDevice"
    device_type: ClassVar[str] = "cpu"
    dispatch_key: ClassVar[str] = "CPU"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    supports_tensor_parallel: ClassVar[bool] = True

    @classmethod
    def check_and_update_config(cls, config: LoomConfigView) -> None:
        # The platform's own op implementations (forward_oot) run for every CustomOp.
        config.compilation_config.custom_ops = ["all"]
        if config.parallel_config.worker_cls == "auto":
            config.parallel_config.worker_cls = WORKER
        dtype = config.model_config.dtype
        if dtype not in cls.supported_dtypes:
            raise ValueError(f"dtype {dtype} is not supported on {cls.device_name}; use --dtype float32 or bfloat16")
        logger.info("DummyPlatform set custom_ops=%s worker_cls=%s",
                    config.compilation_config.custom_ops, config.parallel_config.worker_cls)

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: str | None, attn_selector_config: object, num_heads: int | None = None
    ) -> str:
        if selected_backend not in (None, "DUMMY"):
            raise ValueError(f"attention backend {selected_backend!r} is not available on {cls.device_name}; "
                             "use DUMMY")
        return ATTENTION_BACKEND

    @classmethod
    def update_block_size_for_backend(cls, config: LoomConfigView) -> None:
        from .dummy_attention_backend import DummyAttentionBackend

        supported = DummyAttentionBackend.get_supported_block_sizes()
        if not config.cache_config.user_block_size and config.cache_config.block_size not in supported:
            config.cache_config.block_size = supported[0]

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return _meminfo_bytes("MemTotal")

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        return _meminfo_bytes("MemAvailable")

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # Each rank of a tensor-parallel serve owns a share of the cores (the launcher says how many).
        threads = os.environ.get("LOOM_CPU_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
