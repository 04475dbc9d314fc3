"""loom's CUDA platform: ``CudaPlatform``, its GPU worker, an NCCL communicator and the
Triton kernels (``loom_platform_cuda.kernels``) that its attention backend and loom's
CustomOps run on the GPU.

Nothing here is imported until loom's built-in ``cuda`` detector names
``loom_platform_cuda.platform.CudaPlatform``, so installing the wheel on a host without a
GPU costs nothing: the detector answers None with its reason and the CPU platform serves.
"""

from __future__ import annotations

__version__ = "0.1.0"
