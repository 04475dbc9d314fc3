from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class LoadConfig:
    load_format: str = "auto"
    """``auto`` (by what the model path holds), ``safetensors``, ``gguf`` or ``dummy`` (random)."""

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"--load-format must be auto, safetensors, gguf or dummy, got {self.load_format!r}"
            )
