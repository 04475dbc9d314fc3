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

from typing import ClassVar

from loom_plugin_api import HostPlatform, LoomConfigView, PlatformEnum

from .logging import logger

WORKER = "loom_platform_dummy.worker.DummyWorker"
ATTENTION_BACKEND = "loom_platform_dummy.dummy_attention_backend.DummyAttentionBackend"


class DummyPlatform(HostPlatform):
    _enum: ClassVar[PlatformEnum] = PlatformEnum.OOT
    device_name: ClassVar[str] = "DummyDevice"

    @classmethod
    def check_and_update_config(cls, config: LoomConfigView) -> None:
        # The platform's own op implementations (forward_oot) run for every CustomOp but those the
        # user switched off by name ("-rms_norm"): the base entry becomes "all".
        user_off = [op for op in config.compilation_config.custom_ops if op.startswith("-")]
        config.compilation_config.custom_ops = ["all", *user_off]
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
        # lazy: the backend imports torch; every process loads the platform class, only workers call this
        from .dummy_attention_backend import DummyAttentionBackend

        supported = DummyAttentionBackend.get_supported_block_sizes()
        if not config.cache_config.user_block_size and config.cache_config.block_size not in supported:
            config.cache_config.block_size = supported[0]
