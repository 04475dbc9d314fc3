"""loom's plugin contract.

Vendors and model authors depend on this package (``loom-plugin-api>=1,<2``), never on
engine internals. Docstrings here are the specification: when each hook runs, in which
process, how often, and what it may change.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._groups import (
    ENDPOINT_PLUGINS_GROUP,
    GENERAL_PLUGINS_GROUP,
    PLATFORM_PLUGINS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
)
from ._qualname import resolve_obj_by_qualname
from .attention import AttentionBackend, AttentionImpl, AttentionMetadata, AttentionSelectorConfig
from .communicator import DeviceCommunicatorBase, TorchDistributedCommunicator
from .config import (
    CacheConfigView,
    CompilationConfigView,
    DeviceConfigView,
    LoomConfigView,
    ModelConfigView,
    ParallelConfigView,
    SchedulerConfigView,
)
from .context import (
    current_lora_mapping,
    get_current_config,
    get_current_platform,
    get_forward_context,
    set_current_config,
    set_forward_context,
)
from .errors import CustomOpError, ModelRegistryError, PlatformError, PluginError
from .host_platform import HostPlatform
from .loader import load_general_plugins, load_plugins_by_group, load_plugins_strict, plugin_records
from .lora import LoRARequest, LoRAResolver, LoRAResolverRegistry, lora_resolver_registry
from .model_registry import ModelInfo, ModelRegistry
from .platform import Platform, PlatformEnum
from .sampling_params import SamplingParams
from .step import (
    ModelInput,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SampledLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from .validation import installed_contract_version, validate_platform_cls, validate_worker_cls
from .worker import WorkerBase, WorkerServices

if TYPE_CHECKING:
    from .cpu_worker import CPUWorker
    from .custom_op import CustomOp
    from .model_runner import ModelRunner

# Names that need torch load on first use. The front end and the engine core never
# compute, and importing torch would cost each of them seconds of start-up and ~250 MB.
_LAZY = {"CustomOp": "custom_op", "ModelRunner": "model_runner", "CPUWorker": "cpu_worker"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loom_plugin_api' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__version__ = "1.1.0"

__all__ = [
    "ENDPOINT_PLUGINS_GROUP",
    "GENERAL_PLUGINS_GROUP",
    "PLATFORM_PLUGINS_GROUP",
    "STAT_LOGGER_PLUGINS_GROUP",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionSelectorConfig",
    "CPUWorker",
    "CacheConfigView",
    "CompilationConfigView",
    "CustomOp",
    "CustomOpError",
    "DeviceCommunicatorBase",
    "DeviceConfigView",
    "HostPlatform",
    "LoRARequest",
    "LoRAResolver",
    "LoRAResolverRegistry",
    "LoomConfigView",
    "ModelConfigView",
    "ModelInfo",
    "ModelInput",
    "ModelRegistry",
    "ModelRegistryError",
    "ModelRunner",
    "ModelRunnerOutput",
    "NewRequestData",
    "ParallelConfigView",
    "Platform",
    "PlatformEnum",
    "PlatformError",
    "PluginError",
    "PromptLogprobs",
    "SampledLogprobs",
    "SamplingParams",
    "ScheduledRequest",
    "SchedulerConfigView",
    "SchedulerOutput",
    "TorchDistributedCommunicator",
    "WorkerBase",
    "WorkerServices",
    "current_lora_mapping",
    "get_current_config",
    "get_current_platform",
    "get_forward_context",
    "installed_contract_version",
    "load_general_plugins",
    "load_plugins_by_group",
    "load_plugins_strict",
    "lora_resolver_registry",
    "plugin_records",
    "resolve_obj_by_qualname",
    "set_current_config",
    "set_forward_context",
    "validate_platform_cls",
    "validate_worker_cls",
]
