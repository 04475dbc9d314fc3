"""Serve an app with uvicorn inside the caller's event loop, with a readiness hook and a graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from ...logger import init_logger

logger = init_logger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, capture_signals: bool) -> None:
        super().__init__(config)
        self._capture = capture_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if self._capture:
            with super().capture_signals():
                yield
        else:  # the caller owns the signals and tells us to stop through shutdown_event
            yield


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket for ``host:port`` (port 0: any free port), with a message that says how to fix a clash."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --host/--port") from e


async def serve_http(
    app: Any,
    host: str,
    port: int,
    ready_callback: Callable[[str, int], Any] | None = None,
    shutdown_event: asyncio.Event | None = None,
    *,
    grace_period: float = 30.0,
    log_level: str = "info",
    access_log: bool = True,
    on_grace_expiring: Callable[[], Any] | None = None,
) -> None:
    """Serve ``app`` on ``host:port`` until ``shutdown_event`` is set (or SIGINT/SIGTERM when none is given).

    ``ready_callback(host, port)`` runs once the socket accepts connections (``port`` is the
    bound one, useful with port 0). On shutdown the server stops accepting, lets requests in
    flight finish for up to ``grace_period`` seconds, then cancels what is left (their
    engine requests are aborted). ``on_grace_expiring`` runs shortly before the grace period
    ends (a second, or a fifth of it): the caller ends what is still running with an error its
    clients can read, instead of a cut connection. Returns when the server has stopped; the
    caller then shuts the engine down. Bind errors raise ``OSError`` before anything is served.
    """
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=grace_period, timeout_keep_alive=5)
    server = _Server(config, capture_signals=shutdown_event is None)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if serving.done():
                await serving
                raise RuntimeError(f"the HTTP server on {host}:{bound_port} stopped during start-up")
            await asyncio.sleep(0.01)
        logger.info("OpenAI-compatible server listening on http://%s:%d", host, bound_port)
        if ready_callback is not None:
            ready_callback(host, bound_port)
        if shutdown_event is not None:
            stop = asyncio.create_task(shutdown_event.wait())
            done, _ = await asyncio.wait({serving, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                logger.info("Shutting down the HTTP server: draining requests in flight (up to %.0f s)",
                            grace_period)
                server.should_exit = True
                if on_grace_expiring is not None:
                    margin = min(1.0, grace_period / 5)
                    expiring = asyncio.get_running_loop().call_later(grace_period - margin, on_grace_expiring)
                    serving.add_done_callback(lambda _: expiring.cancel())
            else:
                stop.cancel()
        await serving
    except BaseException:
        server.should_exit = server.force_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(serving, timeout=5)
        raise
    finally:
        sock.close()
