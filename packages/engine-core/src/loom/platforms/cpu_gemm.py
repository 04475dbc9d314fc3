"""loom's own linear layer for x86 CPUs (``cpu_gemm.c``, built with the other CPU kernels): fp32
on AVX2 + FMA, bf16 on AVX512-BF16.

On CPUs without native bf16 (``dtype auto`` = fp32) the layer GEMMs are most of a step. oneDNN's
AVX2 kernels run a decode step's 64 rows at about 134 GFLOP/s on 2 cores of an AMD EPYC and
lose a fifth of the second core where a layer's output is 576 columns wide; this one splits the
columns evenly between the threads and runs them at 171 (165 before each weight block asked for
the next ahead), and many rows (prefill) at MKL's speed without the per-call dense copy that path
needs (``bench/avx2_linear.py``). On CPUs with AVX512-BF16 (``dtype auto`` = bf16) its bf16
kernel runs a decode step's 64 rows 1.16x as fast as oneDNN on its prepacked weight, and
prefill's many rows as fast (``bench/avx2_linear.py --dtype bfloat16``).

Its weight form is the panel tensor: a ``(n, k)`` weight, ``n`` a multiple of :data:`PANEL`, as
``(n / 16, k, 16)`` float32, or as ``(n / 16, k / 2, 32)`` bfloat16 (``k`` even: pairs of k side
by side, the pairs ``vdpbf16ps`` multiplies), contiguous (:func:`to_panels`; :func:`from_panels`
gives the dense weight back). A 3-D tensor cannot pass for a dense weight: ``F.linear`` refuses
it. ``layers/onednn.py`` decides where layers hold it.

The bf16 kernel also runs a gated MLP's merged gate/up layer and its SiLU-and-mul in one pass
(:meth:`PanelGemm.silu_and_mul`, the same bits as the two ops; ``models/llama.py`` takes it):
1.09x the two ops at 64 and 2,048 rows, 1.24x at one (``bench/avx2_linear.py --dtype bfloat16``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..attention.backends import native

__all__ = ["GROUP", "PANEL", "PanelGemm", "fits", "from_panels", "row_layout", "self_check", "to_panels",
           "within_rounding"]

PANEL = 16
"""Output columns a panel: a weight's rows must be a multiple of it."""

