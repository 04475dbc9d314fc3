"""A stand-in for ``loom serve`` that starts in a moment, for tests of ``loom bench``.

    python tests/fake_loom_serve.py [MODEL] [FLAGS...] --port P [--startup-trace FILE]
    python tests/fake_loom_serve.py --help        # lists --startup-trace unless FAKE_NO_TRACE=1

It answers ``GET /health`` with 200 and ``POST /v1/completions`` (stream) with one SSE event
per requested token (text ``"t"``), the usage, then ``[DONE]``; with ``FAKE_API_KEY`` set it
wants that bearer token (401 in OpenAI's shape otherwise). With ``--startup-trace FILE`` it
writes a Chrome trace of four tracks (cli, supervisor, frontend, worker:0) with nested spans,
in the format of loom's start-up trace. SIGTERM stops it (exit 0).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def write_trace(path: str) -> None:
    now = time.time() * 1e6
    pid = os.getpid()
    roles = {pid: "cli", pid + 1: "supervisor", pid + 2: "frontend", pid + 3: "worker:0"}
    events = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": r}} for p, r in roles.items()]
    spans = [(pid, "interpreter and imports", 0, 300_000), (pid, "import torch", 10_000, 200_000),
             (pid + 1, "spawn", 300_000, 20_000), (pid + 1, "READY", 320_000, 600_000),
             (pid + 2, "imports", 330_000, 300_000), (pid + 3, "load weights", 340_000, 500_000),
             (pid + 3, "read safetensors", 350_000, 200_000)]
    events += [{"ph": "X", "name": n, "cat": "startup", "ts": now + ts, "dur": dur, "pid": p, "tid": 1, "args": {}}
               for p, n, ts, dur in spans]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"fake": True}}, f)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass  # quiet: the bench's log file keeps only what matters

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = os.environ.get("FAKE_API_KEY")
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            error = json.dumps({"error": {"message": "invalid API key", "type": "invalid_request_error"}}).encode()
            self.send_response(401)
            self.send_header("Content-Length", str(len(error)))
            self.end_headers()
            self.wfile.write(error)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        n = body["max_tokens"]
        for _ in range(n):
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                 "total_tokens": len(body["prompt"]) + n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


def main(argv: list[str]) -> int:
    if "--help" in argv:
        print("usage: loom serve [MODEL] [--port PORT]" + ("" if os.environ.get("FAKE_NO_TRACE") else
                                                            " [--startup-trace FILE]"))
        return 0
    port = int(argv[argv.index("--port") + 1])
    if "--startup-trace" in argv:
        write_trace(argv[argv.index("--startup-trace") + 1])
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
