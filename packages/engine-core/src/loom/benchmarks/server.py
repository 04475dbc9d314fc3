"""A real ``loom serve`` for the benchmarks: start it, wait for ``/health``, measure its tree, stop it.

The server runs as ``python -m loom.entrypoints.cli.main serve`` with this interpreter, in its
own session (so a stuck tree can be killed as a group), its output in a log file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

SERVE = [sys.executable, "-m", "loom.entrypoints.cli.main", "serve"]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy between a client and its server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit_on_sigterm() -> None:
    """SIGTERM (``kill``, a CI timeout) ends this process by ``SystemExit``, so the callers'
    ``finally: stop(proc)`` runs: the server is in a session of its own, and Python's default
    SIGTERM ends the benchmark at once, leaving the server behind. Only from the main thread,
    and only where SIGTERM still has its default handler."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def start(args: list[str], log_path: str) -> tuple[subprocess.Popen, str, float]:
    """Launch ``loom serve ARGS`` on a free port; returns (process, base url, launch time
    from ``time.perf_counter``). Callers stop it in a ``finally`` (:func:`stop`), which a
    SIGTERM to this process now reaches too."""
    _exit_on_sigterm()
    port = free_port()
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        launched = time.perf_counter()
        proc = subprocess.Popen([*SERVE, *args, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", launched


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 600, log_path: str | None = None) -> float:
    """Poll ``/health`` until it answers 200; returns that moment (``time.perf_counter``).
    Raises RuntimeError, naming the last line of the log, when the server exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"loom serve exited with {proc.returncode} before it was ready"
                               + (f": {last_line(log_path)} (log: {log_path})" if log_path else ""))
        if health(url, timeout=1) == 200:
            return time.perf_counter()
        time.sleep(0.02)
    raise TimeoutError(f"loom serve was not ready in {timeout:.0f} s" + (f" (log: {log_path})" if log_path else ""))


def health(url: str, timeout: float = 5) -> int | None:
    """The status of ``GET URL/health``; None when nothing answers."""
    try:
        with _OPENER.open(url + "/health", timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def last_line(log_path: str) -> str:
    """The last non-empty line of a log (a ``loom: error: ...`` line when the CLI refused)."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


def _tree(root_pid: int) -> list[tuple[int, list[str]]]:
    """``(pid, stat fields after the command name)`` of a process and all its descendants (/proc)."""
    children: dict[int, list[int]] = {}
    stat: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        stat[pid] = fields
    out, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        if pid in stat:
            out.append((pid, stat[pid]))
        stack.extend(children.get(pid, []))
    return out


def tree_rss_bytes(root_pid: int) -> int:
    """RSS of a process and all its descendants (from /proc)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return sum(int(fields[21]) * page for _, fields in _tree(root_pid))


ROLES = (("loom.entrypoints.frontend", "front end"), ("loom.engine.core_proc", "engine core"),
         ("loom.worker.proc", "worker"))


def tree_cpu_seconds(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) each process of a ``loom serve`` tree has used, by role: the
    supervisor (the root), front end, engine core, worker (workers summed), other."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid, fields in _tree(root_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        role = "supervisor" if pid == root_pid else next((r for key, r in ROLES if key in cmdline), "other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM (the serve drains and stops its children), then SIGKILL to the whole group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def serve_has_flag(flag: str) -> bool:
    """Whether this ``loom serve`` takes ``flag`` (read from its ``--help``)."""
    try:
        out = subprocess.run([*SERVE, "--help"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                             timeout=120)
    except subprocess.TimeoutExpired:
        raise TimeoutError("`loom serve --help` did not answer in 120 s") from None
    return any(word.strip(",[]") == flag for word in out.stdout.split())
