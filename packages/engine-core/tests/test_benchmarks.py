"""loom.benchmarks without a model: percentiles, the table, the JSON file, the workloads, the
start-up trace reader and the Gantt chart (from a synthetic trace in the format
``loom serve --startup-trace`` writes). ``tests/test_bench_cli.py`` runs the modes end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys

import matplotlib.image
import pytest
from loom.benchmarks import plots
from loom.benchmarks.report import format_table, machine_info, percentile, summarize, write_json
from loom.benchmarks.trace import longest, parse_trace, per_process, processes
from loom.benchmarks.workloads import TOKEN_IDS, WARMUP_ROUND, Workload

PNG = b"\x89PNG\r\n\x1a\n"
T0 = 1_764_000_000_000_000  # microseconds on the trace's clock


def synthetic_trace() -> dict:
    """Six tracks, spans nested up to depth 2, a worker span on another thread, an unnamed pid."""
    roles = {11: "worker:1", 7: "engine_core", 3: "cli", 9: "worker:0", 5: "supervisor", 6: "frontend"}
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": r}} for p, r in roles.items()]

    def span(pid: int, name: str, start_ms: float, dur_ms: float, tid: int = 1) -> None:
        events.append({"ph": "X", "name": name, "cat": "startup", "ts": T0 + start_ms * 1e3, "dur": dur_ms * 1e3,
                       "pid": pid, "tid": tid, "args": {"detail": name}})

    span(3, "interpreter and imports", 0, 300)
    span(3, "import torch", 50, 200)
    span(3, "build config", 300, 200)
    span(5, "spawn", 520, 50)
    span(5, "HELLO", 570, 700)
    span(5, "READY", 1370, 2600)
    span(6, "imports", 560, 800)
    span(7, "KV-cache allocation", 3000, 400)
    for pid in (9, 11):
        span(pid, "load weights", 1500, 1200)
        span(pid, "read safetensors", 1550, 600)
        span(pid, "one shard", 1600, 100)
        span(pid, "prepack", 2200, 300, tid=2)  # another thread, still inside load weights
        span(pid, "warm-up", 2800, 900)
    span(42, "stray", 100, 10)  # a process the trace does not name
    events.append({"ph": "i", "name": "an instant", "ts": T0, "pid": 3, "tid": 1})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"loom": "test"}}


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5  # unsorted input
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile(list(range(101)), 99) == 99
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_summarize_and_nan_free_json(tmp_path) -> None:
    s = summarize([0.1, 0.2, 0.3, 0.4])
    assert s["n"] == 4 and s["min"] == 0.1 and s["max"] == 0.4 and s["mean"] == pytest.approx(0.25)
    assert s["p50"] == pytest.approx(0.25) and s["p99"] == pytest.approx(0.397)
    empty = summarize([])
    assert empty["n"] == 0 and math.isnan(empty["p50"])
    path = tmp_path / "out.json"
    write_json(str(path), {"empty": empty, "inf": [float("inf")], "ok": 1.5})
    document = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in strict JSON"))
    assert document == {"empty": {"n": 0, "mean": None, "min": None, "max": None, "p50": None, "p90": None,
                                  "p99": None}, "inf": [None], "ok": 1.5}


def test_table_aligns_columns() -> None:
    text = format_table(["run", "tok/s", "note"], [["1", 1234.5, "x"], ["median", 0.01234, None], ["2", 12.345, "yy"]])
    lines = text.splitlines()
    assert lines[0].split() == ["run", "tok/s", "note"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["1", "1,234", "x"]
    assert lines[3].split() == ["median", "0.0123", "-"]
    assert lines[4].split() == ["2", "12.35", "yy"]
    # numbers right-aligned: the units digits share a column
    assert lines[2].index("1,234") + 5 == lines[3].index("0.0123") + 6 == lines[4].index("12.35") + 5


def test_machine_info_names_the_machine() -> None:
    info = machine_info()
    assert info["cpu"] and info["cpu_count"] >= 1 and info["cpus_usable"] >= 1
    assert info["loom"] and info["torch"] and info["python"] == sys.version.split()[0]
    assert info["date"].startswith("20")


def test_workload_is_fixed_per_seed_and_round() -> None:
    w = Workload(num_prompts=5, input_len=7, output_len=3, seed=1)
    first = w.prompts(0)
    assert len(first) == 5 and all(len(p) == 7 for p in first)
    assert all(TOKEN_IDS[0] <= t < TOKEN_IDS[1] for p in first for t in p)
    assert w.prompts(0) == first  # deterministic
    assert w.prompts(1) != first and w.prompts(WARMUP_ROUND) != first  # no prefix-cache hits across rounds
    assert Workload(num_prompts=5, input_len=7, output_len=3, seed=2).prompts(0) != first
    small = w.prompts(0, vocab_size=50)
    assert all(0 <= t < 50 for p in small for t in p)
    assert Workload().describe().startswith("64 prompts x (128 in -> 64 out)")


def test_trace_tracks_depths_and_order() -> None:
    spans = parse_trace(synthetic_trace())
    assert processes(spans) == ["cli", "supervisor", "frontend", "engine_core", "worker:0", "worker:1", "pid 42"]
    by = {(s.process, s.name): s for s in spans}
    assert by[("cli", "interpreter and imports")].start_s == 0.0
    assert by[("cli", "import torch")].depth == 1
    assert by[("cli", "build config")].depth == 0  # starts where its neighbour ends: not nested
    assert by[("worker:0", "read safetensors")].depth == 1
    assert by[("worker:0", "one shard")].depth == 2
    assert by[("worker:0", "prepack")].depth == 1  # nesting is per process, across threads
    assert by[("worker:1", "warm-up")].depth == 0
    assert by[("supervisor", "READY")].start_s == pytest.approx(1.37)
    assert by[("supervisor", "READY")].dur_s == pytest.approx(2.6)
    assert by[("worker:0", "load weights")].args == {"detail": "load weights"}
    assert not any(s.name == "an instant" for s in spans)
    assert [s.name for s in longest(spans, 2)] == ["READY", "load weights"]
    marked = [dataclasses.replace(s, args={"root": True}) if s.name == "READY" else s for s in spans]
    assert [s.name for s in longest(marked, 1)] == ["load weights"]  # a whole start-up is not a step
    rows = {r["process"]: r for r in per_process(spans)}
    assert rows["worker:0"]["longest"] == "load weights" and rows["worker:0"]["end_s"] == pytest.approx(3.7)
    assert parse_trace({"traceEvents": []}) == [] and parse_trace(synthetic_trace()["traceEvents"]) == spans


def test_gantt_chart_from_a_synthetic_trace(tmp_path) -> None:
    path = tmp_path / "gantt.png"
    plots.plot_startup(parse_trace(synthetic_trace()), 4.0, "synthetic start-up", str(path))
    assert path.read_bytes()[:8] == PNG
    image = matplotlib.image.imread(str(path))
    assert image.shape[0] > 300 and image.shape[1] > 1000  # a row per process, wide enough to read


def test_plot_without_matplotlib_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(ImportError, match=r"^--plot needs matplotlib: pip install matplotlib"):
        plots.require_matplotlib()


def test_a_benchmark_stopped_by_sigterm_stops_its_server(tmp_path) -> None:
    """The server runs in a session of its own; a SIGTERM to the benchmark (``kill``, a CI
    timeout) still reaches the benchmark's ``finally: stop(proc)`` and nothing is left running.
    A stand-in ``loom serve`` (a sleeping Python) keeps the test about the process handling."""
    script = tmp_path / "bench.py"
    script.write_text(
        "import sys, time\n"
        "from loom.benchmarks import server\n"
        "server.SERVE = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
        f"proc, url, _ = server.start([], {str(tmp_path / 'serve.log')!r})\n"
        "try:\n"
        "    print(proc.pid, flush=True)\n"
        "    time.sleep(120)\n"
        "finally:\n"
        "    server.stop(proc, timeout=10)\n"
    )
    bench = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(bench.stdout.readline())
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):  # stopped and reaped by the benchmark
            os.kill(child, 0)
    finally:
        bench.kill()
