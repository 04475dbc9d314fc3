"""The front-end process of ``loom serve``: FastAPI + uvicorn over the engine-core process.

Start-up: platform and general plugins again (a fresh interpreter), connect to the
supervisor, take the config, load the tokenizer, build the app (endpoint plugins), listen.
READY goes to the supervisor once the socket listens *and* the engine core said it is
ready; ``/health`` answers 503 until then. SHUTDOWN from the supervisor drains: no new
connections, in-flight requests finish within the grace period, then the process exits 0.
Requests still running when the grace period is about to end get an error (an SSE error
event and ``[DONE]``, or a 503) and the process exits with ``DRAIN_CUT`` (3), so the serve's
exit code says the drain did not complete.
Its flags are the server's (``ServerConfig``), as the launch plan wrote them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from typing import Any

from loom_plugin_api import load_general_plugins, tracing
from loom_plugin_api.tracing import span

from .. import envs
from ..config import LoomConfig
from ..config.server import SERVE_START_ENV, ServerConfig, parse_lora_module
from ..engine.client import EngineClient
from ..engine.core_client import ProcCoreConnection
from ..gc_heap import freeze_long_lived
from ..ipc.channel import Channel
from ..logger import init_logger
from ..platforms import current_platform  # importing it resolves the platform, before any plugin
from ..transformers_utils.tokenizer import get_tokenizer
from .openai import build_app, serve_http
from .openai.limits import RequestLimits

logger = init_logger("loom.frontend")

DRAIN_CUT = 3
"""The front end's exit code when the grace period ended requests that were still running."""


def main(argv: list[str] | None = None) -> int:
    parser = ServerConfig.add_cli_args(argparse.ArgumentParser(prog="python -m loom.entrypoints.frontend"))
    server = ServerConfig.from_cli_args(parser.parse_args(argv))
    tracing.mark("main")
    freeze_long_lived()  # the imports stay out of every later collection
    load_general_plugins()
    channel = Channel.connect("frontend")
    config = channel.config()
    with span("load tokenizer"):
        tokenizer = get_tokenizer(config.model_config)
    return asyncio.run(_serve(config, tokenizer, channel, server))


async def _serve(config: LoomConfig, tokenizer: Any, channel: Channel, server: ServerConfig) -> int:
    loop = asyncio.get_running_loop()
    shutdown_event = asyncio.Event()
    ready_parts: set[str] = set()
    ready_lock = threading.Lock()

    http_start = [time.time_ns()]  # set again once the app is built

    def part_ready(part: str) -> None:
        with ready_lock:
            ready_parts.add(part)
            if part == "http":
                tracing.record("start the HTTP server", http_start[0])
            else:
                tracing.record("wait for the engine core", http_start[0], waits=True)
            if ready_parts == {"engine", "http"}:
                freeze_long_lived()  # and the app, the tokenizer
                channel.ready()
                logger.info("%s", ready_summary(config, server, client.kv_cache_tokens))

    client = EngineClient(
        config, tokenizer, ProcCoreConnection(channel),
        on_engine_ready=lambda: part_ready("engine"),
        on_shutdown=lambda: loop.call_soon_threadsafe(shutdown_event.set),
    )
    client.stream_interval = server.stream_interval
    limits = RequestLimits(max_n=server.max_n, max_request_body_bytes=server.max_request_body_bytes)
    with span("build the app (endpoint plugins)"):
        app = build_app(client, config.model_config.served_model_name, api_key=server.api_key,
                        chat_template=server.chat_template, limits=limits,
                        lora_modules=[parse_lora_module(m) for m in server.lora_modules],
                        chat_ui=not server.disable_chat_ui)
    http_start[0] = time.time_ns()
    cut = 0

    def end_the_rest() -> None:
        nonlocal cut
        cut = client.end_all(f"the server is shutting down: its grace period of {server.grace_period:g} s "
                             "ended before this request finished; retry it")
        if cut:
            logger.warning("The grace period is ending: %d request(s) still running were ended with an error", cut)

    envs.enable_envs_cache()
    await serve_http(app, server.host, server.port, ready_callback=lambda host, port: part_ready("http"),
                     shutdown_event=shutdown_event, grace_period=server.grace_period, on_grace_expiring=end_the_rest)
    await client.shutdown()
    return DRAIN_CUT if cut else 0


def ready_summary(config: LoomConfig, server: ServerConfig, kv_cache_tokens: int | None) -> str:
    """The line ``loom serve`` prints once it serves: what runs, where, and how long start-up took
    (from the CLI's start, which it passes in ``LOOM_SERVE_START_NS``)."""
    model = config.model_config
    started = os.environ.get(SERVE_START_ENV, "")
    took = f" in {(time.time_ns() - int(started)) / 1e9:.1f} s" if started.isdigit() else ""
    kv = f"{kv_cache_tokens:,}" if kv_cache_tokens is not None else "unknown"
    chat = "" if server.disable_chat_ui else " (chat page at /)"
    quant = "" if model.quantization in ("none", None) else f" ({model.quantization} weights)"
    return (f"Ready{took}: model {model.served_model_name} ({model.architecture}), platform "
            f"{current_platform.device_name}, {model.dtype}{quant}, TP {config.parallel_config.tensor_parallel_size}, "
            f"KV cache {kv} tokens; serving at {server.ready_url}{chat}")


if __name__ == "__main__":
    sys.exit(main())
