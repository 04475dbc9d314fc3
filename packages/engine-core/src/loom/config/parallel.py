from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    worker_cls: str = "auto"
    """Qualified name of the worker class; a platform sets it in check_and_update_config."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size
