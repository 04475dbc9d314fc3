"""The stand-in for the engine core when ``loom.LLM`` runs tensor-parallel workers.

``loom.LLM(..., tensor_parallel_size=N)`` keeps the engine (scheduler, KV-cache manager)
in the caller's process and starts the workers through the supervisor, exactly as
``loom serve`` does. Only the supervisor's own children may connect to it, so this small
child connects as ``engine_core`` and passes frames unchanged between the supervisor and
the ``LLM`` process (over the Unix socket named by ``LOOM_BRIDGE_SOCKET``). When the
``LLM`` closes its end, the bridge exits 0 and the supervisor stops the workers.
docs/decisions.md says why the bridge stays.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from loom_supervisor import client

from ..ipc.messages import MESSAGES_VERSION


def main() -> int:
    llm = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    llm.connect(os.environ["LOOM_BRIDGE_SOCKET"])
    conn = client.connect(role="engine_core", rank=0)
    conn.hello("engine_core", 0, MESSAGES_VERSION)
    conn.ready()

    def to_llm() -> None:
        try:
            while True:
                frame = conn.recv()
                llm.sendall(client.encode(frame.src, frame.dst, frame.kind, frame.body))
        except (EOFError, OSError):
            pass
        finally:
            llm.close()

    threading.Thread(target=to_llm, daemon=True).start()
    decoder = client.Decoder()
    while True:
        try:
            data = llm.recv(1 << 16)
        except OSError:
            return 0
        if not data:
            return 0  # the LLM closed: a clean end, the supervisor stops the workers
        for frame in decoder.feed(data):
            conn.send(frame.dst, frame.kind, frame.body)


if __name__ == "__main__":
    sys.exit(main())
