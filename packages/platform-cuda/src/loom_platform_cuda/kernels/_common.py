"""Shared helpers of the kernel wrappers: input checks and launch heuristics."""

from __future__ import annotations

import functools
import math
import os

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Read once, when the kernel modules import this one: triton.jit reads the same variable
# when it decorates them, so the two agree even if the environment changes later.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


def check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (strides {t.stride()})")


def as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """(T, ...) as a (T, features) view; rows may be strided (a slice of a fused QKV), the rest dense.

    A view, never a copy, so kernels that write in place write into ``t``.
    """
    if t.dim() < 2:
        raise ValueError(f"{name} must be (tokens, features...), got shape {tuple(t.shape)}")
    width = math.prod(t.shape[1:])
    dense = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size > 1 and stride != dense:
            raise ValueError(f"{name} must be dense after its first dim (shape {tuple(t.shape)}, "
                             f"strides {t.stride()})")
        dense *= size
    return t.as_strided((t.shape[0], width), (t.stride(0), 1))


def flatten_tokens(name: str, t: torch.Tensor) -> torch.Tensor:
    """(..., hidden) as (N, hidden), a view when the leading dims allow it (else a copy)."""
    if t.dim() < 2:
        raise ValueError(f"{name} must be (tokens, hidden) or (..., hidden), got shape {tuple(t.shape)}")
    return as_rows(name, t if t.dim() == 2 else t.reshape(-1, t.shape[-1]))


def output_rows(name: str, given: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A caller's output tensor of ``shape`` as (N, last) rows, or a new one."""
    if given is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device).view(-1, shape[-1])
    if tuple(given.shape) != tuple(shape) or given.dtype != like.dtype or given.device != like.device:
        raise ValueError(f"{name} must be {tuple(shape)} {like.dtype} on {like.device}, "
                         f"got {tuple(given.shape)} {given.dtype} on {given.device}")
    if given.dim() > 2 and not given.is_contiguous():
        raise ValueError(f"{name} with more than 2 dims must be contiguous")
    return as_rows(name, given if given.dim() == 2 else given.view(-1, shape[-1]))


def check_device(**tensors: torch.Tensor) -> None:
    """All on one device, and a CUDA one unless the interpreter runs the kernels."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device: {listing}")
    device = next(iter(devices.values()))
    if device.type != "cuda" and not INTERPRETING:
        raise ValueError(f"tensors are on {device}: the Triton kernels need a CUDA device "
                         f"(or TRITON_INTERPRET=1 set before import, for testing on CPU)")
