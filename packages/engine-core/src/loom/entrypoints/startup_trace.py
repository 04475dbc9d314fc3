"""``--startup-trace FILE``: every process's start-up spans merged into one Chrome trace.

The process that asks for the trace (``loom serve``'s CLI, or ``loom.LLM``) records into a
fresh directory and names it in ``LOOM_STARTUP_TRACE_DIR``, so that every process it starts
records too (:mod:`loom_plugin_api.tracing`: each writes ``<role>[-<rank>]-<pid>.json`` just
before READY); the supervisor writes ``supervisor.json`` (spawn, HELLO, CONFIG and READY of
each child) once all are ready, or when the serve ends before that. :func:`merge` turns the
directory into trace events: one track (a trace "process") per process, named by role and
rank, its spans nested as they ran, time 0 the start of the process that asked. The file
opens in https://ui.perfetto.dev and chrome://tracing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loom_plugin_api import tracing

from ..logger import init_logger

logger = init_logger("loom.startup_trace")

SUPERVISOR_FILE = "supervisor.json"
SUPERVISOR_TID_BASE = 1 << 22
"""Thread ids of the supervisor's per-child tracks when it runs in the CLI's process (Linux
thread ids stay below 2**22)."""
WAITING = "waits"
"""A span argument: the span mostly waits for another process (left out of the longest steps)."""
ROOT = "root"
"""A span argument: the whole start-up of a process (left out of the longest steps)."""


def requested(argv: list[str]) -> bool:
    """Whether a command line asks for a start-up trace (read before argparse runs, so that the
    CLI's own imports and plugin loading are recorded too)."""
    return any(a == "--startup-trace" or a.startswith("--startup-trace=") for a in argv)


def begin(role: str) -> Path:
    """Start recording in this process (once) and return the trace directory, which the
    processes started from here find in ``LOOM_STARTUP_TRACE_DIR``."""
    directory = os.environ.get(tracing.TRACE_DIR_ENV)
    if not (tracing.enabled() and directory):
        directory = tempfile.mkdtemp(prefix="loom-startup-trace-")
        os.environ[tracing.TRACE_DIR_ENV] = directory
        tracing.start_recording(directory, role)
    return Path(directory)


class StartupTrace:
    """One traced start-up: ``finish`` (once) merges what the processes wrote into ``out``."""

    def __init__(self, out: str | os.PathLike[str], role: str, *, zero_ns: int | None = None,
                 root: str = "start-up until READY") -> None:
        self.out = Path(out)
        self.directory = begin(role)
        self.zero_ns = zero_ns
        self.root = root
        self.summary: str | None = None
        self._lock = threading.Lock()
        self._done = False

    def watch_supervisor(self, poll_s: float = 0.05) -> threading.Thread:
        """Finish as soon as the supervisor's file appears (it writes it at all-READY)."""

        def watch() -> None:
            path = self.directory / SUPERVISOR_FILE
            while not self._done and not path.exists():
                time.sleep(poll_s)
            if not self._done:
                self.finish()

        thread = threading.Thread(target=watch, name="startup-trace", daemon=True)
        thread.start()
        return thread

    def finish(self, ready_ns: int | None = None) -> str | None:
        """Merge and write the trace; ``ready_ns``: when start-up ended, where no supervisor
        says so (``loom.LLM`` with one rank). Returns the summary line, also printed."""
        with self._lock:
            if self._done:
                return self.summary
            self._done = True
            tracing.stop_recording()
            os.environ.pop(tracing.TRACE_DIR_ENV, None)
            try:
                doc = merge(self.directory, zero_ns=self.zero_ns, ready_ns=ready_ns, root=self.root)
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self.out.write_text(json.dumps(doc))
            except (OSError, ValueError) as e:
                logger.warning("Could not write the start-up trace %s: %s", self.out, e)
                return None
            finally:
                shutil.rmtree(self.directory, ignore_errors=True)
            self.summary = summary_line(doc, self.out)
            print(self.summary, flush=True)
            return self.summary


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def merge(directory: Path, *, zero_ns: int | None = None, ready_ns: int | None = None,
          root: str = "start-up until READY") -> dict[str, Any]:
    """The Chrome trace-event document of a trace directory (see the module docstring)."""
    supervisor = _read(directory / SUPERVISOR_FILE) or {}
    processes = [d for p in sorted(directory.glob("*.json")) if p.name != SUPERVISOR_FILE
                 and (d := _read(p)) is not None]
    children = {c["pid"]: c for c in supervisor.get("children", []) if c.get("pid") is not None}
    lead = next((d for d in processes if d["role"] in ("cli", "llm")), None)  # the process that asked
    ready = ready_ns or supervisor.get("ready_ns")
    if zero_ns is None:
        zero_ns = (lead or {}).get("process_start_ns") or supervisor.get("plan_ns") or min(
            (s[1] for d in processes for s in d["spans"]), default=time.time_ns())
    events: list[dict[str, Any]] = []

    def x(name: str, pid: int, tid: int, start: int, end: int, args: dict[str, Any] | None = None) -> None:
        events.append({"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": (start - zero_ns) / 1e3,
                       "dur": max(0, end - start) / 1e3, "args": {"process": _track(by_pid[pid]), **(args or {})}})

    def meta(kind: str, pid: int, tid: int | None, **args: Any) -> None:
        event = {"name": kind, "ph": "M", "pid": pid, "args": args}
        if tid is not None:
            event["tid"] = tid
        events.append(event)

    by_pid = {d["pid"]: d for d in processes}
    order = {"cli": 0, "llm": 0, "supervisor": 1, "frontend": 2, "engine_core": 3, "worker": 4}
    for doc in processes:
        pid, main_tid = doc["pid"], doc.get("main_tid") or doc["pid"]
        meta("process_name", pid, None, name=_track(doc))
        meta("process_sort_index", pid, None, sort_index=order.get(doc["role"], 9) * 1000 + (doc.get("rank") or 0))
        for tid, name in doc.get("threads", {}).items():
            meta("thread_name", pid, int(tid), name=name)
        marks = doc.get("marks", {})
        child = children.get(pid)
        start = (child or {}).get("spawn_ns") or doc.get("process_start_ns") or zero_ns
        if doc is lead:
            start = zero_ns
        spans = doc["spans"]
        end = (ready if doc is lead else None) or marks.get("ready") or max((s[2] for s in spans), default=start)
        end = max([end, *(s[2] for s in spans if s[3] == main_tid)])
        x(f"{_track(doc)}: {root if doc is lead else 'start-up'}", pid, main_tid, start, end, {ROOT: True})
        if "main" in marks:
            x("interpreter start and imports", pid, main_tid, start, marks["main"])
        for name, s, e, tid, args in spans:
            x(name, pid, tid, s, e, args)
    _supervisor_tracks(supervisor, by_pid, events, x, meta)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"zero_ns": zero_ns, "ready_ns": ready,
                          "time_to_ready_s": None if ready is None else (ready - zero_ns) / 1e9,
                          "outcome": supervisor.get("outcome", "ready" if ready else "unknown")}}


