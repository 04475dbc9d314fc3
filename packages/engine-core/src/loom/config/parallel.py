from __future__ import annotations

import importlib.util
from dataclasses import dataclass

EXECUTOR_BACKENDS = ("mp", "ray")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RAY_DRIVER_ENV = {"RAY_DEDUP_LOGS": "0"}
"""Set (unless already set) where the Ray driver imports Ray: every rank's lines, each under its
own prefix, instead of identical lines folded into one "[repeated 2x across cluster]"."""


@dataclass(slots=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    worker_cls: str = "auto"
    """Qualified name of the worker class; a platform sets it in check_and_update_config."""
    distributed_executor_backend: str = "mp"
    """``mp``: one worker process per rank under this machine's supervisor (a single rank runs
    in the engine's process). ``ray``: one Ray actor per rank, on the nodes of a Ray cluster."""
    ray_address: str | None = None
    """The cluster to join (``ray.init(address=...)``); None: ``RAY_ADDRESS``, else a running
    local cluster, else a new local one."""
    ray_placement_strategy: str = "PACK"
    ray_placement_timeout: float = 60.0
    """Seconds to wait for the placement group's resources before start-up fails."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(f"--ray-placement-strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}, "
                             f"got {self.ray_placement_strategy!r}")
        if self.uses_ray and importlib.util.find_spec("ray") is None:
            raise ValueError("--distributed-executor-backend ray needs Ray, which is not installed here: "
                             "pip install 'loom-engine[ray]'")
        if not self.ray_placement_timeout > 0:
            raise ValueError(f"--ray-placement-timeout must be > 0 seconds, got {self.ray_placement_timeout}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def uses_ray(self) -> bool:
        return self.distributed_executor_backend == "ray"
