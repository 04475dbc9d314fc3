"""DummyPlatform: an out-of-tree platform whose "device" is host memory.

Why ``device_type`` is ``"cpu"`` and not the tour's ``"privateuseone"``: torch can only
allocate and compute on ``PrivateUse1`` when a backend registers kernels for it (a C++
extension with an allocator and operator implementations). Without one, every tensor
op on that device fails. This platform keeps the out-of-tree identity (``PlatformEnum.OOT``,
its own name, worker, attention backend and ops) and computes on CPU memory, so it is
complete: ``loom.LLM`` generates correct text on it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from loom.platforms.cpu import CpuPlatform
from loom_plugin_api import PlatformEnum

from .logging import logger


class DummyPlatform(CpuPlatform):
    _enum: ClassVar[PlatformEnum] = PlatformEnum.OOT
    device_name: ClassVar[str] = "DummyDevice"
    device_type: ClassVar[str] = "cpu"
    dispatch_key: ClassVar[str] = "CPU"
    dist_backend: ClassVar[str] = "gloo"

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        # The platform's own op implementations (forward_oot) run for every CustomOp.
        config.compilation_config.custom_ops = ["all"]
        if config.parallel_config.worker_cls == "auto":
            config.parallel_config.worker_cls = "loom_platform_dummy.worker.DummyWorker"
        super().check_and_update_config(config)
        logger.info("DummyPlatform set custom_ops=%s worker_cls=%s",
                    config.compilation_config.custom_ops, config.parallel_config.worker_cls)

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: str | None, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        return "loom_platform_dummy.dummy_attention_backend.DummyAttentionBackend"

    @classmethod
    def update_block_size_for_backend(cls, config: Any) -> None:
        from .dummy_attention_backend import DummyAttentionBackend

        supported = DummyAttentionBackend.get_supported_block_sizes()
        if not config.cache_config.user_block_size and config.cache_config.block_size not in supported:
            config.cache_config.block_size = supported[0]
