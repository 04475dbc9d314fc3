"""The typed view of the configuration that platform hooks and workers receive.

The engine builds one ``LoomConfig`` per serve in the process that parses the arguments
(the CLI or ``loom.LLM``), runs the platform's configuration hooks on it, and sends it
as it is to the engine core and every worker. Hooks and workers see it through these
protocols: the fields below are the stable ones (the engine's config may carry more;
reading those is reading engine internals). Which fields a hook may change is said by
the hook (``Platform.check_and_update_config`` and friends).

They are protocols, not classes to build: the engine's config satisfies them
structurally, and a vendor's test can satisfy them with a ``SimpleNamespace``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "CacheConfigView",
    "CompilationConfigView",
    "DeviceConfigView",
    "LoomConfigView",
    "ModelConfigView",
    "ParallelConfigView",
    "SchedulerConfigView",
]


class ModelConfigView(Protocol):
    model: str | None
    """What the user asked for (a path or a name)."""
    model_path: str
    """The resolved local path of the checkpoint (a folder or a ``.gguf`` file)."""
    model_format: str
    """``"hf"`` (safetensors / bin) or ``"gguf"``."""
    architecture: str
    """The registered architecture that will be built (``ModelRegistry``)."""
    hf_config: Any
    """The model's ``transformers.PretrainedConfig``."""
    dtype: str
    """Resolved compute dtype by torch name: ``"float32"``, ``"bfloat16"``, ``"float16"``."""
    max_model_len: int
    seed: int | None

    @property
    def torch_dtype(self) -> torch.dtype: ...
    def get_hidden_size(self) -> int: ...
    def get_num_layers(self) -> int: ...
    def get_num_attention_heads(self) -> int: ...
    def get_num_kv_heads(self) -> int: ...
    def get_head_size(self) -> int: ...
    def get_vocab_size(self) -> int: ...


class CacheConfigView(Protocol):
    block_size: int
    """Tokens per KV-cache block; a platform may change it while ``user_block_size`` is False."""
    user_block_size: bool
    """True when the user chose ``--block-size``: leave it alone (or reject it)."""
    enable_prefix_caching: bool
    kv_cache_dtype: str
    """``--kv-cache-dtype``: ``"auto"`` (the model's dtype) or ``"int8"`` (the values loom accepts);
    the platform's attention backend keeps it or refuses it (``get_kv_cache_dtype``)."""
    kv_cache_memory_bytes: int | None
    """A fixed KV-cache budget per worker; None lets the worker measure it."""
    gpu_memory_utilization: float
    """Share of a device's memory a worker may use in all (devices with their own memory)."""
    num_blocks: int | None
    """Set by the engine core once every worker reported its memory (None before)."""


class ParallelConfigView(Protocol):
    tensor_parallel_size: int
    worker_cls: str
    """Qualified name of the worker class; ``"auto"`` until the platform sets it."""

    @property
    def world_size(self) -> int: ...


class SchedulerConfigView(Protocol):
    max_num_seqs: int
    """Most requests in one step."""
    max_num_batched_tokens: int
    """Most new tokens in one step (the largest step a worker must profile)."""
    enable_chunked_prefill: bool


class DeviceConfigView(Protocol):
    device: str
    """What the user asked for (``"auto"`` or a device type)."""
    device_type: str
    """The platform's ``device_type``."""


class CompilationConfigView(Protocol):
    custom_ops: list[str]
    """Which ``CustomOp`` run their platform method: ``"all"`` / ``"none"``, then ``+name`` /
    ``-name``. A platform may rewrite it in ``check_and_update_config``."""
    enforce_eager: bool
    """True: no recorded graphs (a platform that records steps must honour it)."""
    cudagraph_capture_sizes: list[int]
    """Batch sizes whose decode steps a platform that records graphs records."""


class LoomConfigView(Protocol):
    model_config: ModelConfigView
    cache_config: CacheConfigView
    parallel_config: ParallelConfigView
    scheduler_config: SchedulerConfigView
    device_config: DeviceConfigView
    compilation_config: CompilationConfigView
