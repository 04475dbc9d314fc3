"""Tensor-parallel workers for an in-process engine (``loom.LLM``), through the supervisor.

The supervisor runs in a background thread of this process (GIL released) with a plan of
the workers plus a bridge child that stands in for the engine core (see
``loom.entrypoints.bridge``); the engine here talks to the workers through that bridge
with the same messages as the engine-core process of ``loom serve``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import sys
import tempfile
import threading
from typing import Any

from ..config import LoomConfig
from ..ipc.channel import Message
from ..ipc.codec import encode
from ..ipc.messages import BODY_TYPES, PROTOCOL_VERSION, decode_body
from ..logger import init_logger
from .multiproc_executor import MultiprocExecutor

logger = init_logger(__name__)


class BridgeChannel:
    """The ``Channel`` interface over the bridge socket: this process is ``engine_core``."""

    def __init__(self, sock: socket.socket) -> None:
        from loom_supervisor import client

        self._client = client
        self._sock = sock
        self._decoder = client.Decoder()
        self._ready: list[Any] = []

    def send(self, dst: str, kind: str, msg: Any) -> None:
        self._sock.sendall(self._client.encode("engine_core", dst, kind, encode(msg)))

    def recv(self, timeout: float | None = None) -> Message | None:
        while not self._ready:
            self._sock.settimeout(timeout)
            try:
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                return None
            if not data:
                raise EOFError("the worker processes are gone (see the supervisor's report above)")
            self._ready.extend(self._decoder.feed(data))
        frame = self._ready.pop(0)
        body = decode_body(frame.kind, frame.body) if frame.kind in BODY_TYPES else frame.body
        return Message(frame.src, frame.kind, body)

    def close(self) -> None:
        self._sock.close()


class SupervisedExecutor(MultiprocExecutor):
    """A ``MultiprocExecutor`` whose workers the supervisor runs for this process."""

    def __init__(self, config: LoomConfig) -> None:
        import loom_supervisor

        self._dir = tempfile.mkdtemp(prefix="loom-llm-")  # mkdtemp makes it 0700
        path = os.path.join(self._dir, "bridge.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        plan = _worker_plan(config, path)
        self.exit_code: int | None = None

        def supervise() -> None:
            self.exit_code = loom_supervisor.run(plan)

        self._thread = threading.Thread(target=supervise, name="loom-supervisor", daemon=True)
        self._thread.start()
        listener.settimeout(120)
        try:
            sock, _ = listener.accept()
        finally:
            listener.close()
            os.unlink(path)
        sock.settimeout(None)
        self._channel = BridgeChannel(sock)
        try:
            super().__init__(config, self._channel)  # type: ignore[arg-type]
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Close the bridge: the supervisor then stops every worker and returns."""
        self._channel.close()
        self._thread.join(timeout=60)
        shutil.rmtree(self._dir, ignore_errors=True)


def _worker_plan(config: LoomConfig, bridge_socket: str) -> dict[str, Any]:
    from ..entrypoints.plan import MAX_FRAME_BYTES, worker_env

    python = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    processes = [{"role": "engine_core", "rank": 0, "env": dict(env, LOOM_BRIDGE_SOCKET=bridge_socket),
                  "argv": [python, "-m", "loom.entrypoints.bridge"]}]
    wenv = worker_env(env, config.parallel_config.tensor_parallel_size)
    for rank in range(config.parallel_config.tensor_parallel_size):
        processes.append({"role": "worker", "rank": rank, "env": wenv,
                          "argv": [python, "-m", "loom.worker.proc", "--rank", str(rank)]})
    return {"processes": processes, "config": pickle.dumps(config), "startup_timeout_s": 300.0,
            "grace_period_s": 10.0, "max_frame_bytes": MAX_FRAME_BYTES, "ready_url": None,
            "protocol_version": PROTOCOL_VERSION}