def _track(doc: dict[str, Any]) -> str:
    role = doc["role"]
    return f"worker:{doc['rank']}" if role == "worker" and doc.get("rank") is not None else role


def _supervisor_tracks(supervisor: dict[str, Any], by_pid: dict[int, dict[str, Any]], events: list[dict[str, Any]],
                       x: Any, meta: Any) -> None:
    """The supervisor's view: per child, spawn → HELLO → CONFIG → READY, one thread track each."""
    if not supervisor:
        return
    pid = supervisor.get("supervisor_pid") or 0
    if pid not in by_pid:  # the standalone binary: a process of its own
        by_pid[pid] = {"role": "supervisor", "pid": pid}
        meta("process_name", pid, None, name="supervisor")
        meta("process_sort_index", pid, None, sort_index=1000)
    for i, child in enumerate(supervisor.get("children", [])):
        tid = SUPERVISOR_TID_BASE + i
        address = child.get("address", f"child {i}")
        meta("thread_name", pid, tid, name=f"supervisor: {address}")
        steps = [("spawn", "spawn_ns", "spawned_ns"), ("wait for HELLO", "spawned_ns", "hello_ns"),
                 ("HELLO → CONFIG sent", "hello_ns", "config_ns"), ("CONFIG → READY", "config_ns", "ready_ns")]
        first, last = child.get("spawn_ns"), child.get("ready_ns")
        if first is None:
            continue
        done = [child[k] for k in ("spawn_ns", "spawned_ns", "hello_ns", "config_ns", "ready_ns") if child.get(k)]
        x(f"supervisor: {address} spawn → READY" + ("" if last else " (never READY)"), pid, tid, first,
          last or max(done), {"child_pid": child.get("pid"), WAITING: True})
        for name, a, b in steps:
            if child.get(a) is not None and child.get(b) is not None:
                x(name, pid, tid, child[a], child[b], {WAITING: True})


def own_times(doc: dict[str, Any]) -> list[tuple[dict[str, Any], float]]:
    """Each complete event with its own time in µs: its duration less that of the events
    directly inside it on its track (what it did itself, not what it called)."""
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    own: list[tuple[dict[str, Any], float]] = []
    for track in tracks.values():
        stack: list[list[Any]] = []  # [event, own time so far]
        for e in sorted(track, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"] + 1e-3:
                own.append((stack[-1][0], stack[-1][1]))
                stack.pop()
            if stack:
                stack[-1][1] -= e["dur"]
            stack.append([e, e["dur"]])
        own += [(e, t) for e, t in stack]
    return own


def summary_line(doc: dict[str, Any], out: Path) -> str:
    """``time to ready`` and the three steps that took longest themselves (not waits, not a
    process's whole start-up), with their process."""
    other = doc["otherData"]
    work = [(e, t) for e, t in own_times(doc) if not e["args"].get(WAITING) and not e["args"].get(ROOT)]
    longest = sorted(work, key=lambda et: -et[1])[:3]
    steps = ", ".join(f"{e['name']} {own / 1e6:.2f} s ({e['args']['process']})" for e, own in longest)
    ready = other.get("time_to_ready_s")
    head = f"ready in {ready:.2f} s" if ready is not None else f"start-up did not finish ({other['outcome']})"
    return f"loom: start-up trace written to {out} (open it in https://ui.perfetto.dev): {head}; longest steps: {steps}"
