"""Tensor-parallel workers for an in-process engine (``loom.LLM``), through the supervisor.

The supervisor runs in a background thread of this process (GIL released) with a plan of
the workers plus a bridge child that stands in for the engine core (:mod:`.bridge`); the
engine here talks to the workers through that bridge with the same messages, and the same
``MultiprocExecutor``, as the engine-core process of ``loom serve``.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading

import loom_supervisor
from loom_supervisor import client

from ..config import LoomConfig
from ..ipc.channel import Channel
from .launch import build_plan
from .multiproc_executor import MultiprocExecutor


class SupervisedExecutor(MultiprocExecutor):
    """A ``MultiprocExecutor`` whose workers the supervisor runs for this process."""

    def __init__(self, config: LoomConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="loom-llm-")  # mkdtemp makes it 0700
        path = os.path.join(self._dir, "bridge.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        plan = build_plan(config, bridge_socket=path)
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
        # The bridge relays frames as they are: this end speaks the supervisor's framing, as engine_core.
        self._channel = Channel(client.Client(sock, "engine_core"), "engine_core")
        try:
            super().__init__(config, self._channel)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Close the bridge: the supervisor then stops every worker and returns."""
        self._channel.close()
        self._thread.join(timeout=60)
        shutil.rmtree(self._dir, ignore_errors=True)
