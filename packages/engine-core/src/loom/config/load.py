from __future__ import annotations

from dataclasses import dataclass

from ..model_loader import load_format_choices


@dataclass(slots=True, kw_only=True)
class LoadConfig:
    load_format: str = "auto"
    """``auto`` (by what the model path holds), ``safetensors``, ``gguf``, ``dummy`` (random), or a
    format a general plugin registered (``loom.model_loader.register_weight_loader``)."""

    def __post_init__(self) -> None:
        if self.load_format not in load_format_choices():
            raise ValueError(
                f"--load-format must be one of {', '.join(load_format_choices())}, got {self.load_format!r}"
            )
