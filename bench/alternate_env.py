"""Two settings of one engine, alternated in one process: the speed ratio of a change this
machine's drift would hide.

On the project's 2-core machines one commit's offline figure moves by 10-15% between processes
minutes apart, more than many changes move it. This builds two ``loom.LLM`` engines in one
process, each under its own environment variables (read while the engine loads and during a
first batched call, which this makes under them: a kernel switch such as
``LOOM_CPU_PANEL_GEMM``), and runs the offline workload (``loom bench
offline``'s: random prompts, greedy, EOS ignored) through them in turn, ``--rounds`` times, A
then B and B then A in alternate rounds, each call on prompts of its own. It prints each call's
output tok/s, and the median of the rounds' A / B ratios: the figure to quote.

Both engines hold their weights and KV cache at once (the default model in bf16: about 3.5 GB
each).

    python bench/alternate_env.py --a LOOM_CPU_PANEL_GEMM=1 --b LOOM_CPU_PANEL_GEMM=0 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from loom import LLM, SamplingParams, envs
from loom.benchmarks.workloads import Workload


def _settings(items: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            sys.exit(f"{flag} takes NAME=VALUE environment settings, not {item!r}")
        pairs[name] = value
    return pairs


def _engine(settings: dict[str, str], args: argparse.Namespace, warmup: list[int]) -> LLM:
    """An engine loaded under ``settings``, with one batched warm-up call still under them: some
    layers make their batched weight form at their first batch (a GGUF model's dense copy), after
    start-up froze the variables (``envs.enable_envs_cache``), so the freeze is lifted around it."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        envs._disable_envs_cache_for_tests()
        llm = LLM(args.model, dtype=args.dtype)
        envs._disable_envs_cache_for_tests()
        llm.generate([{"prompt_token_ids": warmup}] * 4, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        return llm
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        envs._disable_envs_cache_for_tests()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", nargs="+", required=True, metavar="NAME=VALUE", help="engine A's environment")
    parser.add_argument("--b", nargs="+", required=True, metavar="NAME=VALUE", help="engine B's environment")
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    if args.rounds < 1:
        sys.exit("--rounds: at least 1")
    settings = {"A": _settings(args.a, "--a"), "B": _settings(args.b, "--b")}
    workload = Workload(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
    warmup = workload.prompts(-1)[0]  # ids below every vocabulary's size (loom bench's range)
    engines = {name: _engine(s, args, warmup) for name, s in settings.items()}
    vocab = engines["A"].config.model_config.get_vocab_size()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    print(f"{workload.describe()}; A: {' '.join(args.a)}; B: {' '.join(args.b)}\n")
    print("| round | A tok/s | B tok/s | A / B |\n|---|---|---|---|")
    speed: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            prompts = [{"prompt_token_ids": p} for p in workload.prompts(2 * r + (name == "B"), vocab)]
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            speed[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        print(f"| {r + 1} | {speed['A'][-1]:.0f} | {speed['B'][-1]:.0f} | {speed['A'][-1] / speed['B'][-1]:.3f} |",
              flush=True)
    ratios = [a / b for a, b in zip(speed["A"], speed["B"])]
    print(f"\nmedian A / B over {args.rounds} rounds: {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-"
          f"{max(ratios):.3f}); median tok/s A {statistics.median(speed['A']):.0f}, B {statistics.median(speed['B']):.0f}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
