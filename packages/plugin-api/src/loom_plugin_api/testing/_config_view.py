"""A ``LoomConfigView`` built without the engine, for the hooks the config tier calls.

The contract's config types are protocols; the engine's ``LoomConfig`` satisfies them and
so does this plain stand-in, which carries only the stable fields.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["ConfigView", "snapshot", "tiny_config_view"]


@dataclass(kw_only=True)
class ModelView:
    model: str | None = "kit-tiny-llama"
    model_path: str = "/nonexistent/kit-tiny-llama"
    model_format: str = "hf"
    architecture: str = "LlamaForCausalLM"
    hf_config: Any = None
    dtype: str = "float32"
    max_model_len: int = 256
    seed: int | None = 0
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2

    @property
    def torch_dtype(self) -> Any:
        return getattr(torch, self.dtype)

    def get_hidden_size(self) -> int:
        return self.hidden_size

    def get_num_layers(self) -> int:
        return self.num_layers

    def get_num_attention_heads(self) -> int:
        return self.num_heads

    def get_num_kv_heads(self) -> int:
        return self.num_kv_heads

    def get_head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def get_vocab_size(self) -> int:
        return 512


@dataclass(kw_only=True)
class CacheView:
    block_size: int = 16
    user_block_size: bool = False
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None


@dataclass(kw_only=True)
class ParallelView:
    tensor_parallel_size: int = 1
    worker_cls: str = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(kw_only=True)
class SchedulerView:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(kw_only=True)
class DeviceView:
    device: str = "auto"
    device_type: str = "cpu"


@dataclass(kw_only=True)
class CompilationView:
    custom_ops: list[str] = field(default_factory=list)
    enforce_eager: bool = True
    cudagraph_capture_sizes: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class ConfigView:
    model_config: ModelView
    cache_config: CacheView
    parallel_config: ParallelView
    scheduler_config: SchedulerView
    device_config: DeviceView
    compilation_config: CompilationView


def tiny_config_view(device_type: str, dtype: str = "float32", **cache: Any) -> ConfigView:
    hf_config = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=256,
        torch_dtype="float32",
    )
    return ConfigView(
        model_config=ModelView(dtype=dtype, hf_config=hf_config),
        cache_config=CacheView(**cache),
        parallel_config=ParallelView(),
        scheduler_config=SchedulerView(),
        device_config=DeviceView(device_type=device_type),
        compilation_config=CompilationView(),
    )


def snapshot(config: ConfigView) -> dict[str, Any]:
    """Every stable field's value (the HF config left out), to compare two states."""
    state = asdict(copy.copy(config))
    state["model_config"].pop("hf_config", None)
    return state
