"""``loom bench startup``: launch ``loom serve`` again and again, time each launch to ``/health`` 200.

One warm-up launch first (it fills the page cache and the GGUF conversion cache), not counted;
then ``runs`` launches, each measured from just before the process is spawned to the first
``/health`` answer of 200, with the process tree's RSS read at that moment. Each launch is
stopped (SIGTERM) before the next starts.

When ``loom serve`` takes ``--startup-trace FILE``, every launch writes one, and the figures
keep its spans: which process spent its time where (:mod:`loom.benchmarks.trace`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

from tqdm import tqdm

from . import server
from .report import format_table
from .trace import Span, longest, per_process, read_trace

MIB = 2**20
TRACE_FLAG = "--startup-trace"


def run(serve_args: list[str], runs: int, *, trace: bool, log_dir: str) -> dict[str, Any]:
    traced = trace and server.serve_has_flag(TRACE_FLAG)
    note = "on" if traced else ("off (--no-trace)" if not trace else f"loom serve has no {TRACE_FLAG} flag")
    records = []
    with tqdm(total=runs + 1, desc="launches of loom serve", unit="launch", dynamic_ncols=True) as bar:
        for i in range(runs + 1):
            records.append(_launch(serve_args, i, traced, log_dir))
            bar.update(1)
    counted = [r for r in records if not r["warmup"]]
    times = [r["time_to_ready_s"] for r in counted]
    rss = [r["tree_rss_bytes"] for r in counted]
    median_run = min(counted, key=lambda r: abs(r["time_to_ready_s"] - statistics.median(times)))
    return {
        "serve_args": serve_args,
        "trace": note,
        "runs": records,
        "time_to_ready_s": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "tree_rss_bytes": {"median": statistics.median(rss), "min": min(rss), "max": max(rss)},
        "median_run": median_run["run"],
    }


def _launch(serve_args: list[str], i: int, traced: bool, log_dir: str) -> dict[str, Any]:
    log_path = os.path.join(log_dir, f"serve-{i}.log")
    trace_path = os.path.join(log_dir, f"startup-trace-{i}.json") if traced else None
    proc, url, launched = server.start([*serve_args, *([TRACE_FLAG, trace_path] if trace_path else [])], log_path)
    try:
        ready = server.wait_healthy(proc, url, log_path=log_path)
        rss = server.tree_rss_bytes(proc.pid)
    finally:
        server.stop(proc)
    spans = read_trace(trace_path) if trace_path and os.path.exists(trace_path) else None
    return {"run": i, "warmup": i == 0, "time_to_ready_s": ready - launched, "tree_rss_bytes": rss,
            "spans": [dataclasses.asdict(s) for s in spans] if spans is not None else None}


def spans_of(results: dict[str, Any], run: int | None = None) -> list[Span]:
    """The spans of one launch (default: the median one); empty when it wrote no trace."""
    record = results["runs"][results["median_run"] if run is None else run]
    return [Span(**s) for s in record["spans"] or []]


def table(results: dict[str, Any]) -> str:
    rows: list[list[Any]] = [["warm-up" if r["warmup"] else str(r["run"]), r["time_to_ready_s"],
                              r["tree_rss_bytes"] / MIB] for r in results["runs"]]
    for stat in ("median", "min", "max"):
        rows.append([stat, results["time_to_ready_s"][stat], results["tree_rss_bytes"][stat] / MIB])
    lines = [format_table(["run", "launch -> /health 200 s", "tree RSS MiB"], rows),
             "(the warm-up launch is not counted)", f"start-up trace: {results['trace']}"]
    spans = spans_of(results)
    if spans:
        lines += ["", f"where run {results['median_run']} (the median) spent its start-up, per process:",
                  format_table(["process", "first span s", "last end s", "longest outer span", "s"],
                               [[p["process"], p["start_s"], p["end_s"], p["longest"], p["longest_s"]]
                                for p in per_process(spans)]),
                  "longest spans: " + "; ".join(f"{s.name} ({s.process}) {s.dur_s:.2f} s" for s in longest(spans))]
    elif results["trace"] == "on":
        lines.append(f"loom serve wrote no trace for run {results['median_run']}")
    return "\n".join(lines)
