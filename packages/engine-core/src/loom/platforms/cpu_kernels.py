"""The CPU platform's fused kernels for the replaceable ops: ``rms_norm``, ``silu_and_mul`` and
``rotary_embedding`` (``loom_plugin_api.KERNEL_SIGNATURES``), from ``cpu_kernels.c``.

``CpuPlatform.register_triton_kernel_overrides`` calls :func:`install` in every worker: it
compiles the C file with the machine's compiler (cached next to the paged-decode kernel, see
``attention/backends/native.py``), checks each kernel against the reference op on a small
problem, and registers the three with ``CustomOp.register_kernel``; the ops' ``forward_cpu``
then calls them. No compiler, a failed build or a wrong answer logs one warning and the ops
keep their torch reference path; ``LOOM_CPU_NATIVE_KERNELS=0`` chooses that path outright.
The kernels take float32 and bfloat16 (the CPU platform's dtypes); anything else runs the
reference op.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from importlib import resources
from types import SimpleNamespace

import torch
from loom_plugin_api import CustomOp
from loom_plugin_api.ops.activation import SiluAndMul
from loom_plugin_api.ops.layernorm import RMSNorm
from loom_plugin_api.ops.rotary_embedding import RotaryEmbedding

from .. import envs
from ..attention.backends import native
from ..logger import init_logger

logger = init_logger(__name__)

__all__ = ["CpuKernels", "install", "kernels"]

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ARGTYPES = {
    "rms_norm": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _F32, _INT],
    "silu_and_mul": [_PTR, _I64, _PTR, _I64, _I64, _I64, _INT],
    "rotary": [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _INT, _INT],
}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, last dim) with a unit inner stride, a view where possible."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class CpuKernels:
    """The compiled kernels with torch-facing signatures (those of ``KERNEL_SIGNATURES``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for name, argtypes in _ARGTYPES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._fns[name, dtype] = fn

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fn = self._fns.get(("rms_norm", x.dtype))
        n = x.shape[-1]
        if (fn is None or weight.shape != (n,) or weight.dtype != x.dtype or not weight.is_contiguous() or n > 16384
                or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))):
            return _native_rms_norm(x, weight, eps, residual)  # what the kernel cannot take as rows
        xr = _rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        res_rows = res_out = None
        if residual is not None:
            res_rows, res_out = _rows(residual), torch.empty(x.shape, dtype=x.dtype)
        rows = xr.shape[0]
        fn(xr.data_ptr(), xr.stride(0), 0 if res_rows is None else res_rows.data_ptr(),
           0 if res_rows is None else res_rows.stride(0), weight.data_ptr(), out.data_ptr(), n,
           0 if res_out is None else res_out.data_ptr(), n, rows, n, eps, torch.get_num_threads())
        return out if res_out is None else (out, res_out)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        fn = self._fns.get(("silu_and_mul", x.dtype))
        d = x.shape[-1] // 2
        if fn is None or x.shape[-1] % 2:
            return SiluAndMul.forward_native(None, x)  # its reference (self unused); odd widths fail there
        xr = _rows(x)
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
        fn(xr.data_ptr(), xr.stride(0), out.data_ptr(), d, xr.shape[0], d, torch.get_num_threads())
        return out

    def rotary_embedding(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                         cos_sin_cache: torch.Tensor, is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates ``query`` and ``key`` (``(T, H*D)``, rows may be strided) in place; returns them."""
        fn = self._fns.get(("rotary", query.dtype))
        t = positions.numel()
        rot = cos_sin_cache.shape[-1]
        if (query.shape[0] != t or key.shape[0] != t or query.shape[-1] % head_size or key.shape[-1] % head_size
                or rot % 2 or rot > head_size):
            raise ValueError(f"rotary_embedding: {t} positions, query {tuple(query.shape)}, key {tuple(key.shape)}, "
                             f"head_size {head_size} and rotary_dim {rot} do not fit (T, heads * head_size) rows")
        if (fn is None or key.dtype != query.dtype or query.dim() != 2 or key.dim() != 2
                or query.stride(1) != 1 or key.stride(1) != 1):
            return _native_rotary(positions, query, key, head_size, cos_sin_cache, is_neox_style)
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else \
            positions.to(torch.int64).contiguous()
        cache = cos_sin_cache if cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1 else \
            cos_sin_cache.float().contiguous()
        rc = fn(pos.data_ptr(), query.data_ptr(), query.stride(0), query.shape[1] // head_size, key.data_ptr(),
                key.stride(0), key.shape[1] // head_size, cache.data_ptr(), cache.stride(0), cache.shape[0], t,
                head_size, cache.shape[1], int(is_neox_style), torch.get_num_threads())
        if rc:
            raise IndexError(f"a position is outside the rotary cache of {cache.shape[0]} positions")
        return query, key


def _native_rms_norm(x, weight, eps, residual=None):
    """The in-tree op's own reference (``forward_native`` reads only these two attributes)."""
    return RMSNorm.forward_native(SimpleNamespace(weight=weight, variance_epsilon=eps), x, residual)


def _native_rotary(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    """The in-tree op's reference, written back into ``query``/``key`` as the kernel does."""
    op = SimpleNamespace(cos_sin_cache=cos_sin_cache, head_size=head_size, rotary_dim=cos_sin_cache.shape[-1],
                         is_neox_style=is_neox_style)
    op._rotate = functools.partial(RotaryEmbedding._rotate, op)
    q, k = RotaryEmbedding.forward_native(op, positions, query, key)
    query.copy_(q)
    key.copy_(k)
    return query, key


def _self_check(k: CpuKernels) -> None:
    """Each kernel against the reference op on a small problem, per dtype."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x, r = (torch.randn(5, 40, generator=g).to(dtype) for _ in range(2))
        w = torch.randn(40, generator=g).to(dtype)
        checks = [("rms_norm", k.rms_norm(x, w, 1e-6, r), _native_rms_norm(x, w, 1e-6, r)),
                  ("silu_and_mul", k.silu_and_mul(x), SiluAndMul.forward_native(None, x))]
        qkv = torch.randn(3, 6 * 16, generator=g).to(dtype)
        cache = torch.randn(8, 12, generator=g)
        pos = torch.tensor([7, 0, 3])
        for neox in (True, False):
            want = _native_rotary(pos, qkv[:, :64].clone(), qkv[:, 64:].clone(), 16, cache, neox)
            q, kk = qkv[:, :64].clone(), qkv[:, 64:].clone()
            checks.append(("rotary_embedding", k.rotary_embedding(pos, q, kk, 16, cache, neox), want))
        for name, got, want in checks:
            for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol):
                    raise native.NativeKernelError(f"the compiled {name} disagrees with torch in {dtype} "
                                                   f"(max error {(a.float() - b.float()).abs().max():.3g})")


@functools.cache
def kernels() -> CpuKernels | None:
    """The compiled kernels, or None (the reason logged once) where they cannot be had."""
    if not envs.LOOM_CPU_NATIVE_KERNELS:
        return None
    try:
        source = resources.files(__package__).joinpath("cpu_kernels.c").read_bytes()
        k = CpuKernels(ctypes.CDLL(native._build(native._compiler(), source, "cpu_kernels", "the CPU fused ops")))
        _self_check(k)
        return k
    except (native.NativeKernelError, OSError, subprocess.SubprocessError, AttributeError) as e:
        logger.warning("CPU fused kernels unavailable, RMSNorm, SiLU-and-mul and rotary embedding run on torch "
                       "ops (slower): %s. Install a C compiler with OpenMP (gcc) to enable them, or set "
                       "LOOM_CPU_NATIVE_KERNELS=0 to silence this.", e)
        return None


def install() -> bool:
    """Register the kernels behind the ops' ``forward_cpu``; whether they are in place."""
    k = kernels()
    if k is None:
        return False
    CustomOp.register_kernel("rms_norm", k.rms_norm)
    CustomOp.register_kernel("silu_and_mul", k.silu_and_mul)
    CustomOp.register_kernel("rotary_embedding", k.rotary_embedding)
    return True
