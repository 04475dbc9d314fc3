"""An in-process OpenAI server for tests: ``serve_http`` on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import threading

from fastapi import FastAPI
from loom.entrypoints.openai import serve_http


class ServerThread:
    """``serve_http`` in a thread with its own event loop; ``stop()`` drains and joins it."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.ready = threading.Event()
        self.port = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()

            def ready(host: str, port: int) -> None:
                self.port = port
                self.ready.set()

            await serve_http(self.app, "127.0.0.1", 0, ready_callback=ready, shutdown_event=self.stop_event,
                             grace_period=5, log_level="warning", access_log=False)

        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced by start()
            self.error = e
            self.ready.set()

    def __enter__(self) -> ServerThread:
        self.thread.start()
        assert self.ready.wait(30), "the server did not start"
        if self.error is not None:
            raise self.error
        return self

    def stop(self) -> None:
        """Ask the server to drain and stop; a no-op once its loop has already closed."""
        try:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        except RuntimeError:  # the loop closed between the check and the call: the server already stopped
            pass

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.thread.join(15)
        assert not self.thread.is_alive(), "the server did not stop within 15 s"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
