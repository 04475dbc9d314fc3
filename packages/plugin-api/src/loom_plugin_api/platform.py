"""The ``Platform`` base class: what a hardware vendor implements.

A platform plugin's detector (entry-point group ``loom.platform_plugins``) returns the
dotted qualified name of a ``Platform`` subclass, or None when its device is absent.
Every process of a serve resolves the platform once, on first use of
``loom.platforms.current_platform``, and makes one instance of the winning class.

Hooks are class methods. Each docstring says when it runs, in which process and how
often, and what it may change. A hook that the base class implements as a no-op may be
left alone.
"""

from __future__ import annotations

import argparse
import enum
import os
import random
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from .attention import AttentionSelectorConfig
    from .config import LoomConfigView

__all__ = ["Platform", "PlatformEnum"]


class PlatformEnum(enum.Enum):
    CPU = enum.auto()
    CUDA = enum.auto()
    OOT = enum.auto()
    UNSPECIFIED = enum.auto()


class Platform:
    """Base class of every platform. Subclasses set the identity fields below."""

    _enum: ClassVar[PlatformEnum] = PlatformEnum.UNSPECIFIED
    device_name: ClassVar[str] = "unspecified"
    device_type: ClassVar[str] = "unspecified"
    """torch device type that tensors are allocated on (``"cpu"``, ``"cuda"``, ...)."""
    dispatch_key: ClassVar[str] = "CPU"
    dist_backend: ClassVar[str] = "gloo"
    """``torch.distributed`` backend for tensor-parallel collectives."""
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    """Model dtypes the platform computes in, by torch name (names, not ``torch.dtype``s,
    so that processes which never compute need not import torch)."""
    ray_device_key: ClassVar[str] = "CPU"
    """The Ray resource one tensor-parallel rank takes on this platform (one unit of it per
    rank in the placement group of ``--distributed-executor-backend ray``): ``"CPU"`` for a
    host platform, ``"GPU"`` for CUDA, or a custom resource the vendor's nodes advertise
    (``ray start --resources '{"MYNPU": 8}'``). The worker of a rank on Ray gets
    ``local_rank=0``: Ray makes the one device of the actor's bundle its only visible device
    for the accelerators it knows (``CUDA_VISIBLE_DEVICES`` for GPUs); a platform whose
    resource Ray does not isolate picks the device itself."""
    supports_tensor_parallel: ClassVar[bool] = False
    """Whether the platform's worker and communicator run ``--tensor-parallel-size`` > 1
    (the engine refuses it otherwise, and the conformance kit skips its two-rank checks)."""

    # ---- identity -------------------------------------------------------------------
    def is_cpu(self) -> bool:
        return self._enum is PlatformEnum.CPU

    def is_cuda(self) -> bool:
        return self._enum is PlatformEnum.CUDA

    def is_out_of_tree(self) -> bool:
        return self._enum is PlatformEnum.OOT

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_name={self.device_name!r}, device_type={self.device_type!r})"

    # ---- configuration hooks (stops 5-7 of the start-up) ---------------------------
    @classmethod
    def pre_register_and_update(cls, parser: argparse.ArgumentParser | None = None) -> None:
        """Register platform-specific things before the engine config exists.

        Runs in the CLI / ``LLM`` process: once with each engine-argument parser that is
        built (``parser`` given, after the general plugins ran, so a platform can add
        choices to flags) and once more without a parser when the config is created.
        It therefore runs several times per process and must be idempotent.
        """

    @classmethod
    def apply_config_platform_defaults(cls, config: LoomConfigView) -> None:
        """Fill platform defaults into a ``LoomConfig`` while it is being built.

        Runs once per config, in the process that creates it, before the base
        ``custom_ops`` entry is added and before :meth:`check_and_update_config`.
        Only set fields the user left at their defaults.
        """

    @classmethod
    def check_and_update_config(cls, config: LoomConfigView) -> None:
        """The platform's last word on a ``LoomConfig``.

        Runs once per config at the end of its construction, in the process that creates
        it; the config then travels to the other processes as it is. A platform sets
        ``config.parallel_config.worker_cls`` here (a qualified name) when it is
        ``"auto"``, and may change ``config.compilation_config.custom_ops``,
        ``config.cache_config.block_size`` and the dtype. Raise ``ValueError`` with a
        message for the user when the config cannot run on this platform.
        """

    @classmethod
    def validate_environ(cls, fail: bool) -> None:
        """Check environment variables the platform depends on.

        Runs once per config creation, right after the device config is made. With
        ``fail`` raise on a problem, otherwise log a warning.
        """

    @classmethod
    def update_block_size_for_backend(cls, config: LoomConfigView) -> None:
        """Pick a KV-cache block size that every attention backend of the model accepts.

        The runtime calls it in each worker right after ``load_model`` (a worker does not call
        it itself), before the KV cache is sized. Only change
        ``config.cache_config.block_size``, and only when the user did not set one
        (``config.cache_config.user_block_size`` is False).
        """

    # ---- worker-side hooks -----------------------------------------------------------
    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """Replace core kernels before any worker or model code launches them
        (``CustomOp.register_kernel``: Triton kernels on a GPU, compiled ones on a CPU).

        Runs once at the start of every worker process, after the general plugins.
        """

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: str | None,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        """Return the qualified name of the ``AttentionBackend`` subclass to use.

        Asked by the attention selector while a worker builds the model, once for each
        distinct argument set (the selector caches the answer). ``selected_backend`` is
        the backend name the user forced (``LOOM_ATTENTION_BACKEND``), or None. An
        out-of-tree platform is also asked once where the config is finished (the CLI or
        ``LLM`` process, ``selected_backend`` None), so that a name that does not import or
        does not subclass ``AttentionBackend`` stops the serve before anything is spawned.
        """
        raise NotImplementedError(f"{cls.__name__} does not provide an attention backend")

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """Qualified name of the device communicator for tensor-parallel collectives.

        Asked by a worker that sets up a tensor-parallel group of more than one rank, and,
        for an out-of-tree platform, once where the config is finished, to check that the
        name imports and subclasses ``DeviceCommunicatorBase``.
        """
        return "loom_plugin_api.communicator.TorchDistributedCommunicator"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """Total memory of the device in bytes."""
        raise NotImplementedError

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        """Bytes a worker may still allocate on the device (used to size the KV cache)."""
        raise NotImplementedError

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Make ``device`` current for this worker process. Called once by ``init_device``."""

    @classmethod
    def seed_everything(cls, seed: int | None) -> None:
        """Seed every random generator this platform's computation uses."""
        if seed is None:
            return
        import torch  # lazy: the platform class loads in processes that never compute; only workers seed

        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np  # lazy: optional dependency (the contract does not require numpy)

            np.random.seed(seed)
        except ImportError:  # numpy is optional for the contract
            pass
        os.environ.setdefault("PYTHONHASHSEED", str(seed))
