"""Start ``loom serve`` as a real process tree and inspect it (for the serve tests)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Serve:
    proc: subprocess.Popen[str]
    url: str
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, int]:
        """``{"frontend": pid, "engine_core": pid, "worker:0": pid, ...}`` from the ready lines."""
        return {m[0]: int(m[1]) for m in re.findall(r"loom-supervisor: (\S+) \(pid (\d+)\) ready", self.log)}

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


def alive(pid: int) -> bool:
    """True while ``pid`` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def cpu_list(spec: str) -> set[int]:
    """The CPUs of a kernel CPU list ("0-3,6")."""
    cpus: set[int] = set()
    for part in spec.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def thread_cpus(pid: int) -> list[set[int]]:
    """The CPUs each thread of ``pid`` may run on (its ``Cpus_allowed_list``)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        found.append(cpu_list(next(line.split(":", 1)[1] for line in status.splitlines()
                                   if line.startswith("Cpus_allowed_list"))))
    return found


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def start_serve(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "loom.entrypoints.cli.main", "serve", *args, "--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(serve: Serve, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serve.proc.poll() is not None:
            raise RuntimeError(f"loom serve exited with {serve.proc.returncode}:\n{serve.log[-4000:]}")
        with contextlib.suppress(OSError):
            if get(serve.url + "/health", timeout=2)[0] == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"loom serve was not ready in {timeout} s:\n{serve.log[-4000:]}")


@contextlib.contextmanager
def serving(args: list[str], tmp_path: Path, env: dict[str, str] | None = None,
            name: str = "serve") -> Iterator[Serve]:
    proc, url = start_serve(args, tmp_path / f"{name}.log", env)
    serve = Serve(proc, url, tmp_path / f"{name}.log")
    try:
        wait_ready(serve)
        yield serve
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
