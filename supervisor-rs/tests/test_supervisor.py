"""loom-supervisor end to end: real Python children talking through the supervisor.

Needs the package installed (``maturin develop`` or ``pip install ./supervisor-rs``).
Each serve runs in its own ``python -m loom_supervisor run-plan -`` process, so these
tests can signal and SIGKILL it; one test runs ``loom_supervisor.run`` in-process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Literal

import loom_supervisor
import msgpack
import pytest
from loom_supervisor import Plan, ProcessPlan, client

# One script for every child; BEHAVIOUR (from the plan's env) picks what it does.
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from loom_supervisor import client

    behaviour = os.environ["BEHAVIOUR"]
    role, rank = os.environ["LOOM_ROLE"], int(os.environ["LOOM_RANK"])
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    frontend_listens = os.path.join(here, "frontend.listens")  # written once the frontend sent READY

    def wait_for_file(path, timeout=20.0):
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                log(f"{path} did not appear in {timeout} s")
                sys.exit(98)
            time.sleep(0.01)

    if behaviour == "crash_before_hello":
        log("loading weights")
        raise RuntimeError("weights file is corrupt")

    conn = client.connect()
    version = int(os.environ.get("HELLO_VERSION", "1"))
    # Both call forms: loom passes (role, rank, messages_version) positionally.
    config = conn.hello(role, rank, version) if behaviour == "finish" else conn.hello(messages_version=version)
    assert config == b"CFG", config
    if behaviour in ("crash_after_hello", "killed_after_hello") and role == "worker" and rank == 1:
        log("INFO loading model")
        wait_for_file(frontend_listens)  # a frontend still starting is not told about the crash
        if behaviour == "killed_after_hello":
            log("out of memory")
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("weights file is corrupt")
    if behaviour == "hang_before_ready" and role == "worker":
        time.sleep(60)
    conn.ready()
    if role == "frontend":
        open(frontend_listens, "w").close()
    if behaviour == "close_and_live" and role == "worker":
        wait_for_file(frontend_listens)
        conn.close()
        time.sleep(60)
    if behaviour == "oversize" and role == "worker":
        wait_for_file(frontend_listens)
        conn._sock.sendall(b"\\xff\\xff\\xff\\xff" + client.encode("worker:0", "frontend", "LOST"))
        time.sleep(60)
    if behaviour == "stop_itself" and role == "worker":
        wait_for_file(frontend_listens)
        os.kill(os.getpid(), signal.SIGSTOP)
    # A Ray actor (worker:1, not a child of the supervisor) died on another machine.
    remote_death = client.PeerDied(
        role="worker", rank=1, pid=4242, exit_code=None, signal="SIGKILL", phase="running",
        reason="worker:1 died: its actor was lost with its node", stderr_tail=("INFO loading model", "CUDA error"),
        node="10.0.0.2")
    if behaviour == "remote_died" and role == "engine_core":
        wait_for_file(frontend_listens)
        conn.send(client.SUPERVISOR, client.REMOTE_DIED, remote_death.to_body())
    if behaviour == "remote_died_while_draining" and role == "engine_core":
        wait_for_file(os.path.join(here, "frontend.draining"))
        conn.send(client.SUPERVISOR, client.REMOTE_DIED, remote_death.to_body())
    if behaviour == "remote_died_dropped":
        wait_for_file(frontend_listens)
        if role == "worker":  # not the engine core: not its death to report
            conn.send(client.SUPERVISOR, client.REMOTE_DIED, remote_death.to_body())
        if role == "engine_core":
            conn.send(client.SUPERVISOR, client.REMOTE_DIED, b"\\xc1\\x1b[31m not msgpack")

    def block():  # until the supervisor stops us
        while True:
            conn.recv()

    if behaviour == "relay":
        if role == "engine_core":
            conn.send(client.WORKERS, "PING", b"fan")
            pongs = sorted(conn.recv().body for _ in range(2))
            assert pongs == [b"0", b"1"], pongs
            conn.send("frontend", "DONE", b",".join(pongs))
            block()
        if role == "worker":
            frame = conn.recv()
            assert (frame.src, frame.dst, frame.kind, frame.body) == ("engine_core", "workers", "PING", b"fan")
            conn.send("engine_core", "PONG", str(rank).encode())
            while True:
                frame = conn.recv()
                if frame.kind != "ECHO":
                    log(f"unexpected {frame.kind} from {frame.src}")
                    sys.exit(5)
                conn.send(frame.src, "ECHO", frame.body)
        # frontend
        done = conn.recv()
        assert (done.src, done.kind, done.body) == ("engine_core", "DONE", b"0,1"), done
        sock = conn._sock
        sock.sendall(client.encode("engine_core", "worker:0", "SPOOF"))     # not our address
        sock.sendall(client.encode("frontend", "worker:9", "LOST"))         # unknown dst
        sock.sendall(b"\\x00\\x00\\x00\\x03\\xc1\\xc1\\xc1")                    # not msgpack
        for r in (0, 1):
            body = os.urandom(1000)
            conn.send(f"worker:{r}", "ECHO", body)
            echo = conn.recv()
            assert (echo.src, echo.kind, echo.body) == (f"worker:{r}", "ECHO", body), echo
        log("relay ok")
        sys.exit(0)

    if behaviour in ("serve", "crash_after_hello", "killed_after_hello", "hang_before_ready", "close_and_live",
                     "stop_itself", "oversize", "remote_died", "remote_died_dropped",
                     "remote_died_while_draining"):
        if role != "frontend":
            block()
        drain_until = None  # a slow drain: it ends at this instant, whatever comes meanwhile
        while True:
            if drain_until is None:
                frame = conn.recv()
            else:
                left = drain_until - time.monotonic()
                frame = conn.recv(left) if left > 0 else None
                if frame is None:
                    log("drained")
                    sys.exit(0)
            if frame.kind == client.SHUTDOWN:
                log("draining")
                if behaviour != "remote_died_while_draining":
                    sys.exit(0)
                drain_until = time.monotonic() + 1.5
                open(os.path.join(here, "frontend.draining"), "w").close()
            if frame.kind == client.PEER_DIED:
                assert frame.src == client.SUPERVISOR, frame
                died = client.PeerDied.from_frame(frame)
                with open(os.path.join(here, "peer_died.json.partial"), "w") as f:
                    json.dump({"body": client.decode_body(frame), "described": died.describe()}, f)
                os.rename(os.path.join(here, "peer_died.json.partial"), os.path.join(here, "peer_died.json"))
                log("PEER_DIED received")
                if drain_until is None:
                    sys.exit(0)

    if behaviour == "finish":
        if role == "frontend":
            sys.exit(0)
        block()
    """
)

