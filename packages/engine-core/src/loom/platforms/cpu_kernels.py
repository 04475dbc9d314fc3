"""The CPU platform's fused kernels for the replaceable ops: ``rms_norm``, ``silu_and_mul`` and
``rotary_embedding`` (``loom_plugin_api.KERNEL_SIGNATURES``), from ``cpu_kernels.c``; and
``CpuKernels.q8_linear``, the decode matmul by an 8-bit group-wise quantized weight.

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
import math
import subprocess
from importlib import resources
from types import SimpleNamespace

import torch
import torch.nn.functional as F
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
    "q8_linear": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT],
}
_Q8_MAX_ROWS = 8  # the kernel's register tiles go up to 8 rows; more is prefill, for a GEMM


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

    def q8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  group_size: int) -> torch.Tensor | None:
        """``x @ w.T`` for the 8-bit group-wise weight ``w[o, i] = (qweight[o, i] - 128) *
        scale[o, i // group_size] + zero[o, i // group_size]`` (no bias), summed in fp32, in x's
        dtype; for decode, up to 8 rows of x, reading the codes once for all of them. None where
        the kernel cannot take it (dtype, too many rows, a group size not a multiple of 16 dividing
        the input width, non-contiguous or mis-shaped weights): the caller takes another path."""
        fn = self._fns.get(("q8_linear", x.dtype))
        if fn is None or x.dim() < 1 or qweight.dim() != 2 or qweight.dtype != torch.uint8:
            return None
        n, k = qweight.shape
        groups = (n, k // group_size) if group_size > 0 else None
        rows = math.prod(x.shape[:-1])
        if (x.shape[-1] != k or rows > _Q8_MAX_ROWS or group_size <= 0 or group_size % 16 or k % group_size
                or any(t.shape != groups or t.dtype != torch.float32 or not t.is_contiguous() for t in (scale, zero))
                or not qweight.is_contiguous()
                or any(t.device.type != "cpu" for t in (x, qweight, scale, zero))):
            return None
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        if rows == 0 or n == 0:
            return out
        xr = _rows(x)
        rc = fn(xr.data_ptr(), xr.stride(0), qweight.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), n,
                rows, n, k, group_size, torch.get_num_threads())
        return None if rc else out  # nonzero: out of memory for the fp32 copy of x (the checks above cover the rest)


def _q8_dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight ``q8_linear`` multiplies by: ``(qweight - 128) * scale + zero`` per group."""
    n, k = qweight.shape
    w = (qweight.float() - 128).view(n, k // group_size, group_size) * scale[..., None] + zero[..., None]
    return w.view(n, k)


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
        # q8_linear: 3 rows, 21 outputs (full tiles and a tail), two groups of 32; against the
        # dequantized weight in fp32. Sums of 64 products differ from torch's in order only: 1e-4
        # of the outputs' scale in fp32; bf16 adds its own output rounding (2^-8 relative).
        qw = torch.randint(0, 256, (21, 64), generator=g, dtype=torch.uint8)
        sc, zp = torch.rand(21, 2, generator=g) * 0.02, torch.randn(21, 2, generator=g) * 0.01
        xq = torch.randn(3, 64, generator=g).to(dtype)
        want = F.linear(xq.float(), _q8_dequantize(qw, sc, zp, 32))
        got = k.q8_linear(xq, qw, sc, zp, 32)
        if got is None or got.dtype != dtype or got.shape != want.shape:
            raise native.NativeKernelError(f"the compiled q8_linear refused or misshaped a {dtype} problem")
        q8_tol = 1e-4 if dtype == torch.float32 else 1e-2
        if not torch.allclose(got.float(), want, rtol=q8_tol, atol=q8_tol * want.abs().max().item()):
            raise native.NativeKernelError(f"the compiled q8_linear disagrees with torch in {dtype} "
                                           f"(max error {(got.float() - want).abs().max():.3g})")


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
        logger.warning("CPU fused kernels unavailable, RMSNorm, SiLU-and-mul, rotary embedding and the 8-bit "
                       "linear run on torch ops (slower): %s. Install a C compiler with OpenMP (gcc) to enable them, or set "
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
