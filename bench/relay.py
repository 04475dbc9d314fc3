"""Round trips through the supervisor versus a direct Unix-socket pair, in the same run.

    python bench/relay.py --frames 20000 --body 64

Two processes ping-pong one frame at a time (latency), then the pinger streams frames
with 64 in flight (throughput). Through the supervisor that is two hops per round trip
(frontend -> supervisor -> engine_core and back); the direct pair has none. Prints p50/p99
round-trip latency, the one-way supervisor hop estimate ((via - direct) / 2 per hop), and
frames/s.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time


def pinger(conn, frames: int, body: bytes, window: int, out: str, stop_peer: bool) -> None:  # type: ignore[no-untyped-def]
    lat = []
    for _ in range(frames):
        t0 = time.perf_counter()
        conn.send("engine_core", "PING", body)
        conn.recv()
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sent = received = 0
    while received < frames:
        while sent < frames and sent - received < window:
            conn.send("engine_core", "PING", body)
            sent += 1
        conn.recv()
        received += 1
    elapsed = time.perf_counter() - t0
    if stop_peer:  # under the supervisor the peer is stopped with the serve instead
        conn.send("engine_core", "STOP", b"")
    with open(out, "w") as f:
        json.dump({"lat": lat, "fps": frames / elapsed}, f)


def echo(conn) -> None:  # type: ignore[no-untyped-def]
    while True:
        frame = conn.recv()
        if frame.kind == "STOP":
            return
        conn.send(frame.src, "PONG", frame.body)


class _Direct:
    """The same framing over a plain socket pair (no supervisor)."""

    def __init__(self, sock: socket.socket, me: str) -> None:
        from loom_supervisor.client import Decoder

        self.sock, self.me, self.decoder, self.ready = sock, me, Decoder(), []

    def send(self, dst: str, kind: str, body: bytes) -> None:
        from loom_supervisor.client import encode

        self.sock.sendall(encode(self.me, dst, kind, body))

    def recv(self):  # type: ignore[no-untyped-def]
        while not self.ready:
            self.ready.extend(self.decoder.feed(self.sock.recv(1 << 16)))
        return self.ready.pop(0)


def child_main(args: argparse.Namespace) -> None:
    from loom_supervisor import client

    conn = client.connect()
    conn.hello()
    conn.ready()
    body = b"x" * args.body
    if conn.role == "frontend":
        time.sleep(0.2)  # let the echo side finish its start-up
        pinger(conn, args.frames, body, args.window, args.out, stop_peer=False)
    else:
        echo(conn)


def via_supervisor(args: argparse.Namespace, out: str) -> dict:
    import loom_supervisor

    me = [sys.executable, os.path.abspath(__file__), "--child", "--frames", str(args.frames), "--body",
          str(args.body), "--window", str(args.window), "--out", out]
    env = dict(os.environ)
    plan = {"processes": [{"role": "frontend", "argv": me, "env": env},
                          {"role": "engine_core", "argv": me, "env": env}],
            "config": b"", "startup_timeout_s": 60.0, "grace_period_s": 5.0}
    code = loom_supervisor.run(plan)
    if code != 0:
        raise RuntimeError(f"supervisor run failed with {code}")
    with open(out) as f:
        return json.load(f)


def direct_pair(args: argparse.Namespace, out: str) -> dict:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        try:
            echo(_Direct(b, "engine_core"))
        finally:
            os._exit(0)
    b.close()
    pinger(_Direct(a, "frontend"), args.frames, b"x" * args.body, args.window, out, stop_peer=True)
    os.waitpid(pid, 0)
    with open(out) as f:
        return json.load(f)


def summary(name: str, r: dict) -> tuple[float, float, float]:
    lat = sorted(r["lat"])
    p50 = statistics.median(lat) * 1e6
    p99 = lat[int(0.99 * (len(lat) - 1))] * 1e6
    print(f"{name}: round trip p50 {p50:.1f} us, p99 {p99:.1f} us; {r['fps']:,.0f} frames/s (64 in flight)")
    return p50, p99, r["fps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=20000)
    parser.add_argument("--body", type=int, default=64)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    with tempfile.TemporaryDirectory() as root:
        direct = summary("direct socket pair", direct_pair(args, os.path.join(root, "direct.json")))
        via = summary("through the supervisor", via_supervisor(args, os.path.join(root, "via.json")))
    print(f"supervisor hop (one way, p50): {(via[0] - direct[0]) / 2:.1f} us")


if __name__ == "__main__":
    main()
