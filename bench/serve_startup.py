"""Time from launching ``loom serve`` to ``/health`` 200, and the process tree's RSS then.

    python bench/serve_startup.py                      # tiny model and the default model, TP 1 and 2
    python bench/serve_startup.py --models tiny --runs 3

Median of ``--runs`` launches per configuration. The GGUF conversion of the default model
is cached after the first launch (a warm-up launch runs first and is not counted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from _serve import start, stop, tree_rss_bytes, wait_healthy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "default"], choices=["tiny", "default"])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            if name == "tiny":
                from pathlib import Path

                from tiny_models import build_tiny_model

                model_args = [str(build_tiny_model(Path(root) / "tiny", "llama", tie=False)), "--max-model-len", "512"]
            else:
                model_args = ["--max-model-len", "2048"]
            for tp in args.tp:
                if name == "default" and 9 % tp:  # SmolLM2-135M has 9 attention heads
                    print(f"{name} TP={tp}: skipped, 9 attention heads do not split {tp} ways", flush=True)
                    continue
                times, rss = [], []
                for run in range(args.runs + 1):
                    proc, url, launched = start([*model_args, "-tp", str(tp)], os.path.join(root, "serve.log"))
                    try:
                        ready = wait_healthy(proc, url)
                        if run > 0:  # run 0 warms caches (GGUF conversion, page cache)
                            times.append(ready - launched)
                            rss.append(tree_rss_bytes(proc.pid))
                    finally:
                        stop(proc)
                median = statistics.median(times)
                rows.append((name, tp, median, min(times), max(times), statistics.median(rss) / 2**20))
                print(f"{name} TP={tp}: ready in {median:.2f} s (median of {len(times)}, "
                      f"{min(times):.2f}-{max(times):.2f}), tree RSS {rows[-1][-1]:.0f} MiB", flush=True)
    print("\n| model | TP | launch -> /health 200 (median) | min-max | process tree RSS |\n|---|---|---|---|---|")
    for name, tp, median, lo, hi, mib in rows:
        print(f"| {name} | {tp} | {median:.2f} s | {lo:.2f}-{hi:.2f} s | {mib:.0f} MiB |")


if __name__ == "__main__":
    main()
