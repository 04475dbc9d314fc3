from __future__ import annotations

from .cache import CacheConfig
from .compilation import CompilationConfig
from .device import DeviceConfig
from .load import LoadConfig
from .loom import LoomConfig
from .lora import LoRAConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "DeviceConfig",
    "LoRAConfig",
    "LoadConfig",
    "LoomConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
]
