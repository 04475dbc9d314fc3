"""The merged start-up trace (``loom.entrypoints.startup_trace``) from what the processes and the
supervisor wrote, and progress bars that survive the supervisor's line-by-line forwarding."""

from __future__ import annotations

import io
import json

from loom.entrypoints.startup_trace import SUPERVISOR_FILE, merge, own_times, summary_line
from loom.progress import progress_bar

MS = 1_000_000
T0 = 1_700_000_000_000 * MS


def _write(path, doc):
    path.write_text(json.dumps(doc))


def _process(role, rank, pid, start, spans, marks):
    return {"role": role, "rank": rank, "pid": pid, "process_start_ns": start, "main_tid": pid,
            "marks": marks, "threads": {str(pid): "MainThread"}, "spans": spans}


def _trace_dir(tmp_path, *, ready=True):
    _write(tmp_path / "cli-100.json", _process("cli", None, 100, T0, [
        ["build config", T0 + 300 * MS, T0 + 900 * MS, 100, {}],
        ["resolve platform", T0 + 310 * MS, T0 + 400 * MS, 100, {}],
    ], {"main": T0 + 250 * MS}))
    _write(tmp_path / "worker-0-300.json", _process("worker", 0, 300, T0 + 1005 * MS, [
        ["load_model", T0 + 2000 * MS, T0 + 4500 * MS, 300, {}],
        ["load weights", T0 + 2100 * MS, T0 + 4000 * MS, 300, {"load_format": "safetensors"}],
        ["connect, HELLO, wait for CONFIG", T0 + 1900 * MS, T0 + 1950 * MS, 300, {"waits": True}],
    ], {"main": T0 + 1800 * MS, "ready": T0 + 5000 * MS}))
    _write(tmp_path / "frontend-200.json", _process("frontend", None, 200, T0 + 1005 * MS, [
        ["load tokenizer", T0 + 1600 * MS, T0 + 1700 * MS, 200, {}],
        ["wait for the engine core", T0 + 1700 * MS, T0 + 5100 * MS, 201, {"waits": True}],
    ], {"main": T0 + 1500 * MS, "ready": T0 + 5100 * MS}))
    children = [
        {"address": "frontend", "role": "frontend", "rank": 0, "pid": 200, "spawn_ns": T0 + 1000 * MS,
         "spawned_ns": T0 + 1002 * MS, "hello_ns": T0 + 1550 * MS, "config_ns": T0 + 1551 * MS,
         "ready_ns": T0 + 5101 * MS if ready else None},
        {"address": "worker:0", "role": "worker", "rank": 0, "pid": 300, "spawn_ns": T0 + 1003 * MS,
         "spawned_ns": T0 + 1004 * MS, "hello_ns": T0 + 1900 * MS, "config_ns": T0 + 1901 * MS,
         "ready_ns": T0 + 5001 * MS},
    ]
    _write(tmp_path / SUPERVISOR_FILE, {"supervisor_pid": 100, "plan_ns": T0 + 950 * MS, "children": children,
                                        "ready_ns": T0 + 5102 * MS if ready else None,
                                        "outcome": "ready" if ready else "failed"})
    return tmp_path


def _nests(events):
    """Every track's complete events nest: none overlaps another without containing it."""
    tracks = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track in tracks.values():
        stack = []
        for e in sorted(track, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + 1e-3:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"] + 1e-3:
                return False, (stack[-1]["name"], e["name"])
            stack.append(e)
    return True, None


def test_merge_makes_one_named_track_per_process_with_nested_spans(tmp_path):
    doc = merge(_trace_dir(tmp_path))
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {100: "cli", 200: "frontend", 300: "worker:0"}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 100}
    assert {"supervisor: frontend", "supervisor: worker:0"} <= threads  # the supervisor runs in the CLI
    assert _nests(events) == (True, None)
    spans = {(e["pid"], e["name"]): e for e in events if e["ph"] == "X"}
    root = spans[(100, "cli: start-up until READY")]
    assert root["ts"] == 0 and root["dur"] == 5102 * 1000  # µs from the CLI's start to the supervisor's READY
    assert doc["otherData"]["time_to_ready_s"] == 5.102
    imports = spans[(300, "interpreter start and imports")]
    assert (imports["ts"], imports["dur"]) == (1003 * 1000, 797 * 1000)  # from the supervisor's spawn
    hello = spans[(100, "wait for HELLO")]
    assert hello["args"]["process"] == "cli" and hello["tid"] != 100
    assert spans[(300, "load weights")]["args"] == {"process": "worker:0", "load_format": "safetensors"}


def test_summary_names_the_longest_work_not_the_waits(tmp_path):
    doc = merge(_trace_dir(tmp_path))
    own = {(e["args"]["process"], e["name"]): round(t / 1e3) for e, t in own_times(doc)}  # ms
    assert own[("worker:0", "load_model")] == 600  # 2.5 s less the 1.9 s of the weights inside it
    assert own[("worker:0", "load weights")] == 1900
    assert own[("cli", "build config")] == 510
    line = summary_line(doc, tmp_path / "t.json")
    assert "ready in 5.10 s" in line
    steps = line.split("longest steps: ")[1]
    assert steps == ("load weights 1.90 s (worker:0), interpreter start and imports 0.80 s (worker:0), "
                     "load_model 0.60 s (worker:0)")  # no waits, no whole start-up of a process


def test_a_start_up_that_failed_is_still_written(tmp_path):
    doc = merge(_trace_dir(tmp_path, ready=False))
    assert doc["otherData"]["outcome"] == "failed" and doc["otherData"]["time_to_ready_s"] is None
    assert any(e["name"] == "supervisor: frontend spawn → READY (never READY)" for e in doc["traceEvents"])
    assert _nests(doc["traceEvents"]) == (True, None)
    assert "start-up did not finish (failed)" in summary_line(doc, tmp_path / "t.json")


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_progress_through_a_pipe_is_whole_lines(monkeypatch):
    monkeypatch.setattr("loom.progress.DELAY_S", 0.0)
    monkeypatch.setattr("loom.progress.LINE_INTERVAL_S", 0.0)
    out = _Pipe()
    with progress_bar(3, "Loading weights", "tensor", stream=out) as bar:
        for _ in range(3):
            bar.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) >= 2 and all(line.startswith("Loading weights:") for line in lines)
    assert "3/3" in lines[-1]


def test_progress_is_silent_for_short_work_and_for_other_ranks():
    for kwargs in ({}, {"disable": True}):
        out = _Pipe()
        with progress_bar(3, "Loading weights", "tensor", stream=out, **kwargs) as bar:
            bar.update(3)
        assert out.getvalue() == ""
