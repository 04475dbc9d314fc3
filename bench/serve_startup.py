"""Time from launching ``loom serve`` to ``/health`` 200, and the process tree's RSS then,
over a matrix of models and TP sizes: ``loom bench startup`` for each configuration.

    python bench/serve_startup.py                      # tiny model and the default model, TP 1 and 2
    python bench/serve_startup.py --models tiny --runs 3
    loom bench startup [MODEL] --runs 5 --plot startup.png   # one configuration, with its timeline

Median of ``--runs`` launches per configuration, after one warm-up launch that is not counted
(it fills the GGUF conversion cache and the page cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from loom.benchmarks import startup

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "default"], choices=["tiny", "default"])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-trace", action="store_true", help="do not pass --startup-trace to loom serve")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            if name == "tiny":
                from tiny_models import build_tiny_model

                model_args = [str(build_tiny_model(Path(root) / "tiny", "llama", tie=False)), "--max-model-len", "512"]
            else:
                model_args = ["--max-model-len", "2048"]
            for tp in args.tp:
                if name == "default" and 9 % tp:  # SmolLM2-135M has 9 attention heads
                    print(f"{name} TP={tp}: skipped, 9 attention heads do not split {tp} ways", flush=True)
                    continue
                r = startup.run([*model_args, "-tp", str(tp)], args.runs, trace=not args.no_trace, log_dir=root)
                t, mib = r["time_to_ready_s"], r["tree_rss_bytes"]["median"] / MIB
                rows.append((name, tp, t["median"], t["min"], t["max"], mib))
                print(f"{name} TP={tp}: ready in {t['median']:.2f} s (median of {args.runs}, "
                      f"{t['min']:.2f}-{t['max']:.2f}), tree RSS {mib:.0f} MiB", flush=True)
                print(startup.table(r), flush=True)
    print("\n| model | TP | launch -> /health 200 (median) | min-max | process tree RSS |\n|---|---|---|---|---|")
    for name, tp, median, lo, hi, mib in rows:
        print(f"| {name} | {tp} | {median:.2f} s | {lo:.2f}-{hi:.2f} s | {mib:.0f} MiB |")


if __name__ == "__main__":
    main()
