"""A worker's start-up, the same wherever the rank runs: a process of ``loom serve``
(:mod:`.proc`) or a Ray actor (:mod:`.ray_actor`).

The caller has resolved the platform and run the general plugins (stop 10) before it calls
:func:`build_worker`: let the platform replace Triton kernels, resolve ``worker_cls`` by name
and build it with the engine's services, ``init_device``, ``load_model`` and the platform's
``update_block_size_for_backend`` (stops 11-14). :func:`offer` is what the rank tells the
engine about its memory; :func:`allocate` takes the engine's answer.
"""

from __future__ import annotations

from loom_plugin_api import WorkerBase
from loom_plugin_api.tracing import span

from ..config import LoomConfig
from ..ipc.messages import WorkerInfo
from ..logger import init_logger
from ..platforms import current_platform
from .resolve import resolve_worker_cls
from .services import EngineWorkerServices

logger = init_logger("loom.worker")


def build_worker(config: LoomConfig, rank: int, distributed_init_method: str | None,
                 local_rank: int | None = None) -> WorkerBase:
    """``local_rank`` (the device index this process uses) defaults to ``rank``: every rank of a
    serve on this machine sees every device."""
    with span("platform hook register_triton_kernel_overrides"):
        current_platform.register_triton_kernel_overrides()
    with span("resolve worker class", worker_cls=config.parallel_config.worker_cls):
        worker_cls = resolve_worker_cls(config.parallel_config.worker_cls)
    logger.info("Worker rank %d resolved worker class %s", rank, config.parallel_config.worker_cls)
    with span("construct worker"):
        worker = worker_cls(
            config, local_rank=rank if local_rank is None else local_rank, rank=rank,
            distributed_init_method=distributed_init_method,
            is_driver_worker=rank == 0, services=EngineWorkerServices(),
        )
    with span("init_device"):
        worker.init_device()
    with span("load_model"):
        worker.load_model()
    with span("platform hook update_block_size_for_backend"):
        current_platform.update_block_size_for_backend(config)
    return worker


def offer(worker: WorkerBase, config: LoomConfig, rank: int) -> WorkerInfo:
    """The memory this rank can give the KV cache, and what one block costs it."""
    with span("determine_available_memory"):
        available = worker.determine_available_memory()
    return WorkerInfo(rank=rank, available_bytes=available,
                      block_bytes=worker.get_kv_cache_block_bytes(), block_size=config.cache_config.block_size)


def allocate(worker: WorkerBase, config: LoomConfig, num_blocks: int) -> None:
    config.cache_config.num_blocks = num_blocks
    with span("initialize_cache", num_blocks=num_blocks):
        worker.initialize_cache(num_blocks)
