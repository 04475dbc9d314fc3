"""EngineArgs: the user-facing engine options, their CLI flags, and config creation."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from loom_plugin_api import load_general_plugins

from .. import envs
from ..config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    LoadConfig,
    LoomConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from ..logger import init_logger

logger = init_logger(__name__)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _custom_ops(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


@dataclass(kw_only=True)
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int | None = 0
    tensor_parallel_size: int = 1
    block_size: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    custom_ops: list[str] = field(default_factory=list)
    load_format: str = "auto"
    worker_cls: str = "auto"
    fail_on_environ_validation: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags to ``parser``.

        The general plugins run first (once per process) so a plugin can extend what the
        flags accept; then the platform sees the parser (``pre_register_and_update``).
        """
        from ..model_loader import load_format_choices

        # Importing current_platform resolves it: the platform is fixed before any general plugin runs.
        from ..platforms import current_platform

        load_general_plugins()
        g = parser.add_argument_group("engine")
        g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
        g.add_argument("--served-model-name", default=None)
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--hf-overrides", type=_json_object, default={},
                       help='JSON object set on the HF config, e.g. \'{"architectures": ["MyLlama"]}\'')
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        g.add_argument("--block-size", type=int, default=None)
        g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of GPU memory the model and its KV cache may use (GPU platforms)")
        g.add_argument("--enforce-eager", action="store_true",
                       help="do not record decode steps as CUDA graphs (GPU platforms)")
        g.add_argument("--max-num-seqs", type=int, default=256)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
        g.add_argument("--custom-ops", type=_custom_ops, default=[],
                       help="comma-separated: all, none, +name, -name")
        g.add_argument("--load-format", default="auto", choices=load_format_choices(),
                       help="how to load weights; general plugins may add formats")
        g.add_argument("--worker-cls", default="auto", help="qualified name of the worker class")
        current_platform.pre_register_and_update(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_engine_config(self) -> LoomConfig:
        """Build the ``LoomConfig`` (start-up stops 5-7), in the process that parsed the args."""
        from ..platforms import current_platform  # resolved before the general plugins run

        load_general_plugins()
        current_platform.pre_register_and_update()
        device_config = DeviceConfig(device=current_platform.device_type)
        current_platform.validate_environ(self.fail_on_environ_validation)
        model_config = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len, hf_overrides=dict(self.hf_overrides), seed=self.seed,
            served_model_name=self.served_model_name,
        )
        max_len = model_config.max_model_len
        assert max_len is not None
        cache_config = CacheConfig(
            block_size=self.block_size or 16, user_block_size=self.block_size is not None,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory_bytes=_host_kv_cache_space(device_config.device_type) or self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        return LoomConfig(
            model_config=model_config,
            device_config=device_config,
            cache_config=cache_config,
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, worker_cls=self.worker_cls,
            ),
            scheduler_config=scheduler_config,
            compilation_config=CompilationConfig(custom_ops=list(self.custom_ops), enforce_eager=self.enforce_eager),
            load_config=LoadConfig(load_format=self.load_format),
        )


def _host_kv_cache_space(device_type: str) -> int | None:
    """``LOOM_CPU_KVCACHE_SPACE`` (GiB) for platforms that compute in host memory; it wins
    over ``--kv-cache-memory-bytes``."""
    space = envs.LOOM_CPU_KVCACHE_SPACE
    if not space or device_type != "cpu":
        return None
    try:
        return int(float(space) * (1 << 30))
    except ValueError:
        raise ValueError(f"LOOM_CPU_KVCACHE_SPACE={space!r} is not a number of GiB (e.g. 4 or 0.5)") from None
