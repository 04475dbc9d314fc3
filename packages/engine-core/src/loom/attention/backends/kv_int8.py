"""An 8-bit KV cache for the CPU platform (``--kv-cache-dtype int8``): layout and reference.

Each cache slot holds one row per layer and per K or V: the ``Hk * D`` int8 codes of its KV
heads, head after head, then the ``Hk`` fp32 scales (little-endian, 4 bytes each), so a row is
``Hk * (D + 4)`` bytes and a layer's cache is ``(2, num_blocks, block_size, Hk * (D + 4))``
uint8. A head's vector is ``scale * codes``: symmetric, one scale per (token, KV head), the
head's largest magnitude mapped to 127 (``scale = amax / 127``, codes rounded to nearest, ties
to even; an all-zero head has scale 0). Half the bytes of a bf16 cache plus 4 per head: decode
attention, which reads the whole context every step, reads about half as much.

The functions here are the reference in torch ops: the backend's path where no compiled kernel
takes a shape, and the answer the kernels are tested against.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ...logger import init_logger
from . import native

logger = init_logger(__name__)

QMAX = 127.0


def row_bytes(num_kv_heads: int, head_size: int) -> int:
    """Bytes of one slot's row of K (or V) for one layer."""
    return num_kv_heads * (head_size + 4)


