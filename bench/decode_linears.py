"""A decode step's linear layers at a given batch: the dense bf16 path against the 4-bit kernel.

The default model's shapes (30 layers of qkv 960x576, o 576x576, gate/up 3072x576, down
576x1536), each layer with its own weights, as a decode step reads them, for M rows of
activations (M decoding streams), through both paths of the CPU platform's quantized linear
(``loom.layers.quantized``) on the same 4-bit weights, prepared as a model load prepares them
(``CpuQuantizedWeight``):

- dense: the dequantized bf16 copy prepacked for oneDNN, the path of a quantized model's larger
  steps (and, as plain bf16 weights, of every step of an unquantized model);
- 4-bit: the weight's few-rows kernel (``CpuKernels.q4_linear``, int8 activations where the CPU
  has AVX512-VNNI), the path of steps of up to the weight's ``max_rows`` (``QUANT_INT8_MAX_ROWS``,
  8, with int8 activations, ``QUANT_MAX_ROWS``, 4, without); the kernel takes at most 8 rows.

Each row: ms for the 120 calls, the weight bytes read over that time, GFLOP/s. Where the dense
path's time stays flat as M grows it is bound by reading the weights, not by its arithmetic;
where the 4-bit path's grows with M it is bound by its arithmetic. Their crossing is the batch
up to which a GGUF model's decode is cheaper on its 4-bit codes on this machine.

    python bench/decode_linears.py
    python bench/decode_linears.py --rows 1 4 8 16 64 --threads 2

Random weights (the time depends on the shapes, not the values). Python calls each layer, as
an eager batched step does; on a shared machine, compare figures from the same minutes.
"""

from __future__ import annotations

import argparse
import time

import torch
from loom.layers import onednn
from loom.layers.quantized import CpuQuantizedWeight, cpu_quantized_linear
from loom.platforms import cpu_kernels
from loom_plugin_api.ops import QuantizedWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs) of one layer
LAYERS = 30


def timed(run, repeat: int) -> float:
    """Seconds per call of ``run``, best of three rounds of ``repeat`` after two warm-up calls."""
    for _ in range(2):
        run()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            run()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k = cpu_kernels.kernels()
    if k is None:
        raise SystemExit("the CPU platform's compiled kernels are not available here (see the warning above)")
    if not onednn.packs(torch.bfloat16):
        raise SystemExit("oneDNN does not pack bf16 weights on this CPU: the dense path here is not the one measured")
    g = torch.Generator().manual_seed(0)

    def weight(o: int, i: int) -> CpuQuantizedWeight:
        codes = torch.randint(0, 16, (o, i), dtype=torch.uint8, generator=g)
        scale, zero = torch.rand(o, i // 32, generator=g) * 0.01, -torch.rand(o, i // 32, generator=g) * 0.08
        w = cpu_quantized_linear.prepare(QuantizedWeight(codes, scale, zero, 4, 32), torch.bfloat16)
        w.make_dense()  # as finish_quantized does at load
        return w

    layers = [[weight(o, i) for o, i in SHAPES] for _ in range(LAYERS)]
    flops_per_row = 2 * sum(o * i for o, i in SHAPES) * LAYERS
    dense_bytes = 2 * sum(o * i for o, i in SHAPES) * LAYERS
    q4_bytes = sum(w.nbytes for layer in layers for w in layer)
    print(f"{args.threads} threads; the default model's 120 decode linears: {dense_bytes / 1e6:.0f} MB as bf16, "
          f"{q4_bytes / 1e6:.0f} MB as 4-bit codes and scales; int8 activations: {k.int8_activations}, "
          f"so the codes take steps of up to {layers[0][0].max_rows} rows\n")
    print("| rows | dense bf16 ms | GB/s | GFLOP/s | 4-bit ms | GB/s | GFLOP/s | faster |")
    print("|---|---|---|---|---|---|---|---|")
    for m in args.rows:
        xs = {i: torch.randn(m, i, generator=g, dtype=torch.bfloat16) for _, i in SHAPES}

        def run_dense(xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in layers:
                for (_, i), w in zip(SHAPES, layer):
                    onednn.linear(xs[i], w.dense, None)

        def run_q4(xs: dict[int, torch.Tensor] = xs) -> bool:
            for layer in layers:
                for (_, i), w in zip(SHAPES, layer):
                    if w.few_rows(xs[i]) is None:
                        return False
            return True

        t_dense = timed(run_dense, args.repeat)
        cells = f"| {m} | {t_dense * 1e3:.2f} | {dense_bytes / t_dense / 1e9:.1f} | {flops_per_row * m / t_dense / 1e9:.0f} |"
        if run_q4():
            t_q4 = timed(run_q4, args.repeat)
            faster = "4-bit" if t_q4 < t_dense else "dense"
            cells += f" {t_q4 * 1e3:.2f} | {q4_bytes / t_q4 / 1e9:.1f} | {flops_per_row * m / t_q4 / 1e9:.0f} | {faster} |"
        else:
            cells += " - | - | - | dense (the 4-bit kernel takes at most 8 rows) |"
        print(cells)


if __name__ == "__main__":
    main()