READY = re.compile(r"loom-supervisor: (\S+) \(pid (\d+)\) ready")


@pytest.fixture
def child(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return path


Role = Literal["frontend", "engine_core", "worker"]


def make_plan(child: Path, behaviour: str, roles: list[tuple[Role, int]], hello_version: int = 1,
              **limits: Any) -> Plan:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "BEHAVIOUR": behaviour, "PYTHONUNBUFFERED": "1",
           "HELLO_VERSION": str(hello_version)}
    processes = [ProcessPlan(role=r, rank=k, argv=[sys.executable, str(child)], env=env) for r, k in roles]
    settings: dict[str, Any] = {"config": b"CFG", "startup_timeout_s": 20.0, "grace_period_s": 3.0,
                                "max_frame_bytes": 4096, "ready_url": "http://127.0.0.1:8000", **limits}
    return Plan(processes=processes, **settings)


FOUR: list[tuple[Role, int]] = [("frontend", 0), ("engine_core", 0), ("worker", 0), ("worker", 1)]


class Serve:
    """`python -m loom_supervisor run-plan -` in a subprocess, its stderr collected."""

    def __init__(self, plan: Plan, runtime_dir: Path) -> None:
        runtime_dir.mkdir(exist_ok=True)
        self.runtime_dir = runtime_dir
        env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loom_supervisor", "run-plan", "-"],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
        assert self.proc.stdin and self.proc.stderr
        self.proc.stdin.write(plan.to_msgpack())
        self.proc.stdin.close()
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr
        for raw in self.proc.stderr:
            with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any(pattern in line for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"{pattern!r} not seen; stderr:\n{self.text}")
                self._changed.wait(min(left, 0.1))

    def finish(self, timeout: float = 30.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def child_pids(self) -> dict[str, int]:
        return {m[1]: int(m[2]) for m in map(READY.search, self.lines) if m}


def gone(pid: int) -> bool:
    """No such process, or a zombie (reaped by init eventually; it runs nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def assert_all_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"still running: {[p for p in pids if not gone(p)]}")
        time.sleep(0.05)


def test_wire_versions_agree() -> None:
    assert client.WIRE_VERSION == loom_supervisor.WIRE_VERSION
    assert not hasattr(loom_supervisor, "PROTOCOL_VERSION") and not hasattr(client, "PROTOCOL_VERSION")


def test_plan_defaults_and_wire_form() -> None:
    worker = ProcessPlan(role="worker", argv=("/bin/true",))
    assert (worker.rank, worker.env) == (0, {})
    plan = Plan(processes=[worker])
    assert plan.to_wire() == {
        "processes": [{"role": "worker", "rank": 0, "argv": ["/bin/true"], "env": {}}],
        "config": b"", "startup_timeout_s": 300.0, "grace_period_s": 10.0, "max_frame_bytes": 64 << 20,
        "heartbeat_timeout_s": 0.0, "ready_url": None, "messages_version": loom_supervisor.WIRE_VERSION,
        "startup_trace_dir": None,
    }
    assert msgpack.unpackb(plan.to_msgpack(), raw=False) == plan.to_wire()
    with pytest.raises(TypeError):
        Plan([worker])  # type: ignore[call-arg]  # keyword-only
    with pytest.raises(loom_supervisor.PlanError, match=r"processes\[0\] is a dict; expected a ProcessPlan"):
        Plan(processes=[{"role": "worker", "argv": ["x"]}]).to_wire()  # type: ignore[list-item]


def frame_of(body: object, kind: str = client.PEER_DIED) -> client.Frame:
    return client.Frame(1, client.SUPERVISOR, "frontend", kind, msgpack.packb(body, use_bin_type=True))


PEER_DIED_BODY = {"role": "worker", "rank": 1, "pid": 123, "exit_code": None, "signal": "SIGKILL",
                  "phase": "running", "reason": "worker:1 was killed by SIGKILL", "stderr_tail": ["a", "oom"]}


def test_peer_died_from_a_good_body() -> None:
    died = client.PeerDied.from_frame(frame_of({**PEER_DIED_BODY, "later_field": 1}))
    assert died == client.PeerDied(role="worker", rank=1, pid=123, exit_code=None, signal="SIGKILL",
                                   phase="running", reason="worker:1 was killed by SIGKILL",
                                   stderr_tail=("a", "oom"))
    assert died.describe() == "worker:1 (pid 123) died with signal SIGKILL during running: worker:1 was killed by SIGKILL"
    exited = dataclasses.replace(died, role="engine_core", rank=0, exit_code=3, signal=None, reason="")
    assert exited.describe() == "engine_core (pid 123) died with exit code 3 during running: oom"
    stopped = dataclasses.replace(died, signal=None, phase="hello", stderr_tail=(),
                                  reason="worker:1 missed its start-up deadline: did not take its CONFIG within 2 s")
    assert stopped.describe() == (
        "worker:1 (pid 123) was stopped during hello: worker:1 missed its start-up deadline: "
        "did not take its CONFIG within 2 s"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        died.pid = 1  # type: ignore[misc]


def test_peer_died_of_a_remote_process_round_trips_with_its_node() -> None:
    died = client.PeerDied.from_frame(frame_of(PEER_DIED_BODY))
    assert died.node is None  # a body without "node" (every child's) decodes as before
    assert msgpack.unpackb(died.to_body()) == PEER_DIED_BODY
    remote = dataclasses.replace(died, node="10.0.0.2")
    assert msgpack.unpackb(remote.to_body()) == {**PEER_DIED_BODY, "node": "10.0.0.2"}
    assert client.PeerDied.from_frame(frame_of(msgpack.unpackb(remote.to_body()))) == remote
    assert remote.describe() == (
        "worker:1 (pid 123 on node 10.0.0.2) died with signal SIGKILL during running: worker:1 was killed by SIGKILL"
    )
    with pytest.raises(client.ProtocolError, match=re.escape("field 'node' is 7; expected str or None")):
        client.PeerDied.from_frame(frame_of({**PEER_DIED_BODY, "node": 7}))


@pytest.mark.parametrize(("frame", "message"), [
    (frame_of({k: v for k, v in PEER_DIED_BODY.items() if k != "pid"}), "PEER_DIED body has no 'pid'"),
    (frame_of({**PEER_DIED_BODY, "rank": "1"}), "field 'rank' is '1'; expected int"),
    (frame_of({**PEER_DIED_BODY, "exit_code": True}), "field 'exit_code' is True; expected int or None"),
    (frame_of({**PEER_DIED_BODY, "signal": 9}), "field 'signal' is 9; expected str or None"),
    (frame_of({**PEER_DIED_BODY, "stderr_tail": ["ok", 3]}), "'stderr_tail' holds a non-string"),
    (frame_of([1, 2]), "body is a list; expected a map"),
    (client.Frame(1, client.SUPERVISOR, "frontend", client.PEER_DIED, b"\xc1"), "body is not msgpack"),
    (frame_of(PEER_DIED_BODY, kind=client.SHUTDOWN), "expected a PEER_DIED frame, got SHUTDOWN"),
])
def test_peer_died_rejects_a_malformed_body(frame: client.Frame, message: str) -> None:
    with pytest.raises(client.ProtocolError, match=re.escape(message)):
        client.PeerDied.from_frame(frame)


def test_frames_round_trip_through_the_decoder() -> None:
    data = client.encode("worker:1", "engine_core", "X", b"body") + client.encode("frontend", "workers", "Y")
    decoder = client.Decoder()
    frames = decoder.feed(data[:5]) + decoder.feed(data[5:])
    assert frames == [
        client.Frame(1, "worker:1", "engine_core", "X", b"body"),
        client.Frame(1, "frontend", "workers", "Y", b""),
    ]
    assert decoder.pending() == 0


def test_recv_with_a_timeout_returns_none() -> None:
    import socket

    a, b = socket.socketpair()
    conn = client.Client(a, "frontend")
    assert conn.recv(0.05) is None
    b.sendall(client.encode("engine_core", "frontend", "X", b"1")[:7])  # half a frame
    assert conn.recv(0.05) is None
    b.sendall(client.encode("engine_core", "frontend", "X", b"1")[7:])
    assert conn.recv(1.0) == client.Frame(1, "engine_core", "frontend", "X", b"1")
    b.close()
    with pytest.raises(EOFError):
        conn.recv()
    conn.close()


def test_recv_nowait_never_blocks_and_hands_out_what_arrived() -> None:
    import socket

    a, b = socket.socketpair()
    conn = client.Client(a, "frontend")
    assert conn.recv_nowait() is None
    two = client.encode("engine_core", "frontend", "X", b"1") + client.encode("engine_core", "frontend", "Y")
    b.sendall(two[:7])  # half a frame
    assert conn.recv_nowait() is None
    b.sendall(two[7:])
    assert conn.recv_nowait() == client.Frame(1, "engine_core", "frontend", "X", b"1")
    assert conn.recv_nowait() == client.Frame(1, "engine_core", "frontend", "Y", b"")  # already buffered
    assert conn.recv_nowait() is None
    assert a.gettimeout() is None  # the socket stays blocking for send() and recv()
    b.sendall(client.encode("engine_core", "frontend", "Z"))
    assert conn.recv_nowait(read=False) is None  # only what is buffered: nothing
    assert conn.recv_nowait() == client.Frame(1, "engine_core", "frontend", "Z", b"")
    b.close()
    with pytest.raises(EOFError):
        conn.recv_nowait()
    conn.close()


def test_send_waits_on_a_full_socket_that_an_event_loop_made_non_blocking() -> None:
    """uvloop's ``add_reader`` sets the socket non-blocking: a frame larger than the socket
    buffers still goes out whole, sent as the reader makes room, never half a frame."""
    import socket

    a, b = socket.socketpair()
    a.setblocking(False)
    conn, peer = client.Client(a, "frontend"), client.Client(b, "engine_core")
    body = bytes(range(256)) * 16384  # 4 MiB: far more than the socket buffers hold
    sent: list[BaseException | None] = []

    def send() -> None:
        try:
            conn.send("engine_core", "X", body)
            sent.append(None)
        except BaseException as e:  # noqa: BLE001 (reported by the assertion below)
            sent.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.2)  # the sender fills the buffers and waits
    assert peer.recv(10.0) == client.Frame(1, "frontend", "engine_core", "X", body)
    sender.join(10)
    assert sent == [None]
    conn.close()
    peer.close()


def test_relay_between_four_children(child: Path, tmp_path: Path) -> None:
    serve = Serve(make_plan(child, "relay", FOUR), tmp_path / "xdg")
    assert serve.finish() == 0, serve.text
    text = serve.text
    assert set(serve.child_pids()) == {"frontend", "engine_core", "worker:0", "worker:1"}
    assert "loom-supervisor: all 4 processes ready; serving at http://127.0.0.1:8000" in text
    assert "[frontend] relay ok" in text
    # Each bad frame was rejected with a reason, and the serve went on (a frame over the size
    # limit is different: test_a_frame_over_the_limit_closes_the_connection_and_stops_the_serve).
    assert 'SPOOF frame from frontend rejected: src "engine_core" is not the sender' in text
    assert 'LOST frame from frontend rejected: unknown dst "worker:9"' in text
    assert "frontend: malformed frame" in text
    assert "unexpected" not in text
    assert "frontend (pid" in text and "finished; stopping the other processes" in text
    assert list((tmp_path / "xdg").iterdir()) == []
    assert_all_gone(list(serve.child_pids().values()))


def test_sigkill_of_the_supervisor_takes_every_child(child: Path, tmp_path: Path) -> None:
    serve = Serve(make_plan(child, "serve", FOUR), tmp_path / "xdg")
    serve.wait_for("all 4 processes ready")
    pids = list(serve.child_pids().values())
    assert len(pids) == 4 and not any(gone(p) for p in pids)
    serve.proc.kill()
    serve.finish()
    assert_all_gone(pids)
    # Once every child had connected the run directory was already removed.
    assert list((tmp_path / "xdg").iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_drains_the_frontend_and_exits_0(child: Path, tmp_path: Path, sig: int) -> None:
    serve = Serve(make_plan(child, "serve", FOUR), tmp_path / "xdg")
    serve.wait_for("all 4 processes ready")
    pids = list(serve.child_pids().values())
    serve.proc.send_signal(sig)
    assert serve.finish() == 0, serve.text
    assert f"{signal.Signals(sig).name} received: frontend is draining" in serve.text
    assert "[frontend] draining" in serve.text
    assert "all 4 processes stopped" in serve.text
    assert_all_gone(pids)
    assert list((tmp_path / "xdg").iterdir()) == []


@pytest.mark.parametrize(("behaviour", "ended", "exit_code", "sig", "last_line"), [
    ("crash_after_hello", "exited with code 1", 1, None, "RuntimeError: weights file is corrupt"),
    ("killed_after_hello", "was killed by SIGKILL", None, "SIGKILL", "out of memory"),
])
def test_a_crash_during_start_up_is_reported_with_its_phase(
    child: Path, tmp_path: Path, behaviour: str, ended: str, exit_code: int | None, sig: str | None, last_line: str,
) -> None:
    serve = Serve(make_plan(child, behaviour, FOUR), tmp_path / "xdg")
    assert serve.finish() == 1, serve.text
    text = serve.text
    found = re.search(rf"worker:1 \(pid (\d+)\) {ended} in start-up phase 'config'", text)
    assert found, text
    pid = int(found[1])
    assert f"role: worker, rank: 1, pid: {pid}" in text
    assert f"| {last_line}" in text
    assert "| INFO loading model" in text
    assert "stopped the other 3 processes; exiting with code 1" in text
    # The frontend heard about it first, with the same facts.
    assert "[frontend] PEER_DIED received" in text
    received = json.loads((child.parent / "peer_died.json").read_text())
    died = received["body"]
    assert died == {
        "role": "worker", "rank": 1, "pid": pid, "exit_code": exit_code, "signal": sig, "phase": "config",
        "reason": f"worker:1 {ended}", "stderr_tail": died["stderr_tail"],
    }
    assert died["stderr_tail"][0] == "INFO loading model" and died["stderr_tail"][-1] == last_line
    how = f"signal {sig}" if sig else f"exit code {exit_code}"
    assert received["described"] == f"worker:1 (pid {pid}) died with {how} during config: worker:1 {ended}"
    # The report comes last, in one piece.
    assert text.rstrip().endswith("exiting with code 1")
    assert list((tmp_path / "xdg").iterdir()) == []


@pytest.mark.parametrize(("behaviour", "limits", "report"), [
    # it stops itself after READY: its heartbeats end
    ("stop_itself", {"heartbeat_timeout_s": 2.0},
     r"is not responding: no heartbeat for 2 s \(process state: T \(stopped\)\)"),
    ("close_and_live", {}, r"closed its connection to the supervisor but kept running"),
    # a length prefix of 0xFFFFFFFF: the frames after it cannot be found, so the sender is reported
    ("oversize", {}, r"broke the frame protocol \(a frame of 4294967295 bytes is over the limit of 4096 bytes\); "
                     r"its connection was closed"),
])
def test_a_running_child_that_stops_answering_is_reported(child: Path, tmp_path: Path, behaviour: str,
                                                          limits: dict[str, float], report: str) -> None:
    roles: list[tuple[Role, int]] = [("frontend", 0), ("worker", 0)]
    serve = Serve(make_plan(child, behaviour, roles, grace_period_s=1.0, **limits), tmp_path / "rt")
    serve.wait_for("loom-supervisor: all 2 processes ready")
    started = time.monotonic()
    code = serve.finish()
    assert code == 1, serve.text
    assert time.monotonic() - started < 10, serve.text
    assert re.search(rf"worker:0 \(pid \d+\) {report}", serve.text), serve.text
    assert_all_gone(list(serve.child_pids().values()))


def test_a_remote_death_reported_by_the_engine_core_ends_the_serve(child: Path, tmp_path: Path) -> None:
    # A Ray serve: the workers are actors elsewhere; the engine core reports worker:1's death.
    serve = Serve(make_plan(child, "remote_died", [("frontend", 0), ("engine_core", 0)]), tmp_path / "xdg")
    assert serve.finish() == 1, serve.text  # as for the death of a local worker
    text = serve.text
    assert "worker:1 (pid 4242 on node 10.0.0.2) was killed by SIGKILL in phase 'running'" in text
    assert "role: worker, rank: 1, pid: 4242, node: 10.0.0.2" in text
    assert "engine_core reported: worker:1 died: its actor was lost with its node" in text
    assert "| CUDA error" in text
    assert text.rstrip().endswith("stopped the other 2 processes; exiting with code 1"), text
    # The frontend heard about it first, with the same facts and the node.
    assert "[frontend] PEER_DIED received" in text
    received = json.loads((child.parent / "peer_died.json").read_text())
    assert received["body"] == {
        "role": "worker", "rank": 1, "pid": 4242, "exit_code": None, "signal": "SIGKILL", "phase": "running",
        "reason": "worker:1 died: its actor was lost with its node", "stderr_tail": ["INFO loading model", "CUDA error"],
        "node": "10.0.0.2",
    }
    assert received["described"] == (
        "worker:1 (pid 4242 on node 10.0.0.2) died with signal SIGKILL during running: "
        "worker:1 died: its actor was lost with its node"
    )
    pids = serve.child_pids()
    assert set(pids) == {"frontend", "engine_core"}
    assert_all_gone(list(pids.values()))
    assert list((tmp_path / "xdg").iterdir()) == []


def test_a_remote_death_during_a_drain_is_reported_and_the_serve_exits_1(child: Path, tmp_path: Path) -> None:
    # SIGTERM: the frontend drains for 1.5 s, and meanwhile the engine core reports worker:1's death.
    serve = Serve(make_plan(child, "remote_died_while_draining", [("frontend", 0), ("engine_core", 0)]),
                  tmp_path / "xdg")
    serve.wait_for("all 2 processes ready")
    pids = serve.child_pids()
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.finish() == 1, serve.text  # every child ended cleanly, but a rank died
    text = serve.text
    assert "SIGTERM received: frontend is draining" in text
    told = "engine_core reported that worker:1 (pid 4242 on node 10.0.0.2) died while the serve was stopping"
    assert told in text
    # The drain went on to its end, the draining frontend told of the death (node included).
    assert "[frontend] PEER_DIED received" in text and "[frontend] drained" in text
    received = json.loads((child.parent / "peer_died.json").read_text())
    assert received["body"]["node"] == "10.0.0.2" and received["body"]["rank"] == 1
    # The report, as for a death while running, comes last.
    assert "worker:1 (pid 4242 on node 10.0.0.2) was killed by SIGKILL in phase 'running'" in text
    assert "role: worker, rank: 1, pid: 4242, node: 10.0.0.2" in text
    assert "engine_core reported: worker:1 died: its actor was lost with its node" in text
    assert "| CUDA error" in text
    assert text.rstrip().endswith("stopped the other 2 processes; exiting with code 1"), text
    assert set(pids) == {"frontend", "engine_core"}
    assert_all_gone(list(pids.values()))
    assert list((tmp_path / "xdg").iterdir()) == []


def test_a_remote_death_from_a_worker_or_with_a_bad_body_is_dropped(child: Path, tmp_path: Path) -> None:
    roles: list[tuple[Role, int]] = [("frontend", 0), ("engine_core", 0), ("worker", 0)]
    serve = Serve(make_plan(child, "remote_died_dropped", roles), tmp_path / "xdg")
    serve.wait_for("WARNING: REMOTE_DIED frame from worker:0 dropped: "
                   "only engine_core reports the death of a remote process, not worker:0")
    serve.wait_for("WARNING: REMOTE_DIED frame from engine_core dropped: its body is not a PEER_DIED map (")
    # The serve goes on: a stop request still drains it cleanly.
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.finish() == 0, serve.text
    text = serve.text
    assert 'b"\\xc1\\x1b[31m not msgpack"' in text and "\x1b" not in text  # the body shown escaped
    assert "[frontend] draining" in text and "all 3 processes stopped" in text
    assert "PEER_DIED received" not in text and "4242" not in text
    assert_all_gone(list(serve.child_pids().values()))


def test_a_crash_before_hello_is_reported(child: Path, tmp_path: Path) -> None:
    plan = make_plan(child, "crash_before_hello", [("engine_core", 0)])
    serve = Serve(plan, tmp_path / "xdg")
    assert serve.finish() == 1
    assert re.search(r"engine_core \(pid \d+\) exited with code 1 in start-up phase 'spawned'", serve.text)
    assert "| loading weights" in serve.text


def test_a_missed_ready_deadline_is_reported(child: Path, tmp_path: Path) -> None:
    plan = make_plan(child, "hang_before_ready", [("frontend", 0), ("worker", 0)], startup_timeout_s=2.0)
    serve = Serve(plan, tmp_path / "xdg")
    assert serve.finish() == 1, serve.text
    assert "worker:0" in serve.text and "sent no READY within 2 s in start-up phase 'config'" in serve.text


def test_a_hello_with_another_messages_version_stops_the_serve(child: Path, tmp_path: Path) -> None:
    plan = make_plan(child, "serve", [("frontend", 0), ("worker", 0)], hello_version=99, messages_version=7)
    serve = Serve(plan, tmp_path / "xdg")
    assert serve.finish() == 1, serve.text
    assert "was stopped at HELLO: it speaks messages version 99; the plan expects 7" in serve.text


@pytest.mark.parametrize("form", ["plan", "msgpack", "mapping"])
def test_the_plan_sets_the_messages_version(child: Path, form: str) -> None:
    plan = make_plan(child, "finish", [("frontend", 0), ("worker", 0)], hello_version=7, messages_version=7)
    forms: dict[str, Plan | bytes | dict[str, Any]] = {"plan": plan, "msgpack": plan.to_msgpack(),
                                                      "mapping": plan.to_wire()}
    assert loom_supervisor.run(forms[form]) == 0


def test_run_in_process_twice_and_signal_handlers_restored(child: Path, capfd: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for _ in range(2):
        plan = make_plan(child, "finish", [("frontend", 0), ("worker", 0)])
        assert loom_supervisor.run(plan) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    err = capfd.readouterr().err
    assert err.count("finished; stopping the other processes") == 2


def test_run_releases_the_gil(child: Path) -> None:
    ticks = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    thread = threading.Thread(target=tick)
    thread.start()
    plan = make_plan(child, "finish", [("frontend", 0), ("worker", 0)])
    started = time.monotonic()
    assert loom_supervisor.run(plan) == 0
    stop.set()
    thread.join()
    assert sum(1 for t in ticks if t > started) > 2


def test_plan_errors_are_exceptions(tmp_path: Path) -> None:
    with pytest.raises(loom_supervisor.PlanError, match=r"processes\[0\]\.role"):
        loom_supervisor.run({"processes": [{"role": "gpu", "argv": ["x"]}]})
    with pytest.raises(loom_supervisor.PlanError, match="msgpack"):
        loom_supervisor.run({"processes": [], "config": object()})
    with pytest.raises(loom_supervisor.PlanError, match="msgpack"):
        loom_supervisor.run(Plan(processes=[], config=object()))  # type: ignore[arg-type]
    # A renamed or misspelt key is an error, not a silent default.
    with pytest.raises(loom_supervisor.PlanError, match="unknown field `protocol_version`"):
        loom_supervisor.run({"processes": [{"role": "worker", "argv": ["x"]}], "protocol_version": 2})
    with pytest.raises(loom_supervisor.SpawnError, match="worker:0"):
        loom_supervisor.run({"processes": [{"role": "worker", "argv": [str(tmp_path / "missing")]}]})
    assert issubclass(loom_supervisor.SpawnError, loom_supervisor.SupervisorError)


def test_cli_serve_asks_python_for_the_plan(child: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "loom" / "entrypoints").mkdir(parents=True)
    (fake / "loom" / "__init__.py").write_text("")
    (fake / "loom" / "entrypoints" / "__init__.py").write_text("")
    plan = make_plan(child, "finish", [("frontend", 0), ("worker", 0)])
    (fake / "plan.bin").write_bytes(plan.to_msgpack())
    (fake / "loom" / "entrypoints" / "plan.py").write_text(textwrap.dedent(
        f"""
        import sys
        if sys.argv[1:] != ["tiny-model", "--tensor-parallel-size", "1"]:
            print(f"error: bad arguments {{sys.argv[1:]}}", file=sys.stderr)
            sys.exit(3)
        sys.stdout.buffer.write(open({str(fake / "plan.bin")!r}, "rb").read())
        """
    ))
    env = {**os.environ, "PYTHONPATH": str(fake), "LOOM_PYTHON": sys.executable}
    cmd = [sys.executable, "-m", "loom_supervisor", "serve", "tiny-model"]
    ok = subprocess.run([*cmd, "--tensor-parallel-size", "1"], env=env, capture_output=True, timeout=60)
    assert ok.returncode == 0, ok.stderr.decode()
    assert b"frontend (pid " in ok.stderr and b"finished; stopping the other processes" in ok.stderr
    bad = subprocess.run([*cmd, "--bogus"], env=env, capture_output=True, timeout=60)
    assert bad.returncode == 3
    assert bad.stderr.decode().strip() == "error: bad arguments ['tiny-model', '--bogus']"
    helped = subprocess.run([sys.executable, "-m", "loom_supervisor", "--help"], capture_output=True, timeout=60)
    assert helped.returncode == 0 and b"serve" in helped.stdout


@pytest.mark.skipif(os.environ.get("LOOM_SKIP_WHEEL_TEST") == "1", reason="LOOM_SKIP_WHEEL_TEST=1")
def test_wheel_provides_the_module_and_the_command(tmp_path: Path) -> None:
    project = Path(__file__).resolve().parents[1]
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(project)],
        check=True, capture_output=True, timeout=900,
    )
    (wheel,) = wheels.glob("loom_supervisor-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = "import loom_supervisor, sys; print(loom_supervisor.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, check=True, timeout=60)
    assert where.stdout.decode().startswith(str(target))
    command = target / "bin" / "loom-supervisor"
    helped = subprocess.run([str(command), "--help"], env=env, capture_output=True, timeout=60)
    assert helped.returncode == 0, helped.stderr.decode()
    assert b"Usage: loom-supervisor" in helped.stdout


def test_the_start_up_timeline_names_every_child_in_one_clock(child: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    before = time.time_ns()
    serve = Serve(make_plan(child, "relay", FOUR, startup_trace_dir=str(trace)), tmp_path / "xdg")
    assert serve.finish() == 0, serve.text
    after = time.time_ns()
    doc = json.loads((trace / "supervisor.json").read_text())
    assert [f.name for f in trace.iterdir()] == ["supervisor.json"]  # no temporary file left
    assert doc["outcome"] == "ready" and doc["supervisor_pid"] == serve.proc.pid
    pids = serve.child_pids()
    assert {c["address"]: c["pid"] for c in doc["children"]} == pids
    assert [(c["role"], c["rank"]) for c in doc["children"]] == list(FOUR)
    assert before <= doc["plan_ns"]
    for c in doc["children"]:
        steps = [c[k] for k in ("spawn_ns", "spawned_ns", "hello_ns", "config_ns", "ready_ns")]
        assert doc["plan_ns"] <= steps[0] and steps == sorted(steps), c
        assert steps[-1] <= doc["ready_ns"] <= after


def test_a_start_up_that_fails_still_writes_its_timeline(child: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    plan = make_plan(child, "crash_after_hello", FOUR, startup_trace_dir=str(trace))
    serve = Serve(plan, tmp_path / "xdg")
    assert serve.finish() == 1, serve.text
    doc = json.loads((trace / "supervisor.json").read_text())
    assert doc["outcome"] == "failed" and doc["ready_ns"] is None
    worker = next(c for c in doc["children"] if c["address"] == "worker:1")
    assert worker["hello_ns"] is not None and worker["ready_ns"] is None
