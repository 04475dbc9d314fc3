"""The CPU platform's fused kernels for the replaceable ops: ``rms_norm``, ``silu_and_mul`` and
``rotary_embedding`` (``loom_plugin_api.KERNEL_SIGNATURES``), from ``cpu_kernels.c``; and
``CpuKernels.q8_linear`` and ``CpuKernels.q4_linear``, the decode matmuls by an 8-bit and a 4-bit
group-wise quantized weight (the 4-bit codes packed once by :func:`pack_q4`); and
``row_argmax``, the running max of greedy sampling over the LM head's vocabulary chunks (also a
``KERNEL_SIGNATURES`` entry, which ``layers/logits_processor.py`` looks up).

``CpuPlatform.register_triton_kernel_overrides`` calls :func:`install` in every worker: it
compiles the C file with the machine's compiler (cached next to the paged-decode kernel, see
``attention/backends/native.py``), checks each kernel against the reference op on a small
problem, and registers the four with ``CustomOp.register_kernel``; the ops' ``forward_cpu``
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
from . import cpu_gemm, cpu_qdot

logger = init_logger(__name__)

__all__ = ["CpuKernels", "PackedQ4", "PackedQ8", "install", "kernels", "pack_q4", "unpack_q4"]

PackedQ8 = cpu_qdot.PackedQ8

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ARGTYPES = {
    "rms_norm": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _F32, _INT],
    "silu_and_mul": [_PTR, _I64, _PTR, _I64, _I64, _I64, _INT],
    "rotary": [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _INT, _INT],
    "q8_linear": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT],
    "q4_linear": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT],
    "row_argmax": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "gather_rows": [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _INT],
    "qa_linear": [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT],
}
# q4_linear_bf16 takes the bf16 (scale, zero) pairs as one array: no separate zero pointer
_ARGTYPES_BF16 = {"q4_linear": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT]}
_Q8_MAX_ROWS = 8  # the kernel's register tiles go up to 8 rows; more is prefill, for a GEMM


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, last dim) with a unit inner stride, a view where possible."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _pack_codes(qweight: torch.Tensor) -> torch.Tensor:
    n, k = qweight.shape
    full = k // 64 * 64
    q = qweight.contiguous()
    parts = [q[:, :full].reshape(n, k // 64, 2, 32)]
    if full < k:
        parts.append(q[:, full:].reshape(n, 1, 2, 16))
    packed = [(p[:, :, 0] & 15) | (p[:, :, 1] << 4) for p in parts]
    return torch.cat([p.reshape(n, -1) for p in packed], dim=1).contiguous()


def _unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape[0], codes.shape[1] * 2
    full = k // 64 * 64
    parts = [codes[:, :full // 2].reshape(n, k // 64, 1, 32)]
    if full < k:
        parts.append(codes[:, full // 2:].reshape(n, 1, 1, 16))
    out = [torch.cat([p & 15, p >> 4], dim=2) for p in parts]
    return torch.cat([c.reshape(n, -1) for c in out], dim=1)


class PackedQ4:
    """A 4-bit group-wise weight ``w[o, i] = (q[o, i] - 8) * scale[o, i // G] + zero[o, i // G]``
    as :func:`pack_q4` lays it out for ``CpuKernels.q4_linear`` with activations of ``dtype``:

    - ``codes``: uint8 (N, bytes). ``layout`` 0: (N, K / 2), each row in chunks of 64 codes, 32
      bytes, byte m = ``c[m] | c[32 + m] << 4``, and a last chunk of 32 codes, 16 bytes, byte m =
      ``c[m] | c[16 + m] << 4``, where K % 64 is 32. ``layout`` 1 (groups of 32 only): the order
      of ``cpu_qdot.c``, whose kernels quantize x to int8 (see ``cpu_qdot.py``);
    - float32: ``scale`` and ``zero`` float32 (N, K / G), as given (exact);
    - bfloat16: ``scale_zero`` int32 (N, K / G), each the pair (bf16 scale in the low 16 bits,
      bf16 zero in the high), read with the codes in one stream; ``scale`` and ``zero`` None. The
      weight is then exact to within the bf16 rounding of scale and zero, as torch's int4 kernel
      (which takes them in the activations' dtype).

    ``n``, ``k``, ``group_size`` and ``dtype`` are the shape, group and activation dtype.
    """

    __slots__ = ("codes", "scale", "zero", "scale_zero", "group_size", "dtype", "n", "k", "layout")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                 scale_zero: torch.Tensor | None, group_size: int, dtype: torch.dtype, k: int, layout: int = 0) -> None:
        self.codes, self.scale, self.zero, self.scale_zero = codes, scale, zero, scale_zero
        self.group_size, self.dtype, self.layout = group_size, dtype, layout
        self.n, self.k = codes.shape[0], k

    def __repr__(self) -> str:
        return (f"PackedQ4(n={self.n}, k={self.k}, group_size={self.group_size}, dtype={self.dtype}, "
                f"layout={self.layout})")


def pack_q4(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            dtype: torch.dtype, layout: int = 0) -> PackedQ4:
    """The weight ``(q - 8) * scale + zero`` per group (q uint8 (N, K), values 0..15, K a multiple
    of 32; scale and zero (N, K / G), G = K / their width a multiple of 32) packed for
    ``CpuKernels.q4_linear`` on activations of ``dtype`` (float32 or bfloat16) in ``layout`` 0 or
    1 (1: groups of 32 only; ``CpuKernels.pack_q4`` picks the one its kernels run): a
    :class:`PackedQ4`. Done once, at load."""
    if not (qweight.is_cpu and scale.is_cpu and zero.is_cpu):
        raise ValueError("pack_q4 packs CPU tensors")
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.shape[1] % 32:
        raise ValueError(f"pack_q4 takes uint8 (N, K) codes with K a multiple of 32, not {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, k = qweight.shape
    if (scale.dim() != 2 or scale.shape != zero.shape or scale.shape[0] != n or not scale.shape[1]
            or k % scale.shape[1] or (k // scale.shape[1]) % 32):
        raise ValueError(f"pack_q4 takes scale and zero (N, K / G), G a multiple of 32 dividing K = {k}, not "
                         f"{tuple(scale.shape)} and {tuple(zero.shape)} for {n} outputs")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack_q4 packs for float32 or bfloat16 activations, not {dtype}")
    group = k // scale.shape[1]
    if layout not in (0, 1) or (layout == 1 and group != cpu_qdot.GROUP):
        raise ValueError(f"pack_q4 packs layout 0, or layout 1 for groups of {cpu_qdot.GROUP}; not layout {layout} "
                         f"for groups of {group}")
    codes = _pack_codes(qweight) if layout == 0 else cpu_qdot.pack_codes(qweight, 4)
    if dtype == torch.float32:
        return PackedQ4(codes, scale.float().contiguous(), zero.float().contiguous(), None, group, dtype, k, layout)
    pairs = torch.stack([scale.to(torch.bfloat16).view(torch.int16), zero.to(torch.bfloat16).view(torch.int16)], -1)
    return PackedQ4(codes, None, None, pairs.contiguous().view(torch.int32).view(n, -1), group, dtype, k, layout)


def unpack_q4(packed: PackedQ4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`pack_q4` packed, as ``q4_linear`` uses it: the codes uint8 (N, K), and scale and
    zero float32 (N, K / G) (for bfloat16, the bf16-rounded values)."""
    q = _unpack_codes(packed.codes) if packed.layout == 0 else cpu_qdot.unpack_codes(packed.codes, packed.k, 4)
    if packed.scale_zero is None:
        return q, packed.scale, packed.zero
    pairs = packed.scale_zero.view(torch.int16).view(packed.n, -1, 2).view(torch.bfloat16)
    return q, pairs[..., 0].float(), pairs[..., 1].float()


class CpuKernels:
    """The compiled kernels with torch-facing signatures (those of ``KERNEL_SIGNATURES``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for name, argtypes in _ARGTYPES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{suffix}")
                if dtype == torch.bfloat16:
                    argtypes = _ARGTYPES_BF16.get(name, argtypes)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._fns[name, dtype] = fn
        self._q4 = {dtype: self._fns["q4_linear", dtype] for dtype in _SUFFIX}  # one lookup per call
        self._qa = {dtype: self._fns["qa_linear", dtype] for dtype in _SUFFIX}
        self.int8_compiled = bool(lib.qa_available())  # cpu_qdot.c's kernels: the CPU has AVX512-VNNI
        self.tape_run = lib.tape_run  # cpu_tape.c: a recorded step's calls in one (cpu_step_replay)
        self.tape_run.argtypes, self.tape_run.restype = [_PTR, _I64, _PTR], ctypes.c_int
        self.tape_op_size = int(lib.tape_op_size())
        # cpu_gemm.c: the fp32 linear layer on AVX2 + FMA, the bf16 one on AVX512-BF16 (layers/onednn.py
        # decides where they run)
        gemm = cpu_gemm.PanelGemm(lib)
        self.panel_linear: cpu_gemm.PanelGemm | None = gemm if gemm.dtypes else None

    @property
    def int8_activations(self) -> bool:
        """Whether weights packed now run the int8-activation kernels (compiled in, and not turned
        off by ``LOOM_CPU_INT8_ACTIVATIONS=0``); a packed weight keeps the choice made at its packing."""
        return self.int8_compiled and envs.LOOM_CPU_INT8_ACTIVATIONS

    def pack_q4(self, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> PackedQ4:
        """:func:`pack_q4` in the layout these kernels run fastest: 1 (int8 activations) for groups
        of 32 where they are compiled in and enabled, else 0."""
        group = qweight.shape[1] // scale.shape[1] if scale.dim() == 2 and scale.shape[1] else 0
        return pack_q4(qweight, scale, zero, dtype, int(self.int8_activations and group == cpu_qdot.GROUP))

    def pack_q8(self, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> PackedQ8 | None:
        """An 8-bit weight packed for :meth:`q8a_linear`, or None where it runs ``q8_linear`` on the
        codes as they are (no int8 activations here, or groups other than 32)."""
        if not self.int8_activations or group_size != cpu_qdot.GROUP:
            return None
        return cpu_qdot.pack_q8(qweight, scale, zero)

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
        native.call(fn, xr.data_ptr(), xr.stride(0), 0 if res_rows is None else res_rows.data_ptr(),
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
        native.call(fn, xr.data_ptr(), xr.stride(0), out.data_ptr(), d, xr.shape[0], d, torch.get_num_threads())
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
        rc = native.call(fn, pos.data_ptr(), query.data_ptr(), query.stride(0), query.shape[1] // head_size, key.data_ptr(),
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
        rc = native.call(fn, xr.data_ptr(), xr.stride(0), qweight.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), n,
                rows, n, k, group_size, torch.get_num_threads())
        return None if rc else out  # nonzero: out of memory for the fp32 copy of x (the checks above cover the rest)


    def row_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``x.max(dim=-1)`` of a (rows, n) CPU tensor with a unit inner stride, n >= 1: the
        largest value of each row (float32) and the index of its first occurrence (int64); None
        where the kernel cannot take it (dtype, shape, strides, device). A NaN never wins here."""
        fn = self._fns.get(("row_argmax", x.dtype))
        if fn is None or x.dim() != 2 or not x.is_cpu or x.stride(1) != 1 or not x.shape[1]:
            return None
        rows = x.shape[0]
        val = torch.empty(rows, dtype=torch.float32)
        idx = torch.empty(rows, dtype=torch.int64)
        if rows:
            native.call(fn, x.data_ptr(), x.stride(0), rows, x.shape[1], val.data_ptr(), idx.data_ptr(), torch.get_num_threads())
        return val, idx

    def gather_rows(self, chunks: torch.Tensor, chunk_rows: int, row_offset: torch.Tensor, col_stride: int,
                    group: int, cols: int, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` of a table kept in chunks of ``chunk_rows`` rows at the addresses in
        ``chunks`` (int64), element ``i`` of row ``r`` at ``row_offset[r] + (i // group) *
        col_stride + i % group`` elements into its chunk: ``(len(ids), cols)`` in ``dtype``. The
        caller keeps the chunks alive and the layout true (``layers/onednn.py``); this checks the
        ids. None for a dtype the kernel lacks; IndexError for an id outside the table, and
        RuntimeError for ids that are not integers, as ``F.embedding``."""
        fn = self._fns.get(("gather_rows", dtype))
        if fn is None:
            return None
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise RuntimeError(f"embedding ids must be integers (int64 or int32), not {ids.dtype}")
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), cols, dtype=dtype)
        if native.call(fn, chunks.data_ptr(), chunk_rows, row_offset.data_ptr(), col_stride, group, cols,
                       row_offset.numel(), ids.data_ptr(), ids.numel(), out.data_ptr(), torch.get_num_threads()):
            raise IndexError(f"token id out of range: the embedding has {row_offset.numel()} rows")
        return out

    def q4_linear(self, x: torch.Tensor, packed: PackedQ4) -> torch.Tensor | None:
        """``x @ w.T`` for the 4-bit group-wise weight ``packed = pack_q4(q, scale, zero, x.dtype)``
        (no bias), summed in fp32, in x's dtype, for up to 8 rows of x (decode). None where the
        kernel cannot take it (x's dtype not the one packed for, too many rows, a width mismatch, a
        device other than the CPU): the caller takes another path. Called once per layer per decoded
        token, so the checks are the few that keep the kernel inside its buffers, each a cheap
        attribute (:func:`pack_q4` made the weight's tensors contiguous and consistent)."""
        fn = self._q4.get(x.dtype)
        if fn is None or packed.dtype != x.dtype:
            return None
        n, k = packed.n, packed.k
        if x.ndim == 2 and x.stride(1) == 1:  # decode's (rows, K): no reshape
            xr, rows, shape = x, x.shape[0], None
        else:
            if x.ndim == 0:
                return None
            xr, shape = _rows(x), (*x.shape[:-1], n)
            rows = xr.shape[0]
        if xr.shape[1] != k or rows > _Q8_MAX_ROWS or not x.is_cpu:
            return None
        out = torch.empty(rows, n, dtype=x.dtype)
        if rows and n:
            if packed.layout == 1:
                sz = packed.scale_zero
                rc = native.call(self._qa[x.dtype], 4, xr.data_ptr(), xr.stride(0), packed.codes.data_ptr(),
                                 0 if sz is None else sz.data_ptr(), 0 if sz is not None else packed.scale.data_ptr(),
                                 0 if sz is not None else packed.zero.data_ptr(), out.data_ptr(), n, rows, n, k,
                                 torch.get_num_threads())
            elif packed.scale_zero is None:
                rc = native.call(fn, xr.data_ptr(), xr.stride(0), packed.codes.data_ptr(), packed.scale.data_ptr(),
                        packed.zero.data_ptr(), out.data_ptr(), n, rows, n, k, packed.group_size,
                        torch.get_num_threads())
            else:
                rc = native.call(fn, xr.data_ptr(), xr.stride(0), packed.codes.data_ptr(), packed.scale_zero.data_ptr(),
                        out.data_ptr(), n, rows, n, k, packed.group_size, torch.get_num_threads())
            if rc:
                return None  # out of memory for the group sums (the checks above cover the rest)
        return out if shape is None else out.view(shape)


    def q8a_linear(self, x: torch.Tensor, packed: PackedQ8) -> torch.Tensor | None:
        """``x @ w.T`` for the 8-bit weight :meth:`pack_q8` packed, x quantized to int8 per group of
        32 (``cpu_qdot.c``), in x's dtype, for up to 8 rows; None where the kernel cannot take it."""
        fn = self._qa.get(x.dtype)
        if fn is None or x.ndim == 0 or x.shape[-1] != packed.k or not x.is_cpu:
            return None
        xr = _rows(x)
        rows, n = xr.shape[0], packed.n
        if rows > _Q8_MAX_ROWS:
            return None
        out = torch.empty(rows, n, dtype=x.dtype)
        if rows and n:
            zero = packed.zero
            rc = native.call(fn, 8, xr.data_ptr(), xr.stride(0), packed.codes.data_ptr(), 0, packed.scale.data_ptr(),
                             0 if zero is None else zero.data_ptr(), out.data_ptr(), n, rows, n, packed.k,
                             torch.get_num_threads())
            if rc:
                return None
        return out.view(*x.shape[:-1], n)


def _q4_dequantize(packed: PackedQ4) -> torch.Tensor:
    """The fp32 weight ``q4_linear`` multiplies by: ``(q - 8) * scale + zero`` per group."""
    q, scale, zero = unpack_q4(packed)
    n, k, group = packed.n, packed.k, packed.group_size
    w = (q.float() - 8).view(n, k // group, group) * scale[..., None] + zero[..., None]
    return w.view(n, k)


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
        # row_argmax: a tie inside a row (the first index wins), a row of -inf, a tail of 8
        am = torch.randn(4, 40, generator=g).to(dtype)
        am[1, 3] = am[1, 37] = am[1].max() + 1
        am[2] = float("-inf")
        val, idx = torch.max(am, dim=-1)
        checks.append(("row_argmax", k.row_argmax(am), (val.float(), idx.float())))
        # gather_rows: a table of 6 rows in two chunks of 3, each stored column-major (a column
        # stride of 3, a row offset of id % 3), in an order that crosses chunks; then columns in
        # adjacent pairs (groups of 2, 5 columns padded to 6: pair k of row r at 6k + 2r)
        table = torch.randn(6, 5, generator=g).to(dtype)
        parts = [table[:3].t().contiguous(), table[3:].t().contiguous()]
        chunk_ptrs = torch.tensor([p.data_ptr() for p in parts])
        got = k.gather_rows(chunk_ptrs, 3, torch.arange(6) % 3, 3, 1, 5, dtype, torch.tensor([4, 0, 5, 2]))
        checks.append(("gather_rows", got, table[[4, 0, 5, 2]]))
        pairs = [torch.nn.functional.pad(p, (0, 1)).reshape(3, 3, 2).transpose(0, 1).contiguous() for p in
                 (table[:3], table[3:])]
        chunk_ptrs = torch.tensor([p.data_ptr() for p in pairs])
        got = k.gather_rows(chunk_ptrs, 3, torch.arange(6) % 3 * 2, 6, 2, 5, dtype, torch.tensor([4, 0, 5, 2]))
        checks.append(("gather_rows in pairs", got, table[[4, 0, 5, 2]]))
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
        # q4_linear: 3 rows, 21 outputs (full tiles and a tail), K = 96 (a chunk of 64 codes and
        # one of 32), groups of 32; against the dequantized weight in fp32, as q8_linear
        # (bf16: scales and zeros as bf16, the reference with the same rounded values)
        sc, zp = torch.rand(21, 3, generator=g) * 0.02, torch.randn(21, 3, generator=g) * 0.01
        q4 = pack_q4(torch.randint(0, 16, (21, 96), generator=g, dtype=torch.uint8), sc, zp, dtype)
        xq = torch.randn(3, 96, generator=g).to(dtype)
        want = F.linear(xq.float(), _q4_dequantize(q4))
        got = k.q4_linear(xq, q4)
        if got is None or got.dtype != dtype or got.shape != want.shape:
            raise native.NativeKernelError(f"the compiled q4_linear refused or misshaped a {dtype} problem")
        if not torch.allclose(got.float(), want, rtol=q8_tol, atol=q8_tol * want.abs().max().item()):
            raise native.NativeKernelError(f"the compiled q4_linear disagrees with torch in {dtype} "
                                           f"(max error {(got.float() - want).abs().max():.3g})")
        if k.int8_compiled:
            try:
                _self_check_int8_activations(k, dtype, q8_tol, g)
            except native.NativeKernelError as e:  # the int8 kernels only: the exact ones stay
                logger.warning("CPU int8-activation matmuls unavailable, x stays exact: %s", e)
                k.int8_compiled = False


def _self_check_int8_activations(k: CpuKernels, dtype: torch.dtype, tol: float, g: torch.Generator) -> None:
    """The int8-activation kernels (4- and 8-bit) against ``cpu_qdot.emulate``: 3 rows, 21 outputs,
    K = 608 (a superblock of 16 groups and one of 3)."""
    n, kk = 21, 608
    x = torch.randn(3, kk, generator=g).to(dtype)
    sc, zp = torch.rand(n, kk // 32, generator=g) * 0.02, torch.randn(n, kk // 32, generator=g) * 0.01
    # the layouts packed outright: the check must not depend on LOOM_CPU_INT8_ACTIVATIONS at build time
    q4 = pack_q4(torch.randint(0, 16, (n, kk), generator=g, dtype=torch.uint8), sc, zp, dtype, layout=1)
    codes, scale, zero = unpack_q4(q4)
    checks = [("q4_linear", k.q4_linear(x, q4), cpu_qdot.emulate(x, codes, scale, zero - 8 * scale))]
    q8w = torch.randint(0, 256, (n, kk), generator=g, dtype=torch.uint8)
    q8 = cpu_qdot.pack_q8(q8w, sc, zp)
    checks.append(("q8a_linear", k.q8a_linear(x, q8), cpu_qdot.emulate(x, q8w, sc, zp - 128 * sc)))
    for name, got, want in checks:
        want = want.float()
        if got is None or got.dtype != dtype or got.shape != want.shape or not torch.allclose(
                got.float(), want, rtol=tol, atol=tol * want.abs().max().item()):
            raise native.NativeKernelError(f"the compiled {name} with int8 activations disagrees with its "
                                           f"emulation in {dtype}")


@functools.cache
def kernels() -> CpuKernels | None:
    """The compiled kernels, or None (the reason logged once) where they cannot be had."""
    if not envs.LOOM_CPU_NATIVE_KERNELS:
        return None
    try:
        files = resources.files(__package__)  # cpu_qdot.c uses cpu_kernels.c's helpers: one unit
        source = b"".join(files.joinpath(f).read_bytes() for f in ("cpu_kernels.c", "cpu_qdot.c", "cpu_gemm.c", "cpu_tape.c"))
        k = CpuKernels(ctypes.CDLL(native._build(native._compiler(), source, "cpu_kernels", "the CPU fused ops")))
        _self_check(k)
        if k.panel_linear is not None:
            try:
                cpu_gemm.self_check(k.panel_linear, k.silu_and_mul)
            except native.NativeKernelError as e:  # that kernel only: the others stay
                logger.warning("loom's own GEMM unavailable, linear layers stay on oneDNN: %s", e)
                k.panel_linear = None
        return k
    except (native.NativeKernelError, OSError, subprocess.SubprocessError, AttributeError) as e:
        logger.warning("CPU fused kernels unavailable, RMSNorm, SiLU-and-mul, rotary embedding and the 8- and "
                       "4-bit linears run on torch ops (slower): %s. Install a C compiler with OpenMP (gcc) to enable them, or set "
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
    CustomOp.register_kernel("row_argmax", k.row_argmax)
    return True
