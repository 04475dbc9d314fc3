"""The CPU platform's 4-bit decode linears alone, replayed as a decode step replays them: the
default model's shapes (30 layers of qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536,
groups of 32, one row of activations), recorded once as ``tape_run`` calls (no Python between
them) and timed

- cold: all 120 weights in turn (about 66 MB, more than the caches hold), as a decode step reads
  them, against the read bandwidth a 1 GiB torch sum measures in the same run;
- hot: one layer's four weights over and over (in the caches): the kernels' arithmetic alone.

    python bench/quant_linear.py                 # 2 threads (torch's), bf16 activations where native
    python bench/quant_linear.py --threads 1 --dtype float32

Random codes and scales; the figure depends on the shapes, not the values. Run it beside a
change to the kernels (``PYTHONPATH`` pointing at the other tree) and compare in the same minutes:
on a shared machine the bandwidth moves by a third within an hour.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from loom.attention.backends import native
from loom.platforms import cpu_kernels
from loom.platforms.cpu_features import native_bf16
from loom.worker import cpu_step_replay
from single_stream import read_bandwidth  # the same 1 GiB sum as the single-stream figures

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs) of one layer


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def record(k: cpu_kernels.CpuKernels, layers: list, dtype: torch.dtype) -> tuple[list, list]:
    """The q4_linear calls of ``layers`` as the replayed step makes them, and their outputs (kept
    alive: the recorded calls write into them)."""
    outs = []
    native.tape = []
    try:
        for packed in layers:
            out = k.q4_linear(torch.randn(1, packed.k, dtype=dtype), packed)
            if out is None:
                raise SystemExit(f"the 4-bit kernel refused {packed}")
            outs.append(out)
        ops = native.tape
    finally:
        native.tape = None
    return cpu_step_replay._taped(ops), outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if native_bf16()[0] else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    k = cpu_kernels.kernels()
    if k is None:
        raise SystemExit("the CPU kernels are not available here (see the warning above)")
    g = torch.Generator().manual_seed(0)
    layers, nbytes = [], 0
    for _ in range(30):
        for n, kk in SHAPES:
            q = torch.randint(0, 16, (n, kk), dtype=torch.uint8, generator=g)
            scale = torch.rand(n, kk // 32, generator=g) * 0.01
            packed = k.pack_q4(q, scale, torch.rand(n, kk // 32, generator=g) * 0.01, dtype)
            layers.append(packed)
            nbytes += _bytes(packed)
    kind = "int8 activations (AVX512-VNNI)" if layers[0].layout == 1 else "exact weight-only"
    print(f"{len(layers)} 4-bit linears, {nbytes / 1e6:.1f} MB, {dtype}, {torch.get_num_threads()} threads, {kind}")
    bw = read_bandwidth()
    rows = []
    for name, chosen in (("cold", layers), ("hot", [layers[i % 4] for i in range(len(layers))])):
        ops, _outs = record(k, chosen, dtype)
        step_bytes = sum(_bytes(p) for p in chosen)
        for _ in range(20):
            _replay(ops)
        times = sorted(_timed(lambda ops=ops: _replay(ops)) for _ in range(args.reps))
        med = statistics.median(times)
        rows.append((name, med, times[len(times) // 10], step_bytes / med))
    print(f"read bandwidth (1 GiB torch sum, best of 4): {bw / 1e9:.1f} GB/s\n")
    print("| weights | 120 calls, median | p10 | bytes read / s | of the sum's bandwidth |")
    print("|---|---|---|---|---|")
    for name, med, p10, rate in rows:
        print(f"| {name} | {med * 1e3:.3f} ms | {p10 * 1e3:.3f} ms | {rate / 1e9:.1f} GB/s | {rate / bw:.0%} |")


def _bytes(packed) -> int:
    return sum(t.numel() * t.element_size() for t in (packed.codes, packed.scale, packed.zero, packed.scale_zero)
               if t is not None)


def _replay(ops: list) -> None:
    for fn, a in ops:
        fn(*a)


if __name__ == "__main__":
    main()
