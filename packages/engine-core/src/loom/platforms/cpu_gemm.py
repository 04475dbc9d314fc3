"""The fp32 linear layer of loom's own for AVX2 + FMA CPUs (``cpu_gemm.c``, built with the other
CPU kernels).

On CPUs without native bf16 (``dtype auto`` = fp32) the layer GEMMs are most of a step. oneDNN's
AVX2 kernels run a decode step's 64 rows at about 134 GFLOP/s on 2 cores of an AMD EPYC and
lose a fifth of the second core where a layer's output is 576 columns wide; this one splits the
columns evenly between the threads and runs them at 171 (165 before each weight block asked for
the next ahead), and many rows (prefill) at MKL's speed without the per-call dense copy that path
needs (``bench/avx2_linear.py``).

Its weight form is the panel tensor: a ``(n, k)`` weight, ``n`` a multiple of :data:`PANEL`, as
``(n / 16, k, 16)`` float32, contiguous (:func:`to_panels`; :func:`from_panels` gives the dense
weight back). A 3-D tensor cannot pass for a dense weight: ``F.linear`` refuses it.
``layers/onednn.py`` decides where layers hold it.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ..attention.backends import native

__all__ = ["PANEL", "PanelGemm", "from_panels", "row_layout", "self_check", "to_panels", "within_rounding"]

PANEL = 16
"""Output columns a panel: a weight's rows must be a multiple of it."""

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """The panel tensor of a dense float32 ``(n, k)`` weight, ``n`` a multiple of :data:`PANEL`."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[0] % PANEL or not weight.shape[0]:
        raise ValueError(f"to_panels takes a float32 (n, k) weight with n a multiple of {PANEL}, not "
                         f"{weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor) -> torch.Tensor:
    """The dense ``(n, k)`` weight of a panel tensor (a copy)."""
    return panels.transpose(1, 2).reshape(panels.shape[0] * PANEL, panels.shape[1])


def row_layout(rows: int, cols: int) -> tuple[torch.Tensor, int, int]:
    """Where a panel tensor of a ``(rows, cols)`` weight keeps element ``(r, i)``: ``row_offset[r]
    + i * 16`` elements in, as ``layers/onednn.row_layout`` gives oneDNN's (a column stride of 16,
    groups of 1)."""
    r = torch.arange(rows)
    return r // PANEL * PANEL * cols + r % PANEL, PANEL, 1


class PanelGemm:
    """``F.linear(x, from_panels(panels), bias)`` through ``panel_linear_f32``; any x the kernel
    cannot take (not float32, not on the CPU) goes through ``F.linear`` on the dense weight, which
    computes it or says what is wrong (a width that does not fit, a dtype mismatch)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.panel_linear_f32
        self._fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT]
        self._fn.restype = ctypes.c_int

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (panels.dtype != torch.float32 or panels.ndim != 3 or panels.shape[2] != PANEL or not panels.is_cpu
                or not panels.is_contiguous()):
            raise ValueError(f"PanelGemm takes the contiguous float32 (n / {PANEL}, k, {PANEL}) CPU tensor of "
                             f"to_panels, not {panels.dtype} {tuple(panels.shape)} on {panels.device}")
        n, k = panels.shape[0] * PANEL, panels.shape[1]
        if (x.dtype != torch.float32 or x.ndim == 0 or x.shape[-1] != k or not x.is_cpu
                or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()
                                          or not bias.is_cpu))):
            return F.linear(x, from_panels(panels), bias)
        rows = x.reshape(-1, k) if x.ndim != 2 else x
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)  # (whatever torch's default dtype)
        if rows.shape[0]:
            rc = native.call(self._fn, rows.data_ptr(), rows.stride(0), panels.data_ptr(),
                             0 if bias is None else bias.data_ptr(), out.data_ptr(), n, rows.shape[0], n, k,
                             torch.get_num_threads())
            if rc:
                raise RuntimeError(f"panel_linear_f32 refused ({n}, {k}) panels at {panels.data_ptr():#x}: "
                                   "a weight not made by to_panels")
        return out if x.ndim == 2 else out.view(*x.shape[:-1], n)


def within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``y`` is ``F.linear(x, w, bias)`` to within the worst case of fp32 sums of K + 1
    terms in any order: ``(K + 1) u (|x| |w|^T + |bias|)`` an element, u = 2^-24 (a term left out
    or counted twice is off by orders of magnitude more)."""
    x, w = x.double(), w.double()
    ref = x @ w.T + (0 if bias is None else bias.double())
    bound = (x.shape[-1] + 1) * 2.0 ** -24 * (x.abs() @ w.abs().T + (0 if bias is None else bias.double().abs()))
    return bool(((y.double() - ref).abs() <= bound).all())  # (a NaN fails)


def self_check(gemm: PanelGemm) -> None:
    """The kernel against a float64 reference (:func:`within_rounding`): 1 to 200 rows (every
    sliver size, row blocks whole and in part), K past a block of 256 and not a multiple of 8, a
    row stride wider than K, with and without a bias."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 16, 8), (5, 32, 300), (7, 48, 64), (200, 16, 520)):
        x = torch.randn(m, k + 8, generator=g)[:, 4:k + 4]
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        for bias in (b, None):
            got = gemm(x, to_panels(w), bias)
            if not within_rounding(got, x, w, bias):
                err = (got.double() - F.linear(x.double(), w.double(), None if bias is None else bias.double())).abs()
                raise native.NativeKernelError(f"the compiled panel_linear_f32 disagrees with torch at {m} x {k} -> "
                                               f"{n} (max error {err.max():.3g})")
