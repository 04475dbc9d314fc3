"""EngineArgs: the user-facing engine options, their CLI flags, and config creation.

Each option is declared once, as a field of :class:`EngineArgs`: its default, and for a field
made with :func:`_flag` the flag's type, choices and help. :meth:`EngineArgs.add_cli_args`
builds the parser from the fields, so a flag's default cannot drift from the field's.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from loom_plugin_api import Platform, load_general_plugins
from loom_plugin_api.tracing import span

from .. import envs, platforms
from ..config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    LoadConfig,
    LoomConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from ..config.cache import KV_CACHE_DTYPES
from ..config.cli import add_flags, flag, from_args
from ..config.model import QUANT_GROUP_SIZES, QUANTIZATIONS
from ..config.parallel import EXECUTOR_BACKENDS, RAY_PLACEMENT_STRATEGIES
from ..logger import init_logger
from ..model_loader import load_format_choices

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
    model: str | None = None  # positional: the command adds it, add_cli_args does not
    tokenizer: str | None = flag(None, help="tokenizer directory (default: the model's)")
    served_model_name: str | None = flag(None)
    dtype: str = flag("auto", choices=["auto", "float32", "bfloat16", "float16"])
    max_model_len: int | None = flag(None, type=int)
    quantization: str = flag(
        "auto", choices=list(QUANTIZATIONS),
        help="gguf: keep a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks (CPU); int4/int8: quantize a safetensors model's "
             "linear weights at load (round to nearest); none: dequantize; auto: gguf for GGUF on a bf16 CPU")
    quantization_group_size: int = flag(128, type=int, choices=list(QUANT_GROUP_SIZES),
                                        help="weights per scale for --quantization int4/int8")
    hf_overrides: dict[str, Any] = flag(
        default_factory=dict, type=_json_object,
        help='JSON object set on the HF config, e.g. \'{"architectures": ["MyLlama"]}\'')
    seed: int | None = flag(0, type=int)
    tensor_parallel_size: int = flag(1, aliases=("-tp",), type=int)
    block_size: int | None = flag(None, type=int)
    enable_prefix_caching: bool = flag(True, flag="--no-enable-prefix-caching", action="store_false")
    kv_cache_dtype: str = flag(
        "auto", choices=list(KV_CACHE_DTYPES),
        help="auto: K/V in the model's dtype; int8: 8-bit codes with a scale per token and KV head, about half "
             "the bytes for decode attention to read, with some rounding of K/V (CPU platform)")
    kv_cache_memory_bytes: int | None = flag(None, type=int)
    gpu_memory_utilization: float = flag(
        0.9, type=float, help="share of GPU memory the model and its KV cache may use (GPU platforms)")
    enforce_eager: bool = flag(
        False, action="store_true", help="run every step eagerly: no CUDA graphs (GPU platforms), no replayed one-stream decode step (CPU)")
    max_num_seqs: int = flag(256, type=int)
    max_num_batched_tokens: int | None = flag(None, type=int)
    enable_chunked_prefill: bool = flag(True, flag="--no-enable-chunked-prefill", action="store_false")
    async_scheduling: str = flag(
        "auto", choices=["auto", "on", "off"],
        help="on: with one worker, schedule the next step while a step runs (the worker does not wait for the "
             "engine between steps); auto: on where the engine has CPU time the worker does not use (a GPU, or "
             "CPU threads fewer than the cores)")
    custom_ops: list[str] = flag(
        default_factory=list, type=_custom_ops, help="comma-separated: all, none, +name, -name")
    load_format: str = flag(
        "auto", choices=load_format_choices, help="how to load weights; general plugins may add formats")
    worker_cls: str = flag("auto", help="qualified name of the worker class")
    distributed_executor_backend: str = flag(
        "mp", choices=list(EXECUTOR_BACKENDS),
        help="mp: a worker process per rank on this machine; ray: a Ray actor per rank, across the nodes of a "
             "Ray cluster (pip install 'loom-engine[ray]')")
    ray_address: str | None = flag(
        None, help="Ray cluster to join (default: RAY_ADDRESS, else a running local cluster, else a new one)")
    ray_placement_strategy: str = flag(
        "PACK", choices=list(RAY_PLACEMENT_STRATEGIES),
        help="how the ranks' bundles spread over the nodes: PACK fills nodes first, STRICT_SPREAD puts "
             "every rank on a different node")
    ray_placement_timeout: float = flag(60.0, type=float,
                                        help="seconds to wait for the Ray cluster's resources (default 60)")
    enable_lora: bool = flag(False, action="store_true",
                             help="serve LoRA adapters (PEFT format) on the base model: --lora-modules, a request's "
                                  "model naming an adapter, LLM.generate(lora_request=...)")
    max_loras: int = flag(1, type=int, help="distinct adapters one step may hold (default 1)")
    max_lora_rank: int = flag(16, type=int, help="largest adapter rank served (default 16); every slot is this wide")
    max_cpu_loras: int | None = flag(None, type=int,
                                     help="adapters each worker keeps loaded, least recently used evicted "
                                          "(default: --max-loras)")
    fail_on_environ_validation: bool = False  # no flag: set as a keyword of EngineArgs(...) or LLM(...)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags to ``parser``, one per field made with :func:`~loom.config.cli.flag`.

        The general plugins run first (once per process) so a plugin can extend what the
        flags accept; then the platform sees the parser (``pre_register_and_update``).
        """
        platform = platforms.current_platform  # resolved first: fixed before any general plugin runs
        load_general_plugins()
        add_flags(parser.add_argument_group("engine"), EngineArgs)
        platform.pre_register_and_update(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return from_args(cls, args)

    def create_engine_config(self) -> LoomConfig:
        """Build the ``LoomConfig`` (start-up stops 5-7), in the process that parsed the args."""
        with span("build config"):
            return self._create_engine_config()

    def _create_engine_config(self) -> LoomConfig:
        current_platform = platforms.current_platform  # resolved before the general plugins run
        load_general_plugins()
        with span("platform hook pre_register_and_update"):
            current_platform.pre_register_and_update()
        device_config = DeviceConfig(device=current_platform.device_type)
        with span("platform hook validate_environ"):
            current_platform.validate_environ(self.fail_on_environ_validation)
        with span("model config", model=str(self.model)):
            model_config = self._model_config(current_platform, device_config)
        max_len = model_config.max_model_len
        assert max_len is not None
        cache_config = CacheConfig(
            block_size=self.block_size or 16, user_block_size=self.block_size is not None,
            enable_prefix_caching=self.enable_prefix_caching, kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory_bytes=_host_kv_cache_space(device_config.device_type) or self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
            enable_chunked_prefill=self.enable_chunked_prefill,
            async_scheduling=_async_scheduling(self.async_scheduling, device_config.device_type),
        )
        return LoomConfig(
            model_config=model_config,
            device_config=device_config,
            cache_config=cache_config,
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, worker_cls=self.worker_cls,
                distributed_executor_backend=self.distributed_executor_backend, ray_address=self.ray_address,
                ray_placement_strategy=self.ray_placement_strategy,
                ray_placement_timeout=self.ray_placement_timeout,
            ),
            scheduler_config=scheduler_config,
            compilation_config=CompilationConfig(custom_ops=list(self.custom_ops), enforce_eager=self.enforce_eager),
            load_config=LoadConfig(load_format=self.load_format),
            lora_config=LoRAConfig(enable_lora=self.enable_lora, max_loras=self.max_loras,
                                   max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras),
        )

    def _model_config(self, current_platform: Platform, device_config: DeviceConfig) -> ModelConfig:
        return ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len, quantization=self.quantization,
            quantization_group_size=self.quantization_group_size,
            hf_overrides=dict(self.hf_overrides), seed=self.seed,
            served_model_name=self.served_model_name, device_type=device_config.device_type,
            platform_dtypes=tuple(current_platform.supported_dtypes),
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


def _async_scheduling(choice: str, device_type: str) -> bool:
    """``--async-scheduling``: ``auto`` overlaps steps where the engine core's work does not take
    the worker's compute: the worker computes on a device, or its CPU threads leave a core free
    (``LOOM_CPU_NUM_THREADS``). On CPU cores the worker fills, overlapping moved the engine's work
    into the worker's steps and gained nothing (docs/decisions.md)."""
    if choice != "auto":
        return choice == "on"
    if device_type != "cpu":
        return True
    cores = len(os.sched_getaffinity(0))
    threads = os.environ.get("LOOM_CPU_NUM_THREADS", "")
    return threads.isdigit() and 0 < int(threads) < cores
