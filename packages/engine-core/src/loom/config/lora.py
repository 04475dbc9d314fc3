"""LoRAConfig: serving adapters on the base model (``--enable-lora`` and its limits)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_RANK_LIMIT = 512


@dataclass(slots=True, kw_only=True)
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 1
    """Distinct adapters one step may hold (the slots each adapted layer keeps)."""
    max_lora_rank: int = 16
    """Largest adapter rank; every slot is this wide."""
    max_cpu_loras: int | None = None
    """Adapters each worker keeps loaded (least recently used evicted); default: ``max_loras``."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ValueError(f"--max-lora-rank must be between 1 and {MAX_LORA_RANK_LIMIT}, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras}): "
                             "a step's adapters must all be loaded")
