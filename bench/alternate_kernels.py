"""The CPU attention kernels of another git revision against this tree's, alternated in one engine.

    python bench/alternate_kernels.py --rev 0224db3 --model default --rounds 6
    python bench/alternate_kernels.py --rev 0224db3 --model opt-125m

One ``loom.LLM`` (the offline workload of ``loom bench offline``: random prompts, greedy, EOS
ignored) runs its rounds through the attention kernels compiled from this tree's sources and from
``--rev``'s (``git show`` of the same files, built as loom builds them), swapped on every attention
layer between calls, A then B and B then A in alternate rounds. Only the kernel library changes:
the model, its weights, the KV cache and the engine are the same objects, so the median of the
rounds' new / old ratios is the change's end-to-end effect, free of this machine's drift between
processes. The other revision's library must take the same arguments (the entry points are looked
up by name as this tree's ``native.PagedDecode`` does).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from offline_throughput import SHAPES, VOCAB, build_random_model  # noqa: E402


def kernels_at(rev: str):
    """``native.PagedDecode`` over the kernel library built from ``rev``'s sources."""
    from loom.attention.backends import native

    folder = "packages/engine-core/src/loom/attention/backends"
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    source = b"".join(subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], capture_output=True, check=True,
                                     cwd=root).stdout for name in native._SOURCES)
    return native.PagedDecode(ctypes.CDLL(native._build(native._compiler(), source)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", required=True, help="the git revision whose kernels are the baseline")
    parser.add_argument("--model", default="default", choices=["default", *SHAPES])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    from loom import LLM, SamplingParams
    from loom.attention.backends import native
    from loom.attention.backends.torch_sdpa import TorchSDPAImpl

    libs = {"this tree": native.paged_decode(), args.rev: kernels_at(args.rev)}
    if libs["this tree"] is None:
        raise SystemExit("this tree's kernels did not build here (see the warning above)")
    with tempfile.TemporaryDirectory() as root:
        model = None if args.model == "default" else build_random_model(args.model, root)
        vocab = 49152 if args.model == "default" else VOCAB.get(args.model, 50272)
        llm = LLM(model, dtype=args.dtype, max_model_len=max(args.input_len + args.output_len, 512))
        try:
            layers = [m.impl for m in llm.llm_engine.executor.worker.model_runner.model.modules()
                      if isinstance(getattr(m, "impl", None), TorchSDPAImpl)]
            if not layers:
                raise SystemExit("no attention layer runs the CPU torch-SDPA backend here")
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}], SamplingParams(max_tokens=2))  # warm-up
            rng, tok_s = random.Random(0), {name: [] for name in libs}
            names = list(libs)
            print(f"{args.model}, {args.dtype}, {args.num_prompts} x ({args.input_len} -> {args.output_len}), "
                  f"{len(layers)} attention layers; output tok/s:")
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    for impl in layers:
                        impl._kernel = libs[name]
                    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
                               for _ in range(args.num_prompts)]
                    start = time.perf_counter()
                    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    tok_s[name].append(tokens / (time.perf_counter() - start))
                print(f"  round {r + 1}: " + ", ".join(f"{n} {tok_s[n][-1]:,.0f}" for n in names), flush=True)
        finally:
            llm.shutdown()
    ratios = [a / b for a, b in zip(tok_s[names[0]], tok_s[names[1]])]
    print(f"this tree / {args.rev}: median {statistics.median(ratios):.3f} of {len(ratios)} rounds "
          f"(medians {statistics.median(tok_s[names[0]]):,.0f} and {statistics.median(tok_s[names[1]]):,.0f} tok/s)")


if __name__ == "__main__":
    main()