def quantize_rows(x: torch.Tensor, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """(T, Hk * D) rows of any float dtype -> (T, Hk * (D + 4)) uint8 cache rows. A head holding a
    NaN or an infinity gets scale NaN (it reads back as NaN, as it would attend in the model's
    dtype); a head of zeros and subnormals (below fp32's smallest normal) gets scale 0; codes 0
    for both."""
    t, hk, d = x.shape[0], num_kv_heads, head_size
    xf = x.reshape(t, hk, d).float()
    amax = xf.abs().amax(-1)  # (T, Hk); NaN where the head holds one
    bad = ~torch.isfinite(amax)
    ok = amax >= torch.finfo(torch.float32).tiny  # False for NaN too
    # 1/amax rounded to fp32, then times 127 (what torch computes for 127 / amax, written out: the
    # compiled write does the same two roundings, so both make the same codes)
    inv = torch.where(ok & ~bad, amax.reciprocal() * QMAX, torch.zeros_like(amax)).unsqueeze(-1)
    codes = torch.where(bad.unsqueeze(-1), 0.0, torch.round(xf * inv)).clamp_(-QMAX, QMAX).to(torch.int8)
    scale = torch.where(bad, torch.nan, torch.where(ok, amax / QMAX, 0.0))
    out = torch.empty(t, hk * (d + 4), dtype=torch.uint8)
    out[:, : hk * d] = codes.view(t, hk * d).view(torch.uint8)
    out[:, hk * d:] = scale.contiguous().view(torch.uint8)
    return out


def dequantize_rows(rows: torch.Tensor, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(*S, Hk * (D + 4)) uint8 cache rows -> (*S, Hk, D) in ``dtype``."""
    hk, d = num_kv_heads, head_size
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, hk * (d + 4))
    codes = flat[:, : hk * d].contiguous().view(torch.int8).view(-1, hk, d)
    scales = flat[:, hk * d:].contiguous().view(torch.float32)  # (N, Hk)
    return (codes.float() * scales.unsqueeze(-1)).to(dtype).view(*lead, hk, d)


# ---- The compiled kernels (paged_decode_q8.c): quantize-on-write and decode attention ----

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_DECODE_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64,
                    _I64, _I64, _I64, _I64, _I64, ctypes.c_int, ctypes.c_float]  # as native's paged_decode
_WRITE_ARGTYPES = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64]
NOT_COMPILED = 3
"""What the C functions return where they are not compiled for this CPU (no AVX512-VNNI)."""


class Int8KV:
    """``paged_decode_q8.c``'s functions, from the library that ``native.paged_decode()`` loaded;
    every call goes through ``native.call`` (so a captured decode step replays it)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._decode, self._write = lib.paged_decode_q8, lib.kv_write_q8
        self._decode.argtypes, self._decode.restype = _DECODE_ARGTYPES, ctypes.c_int
        self._write.argtypes, self._write.restype = _WRITE_ARGTYPES, ctypes.c_int
        compiled = lib.kv_q8_compiled
        compiled.argtypes, compiled.restype = [], ctypes.c_int
        self.compiled = bool(compiled())
        self._supports: dict[tuple[torch.dtype, int], bool] = {}  # asked by every layer, every step

    def supports(self, dtype: torch.dtype, head_size: int) -> bool:
        """Whether ``decode`` takes a query of ``dtype`` with heads of ``head_size``."""
        key = (dtype, head_size)
        ok = self._supports.get(key)
        if ok is None:
            ok = self._supports[key] = (self.compiled and dtype == torch.bfloat16 and head_size % 32 == 0
                                        and 32 <= head_size <= 256)
        return ok

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k_rows: torch.Tensor,
              v_rows: torch.Tensor) -> bool:
        """``k_rows[slots] = quantize_rows(key)`` and the same for V, bit for bit: ``key``/``value``
        (T, Hk * D) bf16 with unit inner strides (a fused qkv output's column slices), caches
        (num_slots, Hk * (D + 4)) uint8 contiguous, ``slots`` (T,) int64 contiguous. False
        (nothing written) where the dtypes or layouts are not those or the kernel is not compiled
        here; a slot out of range raises ``IndexError`` with nothing written."""
        t, width, row = key.shape[0], key.shape[-1], k_rows.shape[-1]
        hk = (row - width) // 4
        if (not self.compiled or key.dtype != torch.bfloat16 or value.dtype != torch.bfloat16
                or k_rows.dtype != torch.uint8 or v_rows.dtype != torch.uint8 or key.dim() != 2
                or value.shape != key.shape or k_rows.dim() != 2 or v_rows.shape != k_rows.shape
                or hk < 1 or row - width != 4 * hk or width % hk or width == 0
                or key.stride(1) != 1 or value.stride(1) != 1
                or not (k_rows.is_contiguous() and v_rows.is_contiguous())
                or slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape != (t,)):
            return False
        rc = native.call(self._write, key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                         slots.data_ptr(), t, hk, width // hk, k_rows.data_ptr(), v_rows.data_ptr(), k_rows.shape[0])
        if rc == 1:
            raise IndexError(f"a slot of {slots.tolist()} is outside the KV cache's {k_rows.shape[0]} slots")
        return rc == 0

    def decode(self, query: torch.Tensor, rows_q: torch.Tensor, rows_req: torch.Tensor, k_rows: torch.Tensor,
               v_rows: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor, out: torch.Tensor, *,
               num_heads: int, num_kv_heads: int, head_size: int, block_size: int, scale: float) -> bool:
        """Write into ``out`` the attention of query rows ``rows_q`` over their contexts in the
        int8 cache, as ``PagedDecode.__call__`` does over a bf16 one: ``query``/``out`` (T, H*D)
        bf16, unit inner stride; ``k_rows``/``v_rows`` (num_slots, Hk * (D + 4)) uint8
        contiguous; ``rows_q``, ``rows_req``, ``ctx_lens`` (B,) int64 contiguous; ``tables``
        (R, max_blocks) int64, unit inner stride. False (``out`` untouched) where the kernel does
        not take the problem (not bf16, a head size that is not a multiple of 32 up to 256, not
        compiled here): the caller falls back to the torch path. Mismatched dtypes or strides
        raise ``ValueError``."""
        if not self.supports(query.dtype, head_size):
            return False
        hk, d = num_kv_heads, head_size
        if not (out.dtype == query.dtype and query.stride(1) == out.stride(1) == 1
                and k_rows.dtype == v_rows.dtype == torch.uint8 and k_rows.is_contiguous() and v_rows.is_contiguous()
                and k_rows.shape[-1] == v_rows.shape[-1] == row_bytes(hk, d) and tables.dtype == torch.int64
                and tables.stride(1) == 1
                and all(t.dtype == torch.int64 and t.is_contiguous() for t in (rows_q, rows_req, ctx_lens))):
            raise ValueError("paged_decode_q8: dtypes or strides do not match the kernel's layout")
        rc = native.call(self._decode, query.data_ptr(), query.stride(0), rows_q.data_ptr(), rows_req.data_ptr(),
                         k_rows.data_ptr(), v_rows.data_ptr(), tables.data_ptr(), tables.stride(0),
                         ctx_lens.data_ptr(), out.data_ptr(), out.stride(0), rows_q.shape[0], num_heads, hk, d,
                         block_size, torch.get_num_threads(), scale)
        if rc == NOT_COMPILED:
            return False
        if rc == 2:
            raise ValueError(f"paged_decode_q8: {num_heads} heads are not a multiple of {hk} KV heads")
        if rc:
            raise MemoryError("the int8 paged-attention kernel could not allocate its scratch memory")
        return True


def _self_check(kernel: Int8KV) -> None:
    """A small GQA problem with scattered blocks: the write against ``quantize_rows`` (bytes),
    the decode against ``native._reference`` over the dequantized cache."""
    g = torch.Generator().manual_seed(0)
    h, hk, d, bs, blocks = 4, 2, 32, 4, 12
    row = row_bytes(hk, d)
    tables = torch.randperm(blocks, generator=g).view(3, 4)
    ctx = torch.tensor([13, 1, 16])
    rows_q, rows_req = torch.tensor([2, 0, 1]), torch.tensor([0, 2, 1])
    kv = torch.randn(blocks * bs, 2 * hk * d + 8, generator=g).to(torch.bfloat16)  # strided, like a qkv split
    key, value = kv[:, : hk * d], kv[:, hk * d: 2 * hk * d]
    k_rows, v_rows = (torch.zeros(blocks * bs, row, dtype=torch.uint8) for _ in range(2))
    slots = torch.randperm(blocks * bs, generator=g)
    if not kernel.write(key, value, slots, k_rows, v_rows):
        raise native.NativeKernelError("the int8 KV write refused a bf16 problem")
    if not (torch.equal(k_rows[slots], quantize_rows(key, hk, d))
            and torch.equal(v_rows[slots], quantize_rows(value, hk, d))):
        raise native.NativeKernelError("the int8 KV write disagrees with quantize_rows")
    query = torch.randn(3, h * d, generator=g).to(torch.bfloat16)
    out = torch.zeros(3, h * d, dtype=torch.bfloat16)
    if not kernel.decode(query, rows_q, rows_req, k_rows, v_rows, tables, ctx, out, num_heads=h, num_kv_heads=hk,
                         head_size=d, block_size=bs, scale=d**-0.5):
        raise native.NativeKernelError("the int8 decode kernel refused a bf16 problem")
    # the bf16 kernel's reference (torch ops, fp32) over the cache dequantized
    want = native._reference(query, rows_q, rows_req, dequantize_rows(k_rows, hk, d, torch.float32),
                             dequantize_rows(v_rows, hk, d, torch.float32), tables, ctx, h, bs, d**-0.5)
    if not torch.allclose(out[rows_q].float(), want, atol=2e-2, rtol=2e-2):
        raise native.NativeKernelError(f"the int8 decode kernel disagrees with torch "
                                       f"(max error {(out[rows_q].float() - want).abs().max():.3g})")


@functools.cache
def int8_kv() -> Int8KV | None:
    """The compiled int8 KV kernels, or None (the reason logged once) where they cannot be had:
    no compiled kernel library (``native.paged_decode()`` is None), a CPU without AVX512-VNNI,
    or a kernel that disagrees with the torch reference on a small problem."""
    kernel = native.paged_decode()
    if kernel is None:
        return None
    try:
        q8 = Int8KV(kernel.lib)
        if not q8.compiled:
            logger.info("The int8 KV cache's kernels need AVX512-VNNI: its attention runs on torch ops")
            return None
        _self_check(q8)
        return q8
    except (native.NativeKernelError, AttributeError) as e:
        logger.warning("The int8 KV cache's kernels are unavailable, its attention runs on torch ops (slower): %s", e)
        return None
