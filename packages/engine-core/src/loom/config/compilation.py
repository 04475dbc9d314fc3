from __future__ import annotations

from dataclasses import dataclass, field

from loom_plugin_api.switches import resolve_custom_ops

# Decode batch sizes a GPU platform records as CUDA graphs (a batch runs in the smallest
# graph that holds it; larger batches run eagerly).
DEFAULT_CUDAGRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]


@dataclass(slots=True, kw_only=True)
class CompilationConfig:
    """How the model runs: which CustomOp implementations, and whether steps are recorded
    as graphs (platforms that cannot record graphs ignore the graph fields)."""

    custom_ops: list[str] = field(default_factory=list)
    """``all``/``none`` base plus ``+name``/``-name`` switches for CustomOps."""
    enforce_eager: bool = False
    """Never record graphs (``--enforce-eager``)."""
    cudagraph_capture_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_CUDAGRAPH_SIZES))

    def __post_init__(self) -> None:
        resolve_custom_ops(self.custom_ops)  # raises on +x and -x together, or a bad entry
        if any(size < 1 for size in self.cudagraph_capture_sizes):
            raise ValueError(f"graph capture sizes must be >= 1, got {self.cudagraph_capture_sizes}")
