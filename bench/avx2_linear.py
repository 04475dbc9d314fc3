"""A decode step's fp32 linear layers through a GEMM of loom's own on AVX2, against oneDNN.

On CPUs without native bf16 (``dtype auto`` = fp32) a batched decode step spends about 60% of
its time in the 120 layer GEMMs, which oneDNN runs on the prepacked weight
(``loom.layers.onednn``) at about 70 GFLOP/s a core at 64 rows, and which lose a fifth of two
threads' speed where the output is 576 columns wide (oneDNN splits the columns in blocks of 64:
nine, five and four). This measures, for the default model's shapes (30 layers of qkv 960x576,
o 576x576, gate/up 3072x576, down 576x1536, each layer with its own weights, so they come from
memory as in a step) and M rows of activations, three ways:

- ``onednn``: oneDNN on the packed weight, what loom's CPU layers run for a decode step's rows;
- ``F.linear``: torch's plain ``(out, in)`` weight (MKL);
- ``avx2``: ``bench/avx2_linear.c``, a prototype: the weight packed once in 16-column panels, the
  threads taking equal shares of the panels, each panel walked in blocks of 256 of K that stay
  in L1 while 6 x 16 tiles of twelve FMA accumulators sweep the rows.

Each row of the table: ms for the 120 calls (median of rounds, the three alternated in each
round) and GFLOP/s. The prototype is checked against a float64 reference first, with and without
a bias, for each shape and row counts that fill one to eleven 6-row slivers, whole and in part
(its error may be at most three times ``F.linear``'s, or 1e-4). It is not used by loom: it sizes
a decode GEMM of loom's own before one is built (``docs/performance.md``, 2026-12-07). Needs an
x86 CPU with AVX2 and FMA and a C compiler.

    python bench/avx2_linear.py
    python bench/avx2_linear.py --rows 1 16 64 128 --rounds 9
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from loom.layers import onednn

sys.path.insert(0, os.path.dirname(__file__))
from amx_linear import LAYERS, SHAPES, compile_here, median_ms  # noqa: E402  (the bf16 AMX prototype's harness)


def build(root: str) -> ctypes.CDLL:
    k = compile_here("avx2_linear", root)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    k.avx2_linear.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
    k.avx2_pack.argtypes = [ptr, i64, i64, ptr]
    k.avx2_packed_floats.argtypes, k.avx2_packed_floats.restype = [i64, i64], i64
    return k


class Packed:
    """A weight in the prototype's panels."""

    def __init__(self, k: ctypes.CDLL, w: torch.Tensor) -> None:
        if w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous():
            raise ValueError("avx2_pack: a contiguous fp32 (n, k) weight")
        self.n, self.k = w.shape
        self.data = torch.empty(k.avx2_packed_floats(self.n, self.k))  # torch aligns it to 64 bytes
        k.avx2_pack(w.data_ptr(), self.n, self.k, self.data.data_ptr())


def avx2_linear(k: ctypes.CDLL, x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != w.k
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (w.n,) or not bias.is_contiguous()))):
        raise ValueError("avx2_linear: fp32 x (m, k) with unit inner stride, bias (n,)")
    out = torch.empty(x.shape[0], w.n)
    rc = k.avx2_linear(x.data_ptr(), x.stride(0), x.shape[0], w.data.data_ptr(), w.n, w.k,
                       None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                       torch.get_num_threads())
    if rc:
        raise RuntimeError(f"avx2_linear returned {rc} for {x.shape[0]} x ({w.n}, {w.k})")
    return out


def check(k: ctypes.CDLL) -> None:
    """Row counts that fill one to eleven 6-row slivers, whole and in part, each shape (and two
    whose columns and K are not whole panels and blocks), with and without a bias, x a view with
    a wider row stride: against a float64 reference, the kernel's error at most three times
    F.linear's (or 1e-4)."""
    g = torch.Generator().manual_seed(0)
    for m in (1, 5, 6, 7, 33, 63, 64, 66):
        for n, kk in [(16, 32), (20, 300), *SHAPES]:
            for with_bias in (True, False):
                x = torch.randn(m, kk + 8, generator=g)[:, 4:kk + 4]  # row stride kk + 8
                w, b = torch.randn(n, kk, generator=g), torch.randn(n, generator=g)
                b = b if with_bias else None
                ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
                errs = [(y.double() - ref).abs().max().item() for y in (avx2_linear(k, x, Packed(k, w), b), F.linear(x, w, b))]
                if errs[0] > max(3 * errs[1], 1e-4):
                    sys.exit(f"avx2_linear is wrong at {m} x {kk} -> {n} (bias: {with_bias}): "
                             f"error {errs[0]:.3g}, F.linear's {errs[1]:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with open("/proc/cpuinfo") as f:
        if not {"avx2", "fma"} <= set(f.read().split()):
            sys.exit("this CPU has no AVX2 and FMA: nothing to measure")
    if any(m < 1 for m in args.rows):
        sys.exit("--rows: at least 1")
    with tempfile.TemporaryDirectory() as root:
        k = build(root)
        check(k)
        g = torch.Generator().manual_seed(1)
        weights = [torch.randn(n, kk, generator=g) * 0.02 for _ in range(LAYERS) for n, kk in SHAPES]
        packed = [onednn.pack_weight(w) for w in weights]
        ours = [Packed(k, w) for w in weights]
        flops_per_row = sum(2 * w.shape[0] * w.shape[1] for w in weights)
        print(f"{len(weights)} linears, {sum(w.numel() * 4 for w in weights) / 1e6:.0f} MB of fp32 weights; "
              f"{torch.get_num_threads()} threads\n")
        print("| rows | path | ms, 120 calls | GFLOP/s |\n|---|---|---|---|")
        with torch.inference_mode():
            for m in args.rows:
                xs = {kk: torch.randn(m, kk, generator=g) for kk in {kk for _, kk in SHAPES}}
                paths = {"onednn": lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                                  for w, p in zip(weights, packed)],
                         "F.linear": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights],
                         "avx2": lambda xs=xs: [avx2_linear(k, xs[w.k], w) for w in ours]}
                for name, ms in median_ms(paths, args.rounds).items():
                    print(f"| {m} | {name} | {ms:.2f} | {flops_per_row * m / ms / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
