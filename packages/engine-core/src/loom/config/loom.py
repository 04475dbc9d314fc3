"""LoomConfig: every part of a serve's configuration, finished by the platform."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom_plugin_api.tracing import span

from .. import platforms
from ..logger import init_logger
from .cache import CacheConfig
from .compilation import CompilationConfig
from .device import DeviceConfig
from .load import LoadConfig
from .lora import LoRAConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig

logger = init_logger(__name__)


@dataclass(slots=True, kw_only=True)
class LoomConfig:
    model_config: ModelConfig
    device_config: DeviceConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        current_platform = platforms.current_platform
        with span("platform hook apply_config_platform_defaults"):
            current_platform.apply_config_platform_defaults(self)
        custom_ops = self.compilation_config.custom_ops
        if all(base not in custom_ops for base in ("all", "none")):
            # loom runs eagerly (no graph compiler fuses ops for it), so the platform's
            # own op implementations are on unless the user or platform says otherwise.
            custom_ops.append("all")
        logger.debug("custom_ops before the platform's check: %s", custom_ops)
        worker_cls_chosen_by_user = self.parallel_config.worker_cls != "auto"
        with span("platform hook check_and_update_config"):
            current_platform.check_and_update_config(self)
        # The platform may have replaced the list; validate what it left.
        CompilationConfig(custom_ops=list(self.compilation_config.custom_ops))
        if self.parallel_config.worker_cls == "auto":
            raise ValueError(
                f"platform {type(current_platform).__name__} did not set worker_cls in "
                "check_and_update_config; it must name its worker class"
            )
        # worker_cls, the attention backend and the communicator import and subclass the
        # contract's bases: a wrong name stops here, in this process, before anything is spawned.
        with span("check the platform's class names"):
            platforms.validate_platform_names(self, worker_cls_chosen_by_user=worker_cls_chosen_by_user)
        self._verify_tensor_parallel()
        max_len = self.model_config.max_model_len
        sched = self.scheduler_config
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_len:
            raise ValueError(
                f"--max-num-batched-tokens ({sched.max_num_batched_tokens}) is below --max-model-len "
                f"({max_len}) with chunked prefill off; raise it or enable chunked prefill"
            )
        self._log()

    def _verify_tensor_parallel(self) -> None:
        """Catch a tensor-parallel size the model cannot be split by, before anything starts."""
        tp = self.parallel_config.tensor_parallel_size
        current_platform = platforms.current_platform
        if tp > 1 and not current_platform.supports_tensor_parallel:
            raise ValueError(f"the {current_platform.device_name} platform does not support tensor parallelism "
                             f"(--tensor-parallel-size {tp}); use 1")
        heads = self.model_config.get_num_attention_heads()
        kv_heads = self.model_config.get_num_kv_heads()
        if heads % tp:
            raise ValueError(
                f"the model has {heads} attention heads, which --tensor-parallel-size {tp} does not divide; "
                f"choose a size that divides {heads}"
            )
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(
                f"the model has {kv_heads} KV heads: --tensor-parallel-size {tp} must divide it or be a multiple of it"
            )
        if not self.model_config.model_info.supports_tensor_parallel and tp > 1:
            raise ValueError(f"{self.model_config.architecture} does not support tensor parallelism; use size 1")

    def _log(self) -> None:
        max_len = self.model_config.max_model_len
        logger.info(
            "Config: model=%s arch=%s dtype=%s max_model_len=%d tp=%d block_size=%d custom_ops=%s worker_cls=%s",
            self.model_config.model_path, self.model_config.architecture, self.model_config.dtype,
            max_len, self.parallel_config.tensor_parallel_size, self.cache_config.block_size,
            self.compilation_config.custom_ops, self.parallel_config.worker_cls,
        )
