"""A step's linear layers through loom's own GEMM, against oneDNN and MKL: fp32 (AVX2 CPUs) or,
with ``--dtype bfloat16``, bf16 (CPUs with AVX512-BF16).

On CPUs without native bf16 (``dtype auto`` = fp32) a batched decode step spends about 60% of
its time in the 120 layer GEMMs. oneDNN, on its prepacked weight, runs them at about 70
GFLOP/s a core at 64 rows and loses a fifth of two threads' speed where the output is 576
columns wide (it splits the columns in blocks of 64: nine, five and four); MKL's ``F.linear``
is slower still at few rows, faster at many. This measures, for the default model's shapes (30
layers of qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536, each layer with its own
weights, so they come from memory as in a step) and M rows of activations, three ways:

- ``onednn``: oneDNN on the packed weight (what loom's CPU layers run where ``panels`` does not);
- ``F.linear``: torch's plain ``(out, in)`` weight (MKL);
- ``panels``: ``loom/platforms/cpu_gemm.c``, what loom's fp32 layers run on AVX2 CPUs: the
  weight in 16-column panels, the threads taking equal shares of the panels, rows in blocks of
  192 that stay in L2, each panel walked in blocks of 256 of K that stay in L1 while 6 x 16
  tiles of twelve FMA accumulators sweep the rows.

With ``--dtype bfloat16`` the weights are bf16 and ``panels`` is the bf16 kernel of the same
file (``vdpbf16ps``: 8 x 32 tiles over the whole of K, pairs of k side by side in the panel);
``F.linear`` is then oneDNN too, on the plain weight. A second table then times the 30 gate/up
GEMMs with their SiLU-and-mul: two ops against the kernel's one pass.

Each row of the table: ms for the 120 calls (median of rounds, the three alternated in each
round), GFLOP/s, and for ``panels`` its speed over oneDNN's, the median of the rounds' ratios (a
figure the machine's drift between rounds moves less). Needs an x86 CPU with AVX2 and FMA (fp32)
or AVX512-BF16 (bf16) and a C compiler (loom's CPU kernels).

    python bench/avx2_linear.py
    python bench/avx2_linear.py --rows 1 16 64 128 --rounds 9
    python bench/avx2_linear.py --dtype bfloat16 --rows 8 64 256 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from loom.layers import onednn
from loom.platforms import cpu_gemm
from loom.platforms.cpu_kernels import kernels

sys.path.insert(0, os.path.dirname(__file__))
from amx_linear import LAYERS, SHAPES, timed_rounds  # noqa: E402  (the bf16 AMX prototype's harness)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    k = kernels()
    gemm = None if k is None else k.panel_linear
    if gemm is None or dtype not in gemm.dtypes:
        sys.exit(f"loom's {args.dtype} panel GEMM is not compiled here (it needs AVX2 and FMA for float32, "
                 "AVX512-BF16 for bfloat16, and a C compiler): nothing to measure")
    if any(m < 1 for m in args.rows):
        sys.exit("--rows: at least 1")
    g = torch.Generator().manual_seed(1)
    weights = [(torch.randn(n, kk, generator=g) * 0.02).to(dtype) for _ in range(LAYERS) for n, kk in SHAPES]
    packed = [onednn.pack_weight(w) for w in weights]
    panels = [cpu_gemm.to_panels(w) for w in weights]
    flops_per_row = sum(2 * w.shape[0] * w.shape[1] for w in weights)
    print(f"{len(weights)} linears, {sum(w.numel() * w.element_size() for w in weights) / 1e6:.0f} MB of {args.dtype} "
          f"weights; {torch.get_num_threads()} threads\n")
    print("| rows | path | ms, 120 calls | GFLOP/s | speed over oneDNN |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for m in args.rows:
            xs = {kk: torch.randn(m, kk, generator=g).to(dtype) for kk in {kk for _, kk in SHAPES}}
            paths = {"onednn": lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                              for w, p in zip(weights, packed)],
                     "F.linear": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights],
                     "panels": lambda xs=xs: [gemm(xs[w.shape[1]], p) for w, p in zip(weights, panels)]}
            times = timed_rounds(paths, args.rounds)
            for name, t in times.items():
                ms = statistics.median(t) * 1e3
                ratio = statistics.median(a / b for a, b in zip(times["onednn"], t))
                print(f"| {m} | {name} | {ms:.2f} | {flops_per_row * m / ms / 1e6:.0f} | "
                      f"{f'{ratio:.3f}x' if name == 'panels' else ''} |", flush=True)
    if dtype in gemm.gated_dtypes:
        gated(gemm, k, [p for w, p in zip(weights, panels) if w.shape == (2 * 1536, 576)], args.rows, args.rounds)


def gated(gemm: cpu_gemm.PanelGemm, k, panels: list[torch.Tensor], rows: list[int], rounds: int) -> None:
    """The 30 gate/up GEMMs with their SiLU-and-mul: as two ops (the GEMM writes [gate | up], the CPU
    kernels' ``silu_and_mul`` reads it back) against one pass (``PanelGemm.silu_and_mul``, what a
    Llama MLP runs where it can; the same bits)."""
    print(f"\n{len(panels)} gate/up GEMMs (3072 x 576) with SiLU-and-mul\n")
    print("| rows | path | ms, 30 calls | speed over two ops |\n|---|---|---|---|")
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, 576, generator=g).bfloat16()
            paths = {"two ops": lambda x=x: [k.silu_and_mul(gemm(x, p)) for p in panels],
                     "one pass": lambda x=x: [gemm.silu_and_mul(x, p) for p in panels]}
            times = timed_rounds(paths, rounds)
            for name, t in times.items():
                ratio = statistics.median(a / b for a, b in zip(times["two ops"], t))
                print(f"| {m} | {name} | {statistics.median(t) * 1e3:.2f} | "
                      f"{f'{ratio:.3f}x' if name == 'one pass' else ''} |", flush=True)


if __name__ == "__main__":
    main()