GROUP = {torch.float32: 1, torch.bfloat16: 2}
"""The dtypes a panel tensor holds, and how many consecutive k each keeps side by side."""

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def fits(weight: torch.Tensor) -> bool:
    """Whether :func:`to_panels` takes this weight: a float32 or bfloat16 ``(n, k)`` matrix, ``n``
    a positive multiple of :data:`PANEL`, ``k`` a multiple of the dtype's :data:`GROUP`."""
    return (weight.dtype in GROUP and weight.dim() == 2 and weight.shape[0] > 0 and weight.shape[0] % PANEL == 0
            and weight.shape[1] > 0 and weight.shape[1] % GROUP[weight.dtype] == 0)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """The panel tensor of a dense ``(n, k)`` weight that :func:`fits`."""
    if not fits(weight):
        raise ValueError(f"to_panels takes a float32 or bfloat16 (n, k) weight with n a multiple of {PANEL} (and k "
                         f"even in bfloat16), not {weight.dtype} {tuple(weight.shape)}")
    (n, k), g = weight.shape, GROUP[weight.dtype]
    return (weight.detach().reshape(n // PANEL, PANEL, k // g, g).transpose(1, 2).contiguous()
            .view(n // PANEL, k // g, PANEL * g))


def from_panels(panels: torch.Tensor) -> torch.Tensor:
    """The dense ``(n, k)`` weight of a panel tensor (a copy)."""
    g = GROUP[panels.dtype]
    return (panels.view(panels.shape[0], panels.shape[1], PANEL, g).transpose(1, 2)
            .reshape(panels.shape[0] * PANEL, panels.shape[1] * g))


def row_layout(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int, int]:
    """Where a panel tensor of a ``(rows, cols)`` weight keeps element ``(r, i)``: ``row_offset[r] +
    (i // group) * col_stride + i % group`` elements in, as ``layers/onednn.row_layout`` gives
    oneDNN's (fp32: a column stride of 16, groups of 1; bf16: 32 and pairs)."""
    r, g = torch.arange(rows), GROUP[dtype]
    return r // PANEL * PANEL * cols + r % PANEL * g, PANEL * g, g


class PanelGemm:
    """``F.linear(x, from_panels(panels), bias)`` through ``panel_linear_f32`` or
    ``panel_linear_bf16``, for the :attr:`dtypes` this CPU's build has; any x the kernel cannot
    take (another dtype than the weight's, not on the CPU) goes through ``F.linear`` on the dense
    weight, which computes it or says what is wrong (a width that does not fit, a dtype mismatch).
    :meth:`silu_and_mul` is a gated MLP's merged gate and up projection and its activation in one
    pass, for the :attr:`gated_dtypes`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns: dict[torch.dtype, ctypes._CFuncPtr] = {}
        self._gated: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, name, gated, available in (
                (torch.float32, "panel_linear_f32", None, lib.panel_available),
                (torch.bfloat16, "panel_linear_bf16", "panel_linear_silu_bf16", lib.panel_bf16_available)):
            if available():
                for table, fn_name in ((self._fns, name), (self._gated, gated)):
                    if fn_name is not None:
                        fn = getattr(lib, fn_name)
                        fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT]
                        fn.restype = ctypes.c_int
                        table[dtype] = fn
        self.dtypes = frozenset(self._fns)
        """The weight dtypes compiled in: float32 on AVX2 + FMA, bfloat16 on AVX512-BF16."""
        self.gated_dtypes = frozenset(self._gated)
        """Those :meth:`silu_and_mul` takes: bfloat16 (fp32's 6 x 16 tile has no registers left for
        a second panel)."""

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        fn = self._fns.get(panels.dtype)
        self._check(fn, panels)
        dtype = panels.dtype
        n, k = panels.shape[0] * PANEL, panels.shape[1] * GROUP[dtype]
        if not self._takes(x, bias, dtype, n, k):
            return F.linear(x, from_panels(panels), bias)
        return self._run(fn, x, panels, bias, n, k, n)

    def silu_and_mul(self, x: torch.Tensor, panels: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """``silu(g) * u`` where ``[g | u] = self(x, panels, bias)``, the weight's first half of
        rows the gate projection's and the rest the up projection's, in one pass
        (``panel_linear_silu_bf16``: each tile multiplies a gate panel and its up panel and writes
        the product, so ``[g | u]`` is never in memory). Bit for bit what this GEMM then the CPU
        kernels' ``silu_and_mul`` give. None where there is no such pass for these arguments (a
        dtype not in :attr:`gated_dtypes`, a half width not a multiple of 16, an ``x`` or bias
        :meth:`__call__` would hand to ``F.linear``): the caller runs the two ops."""
        fn = self._gated.get(panels.dtype)
        if fn is None:
            return None
        self._check(fn, panels)
        dtype = panels.dtype
        n, k = panels.shape[0] * PANEL, panels.shape[1] * GROUP[dtype]
        if n % (2 * PANEL) or not self._takes(x, bias, dtype, n, k):
            return None
        return self._run(fn, x, panels, bias, n, k, n // 2)

    def _check(self, fn: ctypes._CFuncPtr | None, panels: torch.Tensor) -> None:
        if (fn is None or panels.ndim != 3 or panels.shape[2] != PANEL * GROUP[panels.dtype] or not panels.is_cpu
                or not panels.is_contiguous()):
            raise ValueError(f"PanelGemm takes the contiguous (n / {PANEL}, k, {PANEL}) float32 or (n / {PANEL}, k / 2, "
                             f"{2 * PANEL}) bfloat16 CPU tensor of to_panels, of a dtype compiled here "
                             f"({sorted(map(str, self.dtypes))}), not {panels.dtype} {tuple(panels.shape)} on "
                             f"{panels.device}")

    @staticmethod
    def _takes(x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, n: int, k: int) -> bool:
        return (x.dtype == dtype and x.ndim > 0 and x.shape[-1] == k and x.is_cpu
                and (bias is None or (bias.dtype == dtype and bias.shape == (n,) and bias.is_contiguous()
                                      and bias.is_cpu)))

    @staticmethod
    def _run(fn: ctypes._CFuncPtr, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int,
             k: int, width: int) -> torch.Tensor:
        rows = x.reshape(-1, k) if x.ndim != 2 else x
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], width, dtype=panels.dtype)
        if rows.shape[0]:
            rc = native.call(fn, rows.data_ptr(), rows.stride(0), panels.data_ptr(),
                             0 if bias is None else bias.data_ptr(), out.data_ptr(), width, rows.shape[0], n, k,
                             torch.get_num_threads())
            if rc:
                raise RuntimeError(f"{fn.__name__} refused ({n}, {k}) panels at {panels.data_ptr():#x}: "
                                   "a weight not made by to_panels")
        return out if x.ndim == 2 else out.view(*x.shape[:-1], width)


def within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``y`` is ``F.linear(x, w, bias)`` to within the worst case of fp32 sums of K + 1
    terms in any order: ``(K + 1) u (|x| |w|^T + |bias|)`` an element, u = 2^-24 (a term left out
    or counted twice is off by orders of magnitude more), plus, for a bf16 ``y``, its own rounding
    (half a unit in its last place: at most 2^-8 of the value)."""
    x, w = x.double(), w.double()
    ref = x @ w.T + (0 if bias is None else bias.double())
    bound = (x.shape[-1] + 1) * 2.0 ** -24 * (x.abs() @ w.abs().T + (0 if bias is None else bias.double().abs()))
    if y.dtype == torch.bfloat16:
        bound = bound * (1 + 2.0 ** -8) + 2.0 ** -8 * ref.abs()
    return bool(((y.double() - ref).abs() <= bound).all())  # (a NaN fails)


def self_check(gemm: PanelGemm, silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Each compiled kernel against a float64 reference (:func:`within_rounding`): 1 to 200 rows
    (every sliver size, row blocks whole and in part), K past a block of 256 and not a multiple of
    8, an odd number of panels, a row stride wider than K, with and without a bias; and
    :meth:`PanelGemm.silu_and_mul`, where compiled, bit for bit against the GEMM followed by
    ``silu_and_mul`` (the CPU kernels')."""
    g = torch.Generator().manual_seed(0)
    for dtype in sorted(gemm.dtypes, key=str):
        for m, n, k in ((1, 16, 8), (5, 32, 300), (7, 48, 64), (200, 16, 520), (13, 80, 36), (9, 64, 40)):
            x = torch.randn(m, k + 8, generator=g).to(dtype)[:, 4:k + 4]
            w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
            for bias in (b, None):
                got = gemm(x, to_panels(w), bias)
                if got.dtype != dtype or not within_rounding(got, x, w, bias):
                    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                    raise native.NativeKernelError(f"the compiled {dtype} panel GEMM disagrees with torch at {m} x {k} "
                                                   f"-> {n} (max error {(got.double() - ref).abs().max():.3g})")
                if dtype in gemm.gated_dtypes and silu_and_mul is not None and n % (2 * PANEL) == 0:
                    fused = gemm.silu_and_mul(x, to_panels(w), bias)
                    if fused is None or not torch.equal(fused, silu_and_mul(got)):
                        raise native.NativeKernelError(f"the compiled {dtype} GEMM with SiLU-and-mul differs from the "
                                                       f"two ops at {m} x {k} -> {n}")
