from __future__ import annotations

from dataclasses import dataclass, field

from loom_plugin_api.switches import resolve_custom_ops


@dataclass(slots=True, kw_only=True)
class CompilationConfig:
    custom_ops: list[str] = field(default_factory=list)
    """``all``/``none`` base plus ``+name``/``-name`` switches for CustomOps."""

    def __post_init__(self) -> None:
        resolve_custom_ops(self.custom_ops)  # raises on +x and -x together, or a bad entry
