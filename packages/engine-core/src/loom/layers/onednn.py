"""CPU linear layers on weights prepacked for oneDNN.

``F.linear`` on the CPU hands torch's ``(out, in)`` weight to the GEMM library on every call,
which re-lays it out for its micro-kernels each time. oneDNN can do that once: after the
weights are loaded, ``prepack_model`` replaces each linear layer's weight with oneDNN's
blocked copy (``torch.ops.mkldnn._reorder_linear_weight``) and the layer multiplies through
``torch.ops.mkldnn._linear_pointwise``. The result is the same matmul (bit-identical in bf16
on the machines measured, within float rounding in fp32); ``bench/roofline.py`` prints the
per-shape rates of both.

The packed weight replaces the dense one (no second copy); ``weight.to_dense()`` and the
model's ``state_dict()`` give the dense tensor back. The LM head is packed in vocabulary chunks
(``PackedHead``). Its dense weight goes too: an untied head's is never read again, and a tied
embedding looks its rows up in the packed chunks (``PackedHead.lookup``, the CPU kernels'
``gather_rows``), at the element offsets oneDNN chose, read back once per chunk shape by packing
probe weights (:func:`row_layout`). Where that cannot be had (no compiled kernels, a layout not
of that form), the embedding keeps its dense table. For the default model in fp32 this is the
113 MB second copy of its vocabulary.

Many rows of fp32 on a CPU without AVX-512 (:func:`blas_for_many_rows`) take another road: from
``DENSE_ROWS`` rows on (a prefill step's) the layer makes a dense copy of the weight for that
one call and multiplies through ``F.linear`` (torch's BLAS, MKL in the x86 wheels), which runs
those GEMMs 5-10% faster than oneDNN's AVX2 kernels on the packed weight; the copy costs 2-4%
of the GEMM and lives only for the call. Decode steps' few rows stay on the packed weight,
where oneDNN is the faster of the two by a fifth or more.

Where loom's own GEMM runs (the CPU platform, :func:`panels_for`: fp32 on x86 with AVX2 and FMA
but no AVX-512, bf16 on x86 with AVX512-BF16, and the CPU kernels compiled), those layers hold
their weight as its panel tensor instead (``platforms/cpu_gemm.py``: ``(out / 16, in, 16)``
fp32, ``(out / 16, in / 2, 32)`` bf16, out a multiple of 16) and multiply through that kernel at
every row count. On 2 cores of an AVX2 AMD EPYC the fp32 one runs a decode step's 64 rows a fifth
faster than oneDNN, and a prefill step's at MKL's speed without the dense copy; on an AMD EPYC
with AVX512-BF16 the bf16 one runs 64 rows 1.16x as fast as oneDNN, 256 to 2,048 as fast.
The LM head's chunks are panels too, where they are whole panels; a tied embedding then looks
its rows up in them at offsets known without a probe (``cpu_gemm.row_layout``).
``LOOM_CPU_PANEL_GEMM=0`` keeps oneDNN for all of them.

Only on the CPU, for float32 and bfloat16 (bf16 where oneDNN packs it on this CPU: ``packs``),
where torch was built with oneDNN;
``LOOM_CPU_PREPACK=0`` keeps ``F.linear``. :func:`pack` makes a layer's packed weight,
:func:`linear` multiplies by any of the three forms and :func:`dense` gives the dense one back.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from loom_plugin_api.ops.quantized_linear import QuantizedLinear

from .. import envs, platforms
from ..logger import init_logger
from ..platforms import cpu_features, cpu_gemm

logger = init_logger("loom.layers.onednn")

__all__ = ["PackedHead", "available", "blas_for_many_rows", "dense", "linear", "pack", "pack_weight", "panels_for",
           "prepack_model", "row_layout", "silu_and_mul_linear"]

DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any row count still works
DENSE_ROWS = 1024
"""From this many rows on, fp32 goes through ``F.linear`` on a per-call dense copy where
:func:`blas_for_many_rows` says so. On 2 cores of an AVX2 AMD EPYC (2026-12-07, the default
model's four shapes, oneDNN against copy + ``F.linear``, GFLOP/s): 256 rows 156 / 126, 512
159 / 154, 768 160 / 163, 1,024 159 / 165, 2,048 158 / 170."""


@functools.cache
def available() -> bool:
    """Whether this torch can pack and run oneDNN linear weights (x86 and Arm builds can)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU: its bf16 reorder needs AVX512 (bw, vl,
    dq) or AVX-NE-CONVERT, which an AVX2-only CPU lacks; asked once, by trying it."""
    if dtype not in DTYPES or not available():
        return False
    try:
        pack_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as e:
        logger.info("oneDNN does not pack %s weights on this CPU (%s): F.linear instead", dtype, e)
        return False
    return True


def blas_for_many_rows(flags: frozenset[str], mkl: bool) -> bool:
    """Whether fp32 GEMMs of ``DENSE_ROWS`` or more rows go through torch's BLAS on a dense copy:
    x86 with AVX2 and FMA but no AVX-512 (oneDNN then runs its AVX2 kernels), and torch built with
    MKL. Elsewhere (AVX-512 CPUs, where oneDNN has its wider kernels; Arm) the packed weight
    serves every row count: not measured to lose there."""
    return mkl and {"avx2", "fma"} <= flags and "avx512f" not in flags


@functools.cache
def _blas_here() -> bool:
    return blas_for_many_rows(cpu_features.cpu_flags(), torch.backends.mkl.is_available())


def panels_for(dtype: torch.dtype, flags: frozenset[str]) -> bool:
    """Whether ``dtype`` layers run loom's panel GEMM (``platforms/cpu_gemm.c``) on a CPU with these
    flags: fp32 on x86 with AVX2 and FMA but no AVX-512 (where oneDNN has kernels twice as wide;
    not measured against them), bf16 on x86 with AVX512-BF16 (measured against oneDNN's
    ``vdpbf16ps`` kernels on an AMD EPYC; not against AMX, which CPUs with AMX-BF16 run oneDNN's
    bf16 GEMMs on, several times faster)."""
    if dtype == torch.float32:
        return {"avx2", "fma"} <= flags and "avx512f" not in flags
    if dtype == torch.bfloat16:
        return {"avx512f", "avx512bw", "avx512_bf16"} <= flags and "amx_bf16" not in flags
    return False


@functools.cache
def _panel_gemm() -> cpu_gemm.PanelGemm | None:
    """The compiled panel GEMM where this CPU's layers of some dtype may take it, else None: only
    under loom's CPU platform, whose kernels it is (another platform on CPU tensors, as the dummy
    one, keeps oneDNN and runs no kernel of loom's CPU platform)."""
    flags = cpu_features.cpu_flags()
    if not any(panels_for(dtype, flags) for dtype in cpu_gemm.GROUP) or not platforms.current_platform.is_cpu():
        return None
    from ..platforms.cpu_kernels import kernels  # here: the platforms import the layers

    k = kernels()
    return None if k is None else k.panel_linear


def _takes_panels(weight: torch.Tensor) -> bool:
    if not (envs.LOOM_CPU_PANEL_GEMM and cpu_gemm.fits(weight)
            and panels_for(weight.dtype, cpu_features.cpu_flags())):
        return False
    gemm = _panel_gemm()
    return gemm is not None and weight.dtype in gemm.dtypes


def enabled_for(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` packs this dense weight (else the layer keeps it)."""
    return (envs.LOOM_CPU_PREPACK and weight.device.type == "cpu" and not weight.is_mkldnn and weight.dim() == 2
            and (packs(weight.dtype) or _takes_panels(weight)))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A CPU layer's packed form of a dense ``(out, in)`` weight (:func:`enabled_for` said yes):
    the panel tensor where the panel GEMM takes it, else oneDNN's layout."""
    return cpu_gemm.to_panels(weight) if _takes_panels(weight) else pack_weight(weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a dense ``(out, in)`` weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """The dense ``(out, in)`` weight of any form :func:`linear` takes (a copy for a packed one)."""
    if weight.is_mkldnn:
        return weight.to_dense()
    return cpu_gemm.from_panels(weight) if weight.dim() == 3 else weight


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a dense weight, a panel tensor or a oneDNN-packed weight, or through a
    quantized layer's op (``layers/quantized.py``)."""
    if isinstance(weight, QuantizedLinear):
        return weight(x, bias)
    if weight.dim() == 3:  # panels: made only where _panel_gemm() has the kernel
        return _panel_gemm()(x, weight, bias)
    if weight.is_mkldnn:
        if x.dtype == torch.float32 and x.numel() >= DENSE_ROWS * x.shape[-1] and _blas_here():
            return F.linear(x, weight.to_dense(), bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor | QuantizedLinear,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
    """``silu(g) * u`` of ``[g | u] = linear(x, weight, bias)`` (a gated MLP's merged gate and up
    projection: the weight's first half of rows the gate's) in one pass of loom's GEMM
    (``PanelGemm.silu_and_mul``), bit for bit what :func:`linear` and the CPU platform's
    ``silu_and_mul`` kernel give. None where the weight is not in panels for these rows (oneDNN's
    layout, a dense weight, a quantized layer's rows that go through its codes) or that GEMM has
    no such pass for them (fp32): the caller then runs the two ops."""
    if isinstance(weight, QuantizedLinear):
        # here, not at the top: it imports this module
        from .quantized import CpuQuantizedWeight

        prepared = weight.kernel_weight() if type(weight) is QuantizedLinear else None
        if not isinstance(prepared, CpuQuantizedWeight):
            return None  # another platform's kernel, or none
        weight = prepared.dense_for(x)
        if weight is None:
            return None
    gemm = _panel_gemm()
    return None if weight.dim() != 3 or gemm is None else gemm.silu_and_mul(x, weight, bias)


class PackedHead:
    """The LM head's weight packed in vocabulary chunks: ``[(lo, hi, packed rows lo:hi)]``, each
    in loom's panels where fp32 layers take them (``panels``) or oneDNN's layout; once
    :meth:`enable_lookup` said yes, also the table a tied embedding looks its rows up in."""

    def __init__(self, weight: torch.Tensor, chunk: int) -> None:
        # every row of this rank's shard, padding too: forward() gathers whole shards across ranks
        self.chunk = chunk
        self.dtype, self.cols = weight.dtype, weight.shape[1]
        rows = weight.shape[0]
        # loom's panels where the panel GEMM runs and every chunk is whole panels, else oneDNN's layout
        self.panels = chunk % cpu_gemm.PANEL == 0 and _takes_panels(weight)  # (which checks the shape)
        pack_chunk = cpu_gemm.to_panels if self.panels else pack_weight
        self.chunks = [(lo, min(lo + chunk, rows), pack_chunk(weight[lo:lo + chunk])) for lo in range(0, rows, chunk)]
        self._lookup: tuple | None = None

    def enable_lookup(self) -> bool:
        """Make :meth:`lookup` work; False where this CPU has no compiled kernels or a chunk's
        layout is not one :func:`row_layout` can express (or differs between chunks)."""
        from ..platforms.cpu_kernels import kernels  # here: the platforms import the layers

        if self.panels:  # a layout known, not read back
            layouts = [cpu_gemm.row_layout(hi - lo, self.cols, self.dtype) for lo, hi, _ in self.chunks]
            pointers = torch.tensor([w.data_ptr() for _, _, w in self.chunks], dtype=torch.int64)
        elif not all(hasattr(torch.ops.mkldnn, op) for op in ("data_ptr", "_nbytes")):
            return False  # a torch that cannot show a packed buffer
        else:
            layouts = [row_layout(hi - lo, self.cols, self.dtype) for lo, hi, _ in self.chunks]
            pointers = torch.tensor([torch.ops.mkldnn.data_ptr(w) for _, _, w in self.chunks], dtype=torch.int64)
        k = kernels()
        if k is None or None in layouts or len({layout[1:] for layout in layouts}) != 1:  # type: ignore[index]
            return False  # (and where chunks differ in stride or group: one of each for the kernel)
        offsets = torch.cat([layout[0] for layout in layouts])  # type: ignore[index]
        stride, group = layouts[0][1:]  # type: ignore[index]
        self._lookup = (k.gather_rows, pointers, offsets, stride, group)
        return True

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, dense weight)``, bit for bit, from the packed chunks."""
        if self._lookup is None:
            raise RuntimeError("PackedHead.lookup before enable_lookup() said yes")
        gather, pointers, offsets, stride, group = self._lookup
        rows = gather(pointers, self.chunk, offsets, stride, group, self.cols, self.dtype, ids)
        if rows is None:
            raise RuntimeError(f"the compiled gather_rows does not take {self.dtype}")
        return rows.reshape(*ids.shape, self.cols)

    def to_dense(self) -> torch.Tensor:
        """The dense ``(rows, cols)`` weight, rebuilt (``state_dict()``)."""
        return torch.cat([dense(w) for _, _, w in self.chunks])


def _buffer(packed: torch.Tensor) -> torch.Tensor:
    """A packed weight's buffer as a 1-D tensor of its dtype, a view: ``packed`` must outlive it."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    raw = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(raw, dtype=packed.dtype)


_DIGIT_BITS = 7  # a probe weight holds 1 + digit / 128: exact in bf16 (7 mantissa bits) and fp32


@functools.cache
def row_layout(rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, int] | None:
    """Where oneDNN keeps each element of a packed ``(rows, cols)`` weight of ``dtype``:
    ``(row_offset (rows,) int64, col_stride, group)``, element ``(r, i)`` being ``row_offset[r] +
    (i // group) * col_stride + i % group`` elements into the buffer; None where the layout is
    not of that form. oneDNN's fp32 layouts put 64 rows side by side (group 1, a column stride of
    64 on this torch); its bf16 ones, for its bf16 dot products, pairs of columns (group 2).

    Read back rather than assumed: each probe packs a weight whose elements hold 7 bits of their
    own index (as 1 + digit / 128; the buffer's padding is 0), and the digits found at each
    position of the buffer spell out which element went there."""
    n = rows * cols
    index = torch.arange(n)
    found = None
    real = None
    for p in range((max(n - 1, 1).bit_length() + _DIGIT_BITS - 1) // _DIGIT_BITS):
        digit = (index >> (_DIGIT_BITS * p)) & ((1 << _DIGIT_BITS) - 1)
        probe = (1 + digit.to(torch.float32) / (1 << _DIGIT_BITS)).to(dtype).reshape(rows, cols)
        packed = pack_weight(probe)
        values = _buffer(packed).to(torch.float32, copy=True)
        here = (values >= 1) & (values < 2)
        if real is None:
            real, found = here, torch.zeros(values.numel(), dtype=torch.int64)
        if not torch.equal(here, real):
            return None
        found += ((values - 1) * (1 << _DIGIT_BITS)).round().long().clamp(min=0) << (_DIGIT_BITS * p)
        del packed
    assert found is not None and real is not None
    positions = torch.nonzero(real).squeeze(1)
    elements = found[positions]
    if positions.numel() != n or elements.max() >= n:
        return None
    where = torch.full((n,), -1, dtype=torch.int64)
    where[elements] = positions
    if (where < 0).any():
        return None  # not each element exactly once
    where = where.reshape(rows, cols)
    run = where[0] - where[0, 0]
    group = 1
    while group < cols and run[group] == group:  # the first columns' run of adjacent elements
        group += 1
    stride = int(run[group]) if group < cols else group
    row_offset = where[:, 0].contiguous()
    i = torch.arange(cols)
    if not torch.equal(where, row_offset[:, None] + i // group * stride + i % group):
        return None
    return row_offset, stride, group


def prepack_model(model: nn.Module) -> int:
    """Pack every linear layer's weight (and the LM head) of a loaded CPU model; how many."""
    # here, not at the top: both modules import this one for ``linear`` and ``PackedHead``
    from .linear import LinearBase
    from .logits_processor import LogitsProcessor

    packed = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearBase) and isinstance(module.weight, QuantizedLinear):
                continue  # its kernel's layouts were made when the layer was built (layers/quantized.py)
            if isinstance(module, LinearBase) and enabled_for(module.weight):
                loader = getattr(module.weight, "weight_loader", None)
                module.weight = nn.Parameter(pack(module.weight), requires_grad=False)
                if loader is not None:
                    module.weight.weight_loader = loader  # type: ignore[attr-defined]
                module.register_state_dict_post_hook(_dense_state)
                packed += 1
        lm_head = getattr(model, "lm_head", None)
        for module in model.modules():
            if (isinstance(module, LogitsProcessor) and module.packed_head is None and lm_head is not None
                    and enabled_for(lm_head.weight)):
                module.packed_head = PackedHead(lm_head.weight, module.chunk)
                _drop_dense_head(model, lm_head.weight, module.packed_head)
                packed += 1
    if packed:
        _return_freed_memory()
        logger.info("Prepacked %d linear weights for %s (LOOM_CPU_PREPACK=0 to keep F.linear)", packed,
                    "loom's own GEMM and oneDNN" if envs.LOOM_CPU_PANEL_GEMM and _panel_gemm() else "oneDNN")
    return packed


def _drop_dense_head(model: nn.Module, weight: torch.Tensor, head: PackedHead) -> bool:
    """Free the LM head's dense weight, now that ``head`` holds it packed; whether it went.

    Each module that held it gets ``row_source = head``, and for ``weight`` one NaN broadcast to
    the weight's shape (its dtype and device, for code that asks the model's parameters; no data,
    and NaN wherever something reads it anyway); an embedding among them then looks rows up in
    ``head``. Where ``head`` cannot serve lookups, a tied weight stays (an untied head's goes
    regardless). As with the packed linears, the weights cannot be loaded again after this (a
    copy into the stub fails: it has one element)."""
    # here, not at the top: it imports .linear, which imports this module
    from .vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    holders = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and m.weight is weight]
    if not holders or (any(not isinstance(m, ParallelLMHead) for m in holders) and not head.enable_lookup()):
        return False
    stub = nn.Parameter(torch.full((1, 1), float("nan"), dtype=weight.dtype).expand(weight.shape), requires_grad=False)
    for module in holders:
        module.weight = stub
        module.row_source = head
        module.register_state_dict_post_hook(_head_state)
    return True


def _head_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict()`` keeps showing the dense weight of an embedding or head whose rows are packed."""
    key = prefix + "weight"
    if key in state_dict and module.row_source is not None:
        state_dict[key] = module.row_source.to_dense()


def _return_freed_memory() -> None:
    """Give the dense weights' freed pages back to the OS: the CPU worker tells glibc not to
    trim its heap between steps, so without this they would stay in the worker's RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _dense_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict()`` keeps showing the dense ``(out, in)`` weight of a packed layer."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = dense(state_dict[key])
