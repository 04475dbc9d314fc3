"""Read a start-up trace: the Chrome trace-event JSON that ``loom serve --startup-trace FILE`` writes.

The file is an object ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``
(a bare list of events is read too). A metadata event ``{"ph": "M", "name": "process_name",
"pid": P, "args": {"name": ROLE}}`` names each process track (``cli``, ``supervisor``,
``frontend``, ``engine_core``, ``worker:0``, ...); spans are complete events ``{"ph": "X",
"name", "ts", "dur", "pid", "tid", "args"}`` in microseconds on one clock. A span lies at
depth d when d other spans of its process enclose it (its ``[ts, ts + dur]`` inside theirs).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..entrypoints.startup_trace import ROOT, WAITING

ROLE_ORDER = ("cli", "llm", "supervisor", "frontend", "engine_core")
_SLACK_US = 1.0  # a child rounded to the microsecond may end just past its parent


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    process: str
    """The process's role (its track name), or ``pid P`` when the trace names none."""
    pid: int
    name: str
    start_s: float
    """Seconds from the earliest span of the trace."""
    dur_s: float
    depth: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


def read_trace(path: str) -> list[Span]:
    try:
        with open(path) as f:
            document = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"the start-up trace {path} is not JSON ({e.msg} at line {e.lineno})") from None
    return parse_trace(document)


def parse_trace(document: dict[str, Any] | list[dict[str, Any]]) -> list[Span]:
    """The complete (``X``) events as spans with their process's role and depth, in track order."""
    events = document.get("traceEvents", []) if isinstance(document, dict) else document
    names = {e["pid"]: str(e.get("args", {}).get("name")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "pid" in e}
    # the supervisor runs inside the CLI's process (loom_supervisor.run): its threads are a track of their own
    supervisor_threads = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "M"
                          and e.get("name") == "thread_name" and str(e.get("args", {}).get("name")).startswith("supervisor")}
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    if not complete:
        return []
    origin = min(float(e["ts"]) for e in complete)
    spans: list[Span] = []
    by_track: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    for e in complete:
        by_track.setdefault((e.get("pid", 0), (e.get("pid"), e.get("tid")) in supervisor_threads), []).append(e)
    for (pid, of_supervisor), group in by_track.items():
        process = "supervisor" if of_supervisor else names.get(pid, f"pid {pid}")
        group.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        open_ends: list[tuple[float, float]] = []  # (ts, end) of the spans enclosing the next one
        for e in group:
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
            while open_ends and not (open_ends[-1][0] <= ts and ts + dur <= open_ends[-1][1] + _SLACK_US):
                open_ends.pop()
            spans.append(Span(process=process, pid=pid, name=str(e.get("name", "?")),
                              start_s=(ts - origin) / 1e6, dur_s=dur / 1e6, depth=len(open_ends),
                              args=dict(e.get("args") or {})))
            open_ends.append((ts, ts + dur))
    order = {p: i for i, p in enumerate(processes(spans))}
    return sorted(spans, key=lambda s: (order[s.process], s.start_s, s.depth))


def processes(spans: list[Span]) -> list[str]:
    """The tracks in reading order: cli, llm, supervisor, frontend, engine_core, worker:0, worker:1, ...,
    then any other by its first span."""
    first: dict[str, float] = {}
    for s in spans:
        first[s.process] = min(first.get(s.process, s.start_s), s.start_s)

    def key(process: str) -> tuple[int, int, float]:
        if process in ROLE_ORDER:
            return (ROLE_ORDER.index(process), 0, 0.0)
        worker = re.fullmatch(r"worker:(\d+)", process)
        if worker:
            return (len(ROLE_ORDER), int(worker.group(1)), 0.0)
        return (len(ROLE_ORDER) + 1, 0, first[process])

    return sorted(first, key=key)


def longest(spans: list[Span], n: int = 3) -> list[Span]:
    """The ``n`` longest spans that do work: not a process's whole start-up, not a wait for
    another process (the merge marks those, see :mod:`loom.entrypoints.startup_trace`)."""
    work = [s for s in spans if not s.args.get(ROOT) and not s.args.get(WAITING)]
    return sorted(work, key=lambda s: -s.dur_s)[:n]


def per_process(spans: list[Span]) -> list[dict[str, Any]]:
    """For each track: its first start, last end and its longest outermost span."""
    out = []
    for process in processes(spans):
        own = [s for s in spans if s.process == process]
        top = max((s for s in own if s.depth == 0), key=lambda s: s.dur_s)
        out.append({"process": process, "start_s": min(s.start_s for s in own), "end_s": max(s.end_s for s in own),
                    "longest": top.name, "longest_s": top.dur_s})
    return out
