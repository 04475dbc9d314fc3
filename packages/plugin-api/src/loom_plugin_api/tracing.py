"""Start-up spans: where each process of a serve spends its start-up.

``loom serve --startup-trace FILE`` (and ``loom.LLM(..., startup_trace=FILE)``) asks every
process of the serve to record the phases of its start-up; the CLI merges them, with the
supervisor's spawn, HELLO, CONFIG and READY times, into one Chrome trace-event file.
A plugin marks its own long phases the same way loom does::

    from loom_plugin_api.tracing import span

    with span("capture CUDA graphs", sizes=len(sizes)):
        ...

``span`` returns one shared object that does nothing while no trace is being recorded (the
usual case), so it costs an attribute lookup and a call. Spans nest as the ``with`` blocks do,
per thread. Timestamps are ``time.time_ns()``: one clock for every process of the machine.

A process records when ``LOOM_STARTUP_TRACE_DIR`` names a directory as this module is
imported (the supervisor's children: their role and rank come from ``LOOM_ROLE`` and
``LOOM_RANK``), or from :func:`start_recording` (the process that asked for the trace). Its
spans go to ``<dir>/<role>[-<rank>]-<pid>.json`` when :func:`flush` is called (just before the
process sends READY) and again at exit.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "TRACE_DIR_ENV", "enabled", "flush", "mark", "process_start_ns", "ready", "record", "span", "start_recording",
    "stop_recording",
]

TRACE_DIR_ENV = "LOOM_STARTUP_TRACE_DIR"
"""The directory every process of a traced serve writes its spans to."""


class _NoSpan:
    """What :func:`span` returns while nothing is recorded: one shared do-nothing context."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


class _Span:
    __slots__ = ("_recorder", "_name", "_args", "_start")

    def __init__(self, recorder: _Recorder, name: str, args: dict[str, Any]) -> None:
        self._recorder = recorder
        self._name = name
        self._args = args

    def __enter__(self) -> _Span:
        self._start = time.time_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is not None:
            self._args["error"] = exc_type.__name__
        self._recorder.add(self._name, self._start, time.time_ns(), self._args)


class _Recorder:
    """This process's spans and marks, and where they are written."""

    def __init__(self, directory: str, role: str, rank: int | None) -> None:
        self.directory = Path(directory)
        self.role = role
        self.rank = rank
        self.spans: list[tuple[str, int, int, int, dict[str, Any]]] = []
        self.marks: dict[str, int] = {}
        self.threads: dict[int, str] = {}
        self.lock = threading.Lock()
        self.written = -1  # how many spans the file on disk holds

    @property
    def path(self) -> Path:
        who = self.role if self.rank is None else f"{self.role}-{self.rank}"
        return self.directory / f"{who}-{os.getpid()}.json"

    def add(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
        thread = threading.current_thread()
        tid = thread.native_id or 0
        with self.lock:
            self.threads.setdefault(tid, thread.name)
            self.spans.append((name, start_ns, end_ns, tid, args))

    def write(self) -> Path:
        with self.lock:
            doc = {
                "role": self.role, "rank": self.rank, "pid": os.getpid(),
                "process_start_ns": process_start_ns(), "main_tid": threading.main_thread().native_id,
                "marks": dict(self.marks), "threads": {str(k): v for k, v in self.threads.items()},
                "spans": [[n, s, e, t, _jsonable(a)] for n, s, e, t, a in self.spans],
            }
            self.written = len(self.spans)
        # never made here: once the trace is merged its directory is gone, and a process
        # exiting later must not leave it behind again
        path = self.path
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)  # a reader never sees half a file
        return path


_recorder: _Recorder | None = None


def enabled() -> bool:
    """Whether this process records start-up spans."""
    return _recorder is not None


def span(name: str, **args: Any) -> _Span | _NoSpan:
    """A context manager that records the ``with`` block as one span named ``name`` (``args``:
    details shown with it, e.g. ``plugin="my_plugin"``); does nothing when not recording."""
    recorder = _recorder
    if recorder is None:
        return _NO_SPAN
    return _Span(recorder, name, args)


def record(name: str, start_ns: int, end_ns: int | None = None, **args: Any) -> None:
    """Record a span whose start and end are not one ``with`` block (a phase that ends in a
    callback); ``end_ns`` defaults to now. Does nothing when not recording."""
    recorder = _recorder
    if recorder is not None:
        recorder.add(name, start_ns, time.time_ns() if end_ns is None else end_ns, args)


def mark(name: str) -> None:
    """Record the current time under ``name`` (loom marks ``main``: imports are done; and
    ``ready``: start-up is over). Does nothing when not recording."""
    recorder = _recorder
    if recorder is not None:
        recorder.marks[name] = time.time_ns()


def flush() -> Path | None:
    """Write this process's spans now; the file's path (:func:`ready` is the same at the end of
    start-up, with a write error logged instead of raised)."""
    recorder = _recorder
    return None if recorder is None else recorder.write()


def ready() -> None:
    """This process's start-up is over: mark ``ready`` and write its spans (loom calls it just
    before READY). A file that cannot be written (a Ray actor on another machine, where the
    trace's directory does not exist) loses this process's spans, never its start-up."""
    recorder = _recorder
    if recorder is None:
        return
    mark("ready")
    try:
        recorder.write()
    except OSError as e:
        logging.getLogger("loom.tracing").warning("Could not write the start-up spans to %s: %s", recorder.path, e)


def start_recording(directory: str | os.PathLike[str], role: str, rank: int | None = None) -> None:
    """Record this process's spans for a trace in ``directory`` (the process that asked for the
    trace; the processes it starts find the directory in ``LOOM_STARTUP_TRACE_DIR``)."""
    global _recorder
    os.makedirs(directory, exist_ok=True)
    _recorder = _Recorder(os.fspath(directory), role, rank)


def stop_recording() -> None:
    """Write what was recorded and stop recording."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is not None:
        recorder.write()


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (str, int, float, bool)) or v is None else str(v) for k, v in args.items()}


_EXEC_ESTIMATE_NS = time.time_ns() - time.process_time_ns()
"""When the interpreter started, by its CPU time so far: this module is imported early, while
start-up is still CPU-bound, so what it has used is about what has elapsed."""
_SHELL_WAIT_S = 1.0


def process_start_ns() -> int | None:
    """When this program started, in ``time.time_ns()``'s clock (Linux: /proc, to 10 ms).

    A shell that runs ``pip install ... && loom serve`` may exec ``loom`` in its own process,
    which then started long before Python did; when /proc's start is more than
    ``_SHELL_WAIT_S`` before the interpreter's CPU time can account for, the latter is used."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22 of proc(5), after the command name
    age_s = uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    started = time.time_ns() - int(age_s * 1e9)
    return _EXEC_ESTIMATE_NS if _EXEC_ESTIMATE_NS - started > _SHELL_WAIT_S * 1e9 else started


def _at_exit() -> None:
    recorder = _recorder
    if recorder is not None and recorder.written != len(recorder.spans):
        try:
            recorder.write()
        except OSError:
            pass  # the trace is lost, the process's exit is not disturbed


def _from_environment() -> None:
    directory = os.environ.get(TRACE_DIR_ENV)
    if directory:
        role = os.environ.get("LOOM_ROLE") or "process"
        rank = os.environ.get("LOOM_RANK", "")
        start_recording(directory, role, int(rank) if role == "worker" and rank.isdigit() else None)


_from_environment()
atexit.register(_at_exit)
