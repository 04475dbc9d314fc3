"""A decode step's bf16 linear layers on AMX tiles straight from the plain weight, against oneDNN.

Where loom's batched decode step spends its GEMM time: the default model's 120 linear layers
(30 layers of qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536, each layer with its own
weights, so they come from memory as in a step) for M rows of activations, three ways:

- ``onednn``: the weight prepacked for oneDNN (``loom.layers.onednn``), what loom's CPU layers run;
- ``F.linear``: torch's plain ``(out, in)`` weight;
- ``amx``: ``bench/amx_linear.c``, a prototype kernel that multiplies on AMX tiles loaded straight
  from the plain weight (it computes out^T = W . x^T, so the weight needs no packed copy) and
  prefetches the next weight rows while it multiplies.

Each row: ms for the 120 calls (median of rounds, the three alternated in each round), the weight
bytes read over that time, and that as a share of the read bandwidth of a 1 GiB ``torch`` sum
measured in the same run. Where a path's time stays flat as M grows it is bound by reading the
weights. The prototype is checked against an fp32 reference first, with and without a bias, for
each shape and row counts that fill one to four 16-row blocks, whole and in part (its error may be
at most twice ``F.linear``'s, or 1e-2). It is not used by loom: it exists to size an AMX decode path before one is
built (``docs/performance.md``, 2026-12-06). Needs a CPU with AMX-BF16 and a C compiler.

    python bench/amx_linear.py
    python bench/amx_linear.py --rows 1 4 16 64 --rounds 9
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from loom.layers import onednn

sys.path.insert(0, os.path.dirname(__file__))
from single_stream import read_bandwidth  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer, as loom fuses them
LAYERS = 30


def build(root: str) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        sys.exit("no C compiler (cc or gcc on PATH, or CC)")
    src, lib = os.path.join(os.path.dirname(__file__), "amx_linear.c"), os.path.join(root, "amx_linear.so")
    subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", lib, src], check=True)
    k = ctypes.CDLL(lib)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    k.amx_linear_bf16.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
    return k


def amx_linear(k: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    m, n = x.shape[0], w.shape[0]
    if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or w.dim() != 2
            or x.stride(1) != 1 or not w.is_contiguous() or x.shape[1] != w.shape[1]
            or (bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()))):
        raise ValueError("amx_linear: bf16 x (m, k) with unit inner stride, contiguous bf16 w (n, k), bias (n,)")
    out = torch.empty(m, n, dtype=torch.bfloat16)
    rc = k.amx_linear_bf16(x.data_ptr(), x.stride(0), m, w.data_ptr(), n, w.shape[1],
                           None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                           torch.get_num_threads())
    if rc:
        raise RuntimeError(f"amx_linear_bf16 returned {rc} for {m} x {tuple(w.shape)}")
    return out


def check(k: ctypes.CDLL) -> None:
    """Row counts that fill one to four 16-row blocks, whole and in part, each shape, with and
    without a bias, x a view with a wider row stride: against an fp32 reference, the kernel's
    relative error at most twice F.linear's (or 1e-2)."""
    g = torch.Generator().manual_seed(0)
    for m in (1, 5, 16, 17, 33, 48, 50, 63, 64):
        for n, kk in [(16, 32), *SHAPES]:
            for with_bias in (True, False):
                x = torch.randn(m, kk + 32, generator=g).bfloat16()[:, 16:kk + 16]  # row stride kk + 32
                w, b = torch.randn(n, kk, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
                b = b if with_bias else None
                ref = x.float() @ w.float().T + (b.float() if with_bias else 0)
                errs = [((y.float() - ref).abs() / (ref.abs() + 1)).max().item()
                        for y in (amx_linear(k, x, w, b), F.linear(x, w, b))]
                if errs[0] > max(2 * errs[1], 1e-2):
                    sys.exit(f"amx_linear_bf16 is wrong at {m} x {kk} -> {n} (bias: {with_bias}): "
                             f"error {errs[0]:.3g}, F.linear's {errs[1]:.3g}")


def timed_rounds(paths: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each path in each of ``rounds`` rounds, the paths alternated within a round (after
    one round that warms up)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds + 1):
        for name, run in paths.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: t[1:] for name, t in times.items()}


def median_ms(paths: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    return {name: statistics.median(t) * 1e3 for name, t in timed_rounds(paths, rounds).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with open("/proc/cpuinfo") as f:
        if "amx_bf16" not in f.read().split():
            sys.exit("this CPU has no AMX-BF16: nothing to measure")
    if any(not 1 <= m <= 64 for m in args.rows):
        sys.exit("--rows: the prototype takes 1 to 64 rows")
    with tempfile.TemporaryDirectory() as root:
        k = build(root)
        if k.amx_ready() != 1:
            sys.exit("the kernel may not use AMX here (arch_prctl refused XTILEDATA)")
        check(k)
        g = torch.Generator().manual_seed(1)
        weights = [torch.randn(n, kk, generator=g).bfloat16() * 0.02 for _ in range(LAYERS) for n, kk in SHAPES]
        packed = [onednn.pack_weight(w) for w in weights] if onednn.packs(torch.bfloat16) else None
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        bandwidth = read_bandwidth()
        print(f"{len(weights)} linears, {nbytes / 1e6:.0f} MB of bf16 weights; {torch.get_num_threads()} threads; "
              f"read bandwidth (1 GiB torch sum, best of 4) {bandwidth / 1e9:.1f} GB/s\n")
        print("| rows | path | ms, 120 calls | weight GB/s | of the bandwidth |\n|---|---|---|---|---|")
        with torch.inference_mode():
            for m in args.rows:
                xs = {kk: torch.randn(m, kk, generator=g).bfloat16() for kk in {kk for _, kk in SHAPES}}
                paths = {"F.linear": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights],
                         "amx": lambda xs=xs: [amx_linear(k, xs[w.shape[1]], w) for w in weights]}
                if packed is not None:
                    paths["onednn"] = lambda xs=xs: [onednn.linear(xs[w.shape[1]], p, None)
                                                     for w, p in zip(weights, packed)]
                for name, ms in median_ms(paths, args.rounds).items():
                    gbs = nbytes / ms / 1e6
                    print(f"| {m} | {name} | {ms:.2f} | {gbs:.1f} | {gbs * 1e9 / bandwidth:.0%} |", flush=True)


if __name__ == "__main__":
    main()
