"""The front-end process of ``loom serve``: FastAPI + uvicorn over the engine-core process.

Start-up: platform and general plugins again (a fresh interpreter), connect to the
supervisor, take the config, load the tokenizer, build the app (endpoint plugins), listen.
READY goes to the supervisor once the socket listens *and* the engine core said it is
ready; ``/health`` answers 503 until then. SHUTDOWN from the supervisor drains: no new
connections, in-flight requests finish within the grace period, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading

from loom_plugin_api import load_general_plugins

from ..logger import init_logger

logger = init_logger("loom.frontend")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom.entrypoints.frontend")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--grace-period", type=float, default=10.0)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--chat-template", default=None, help="the template text (loom serve read and checked it)")
    args = parser.parse_args(argv)

    from ..platforms import current_platform  # noqa: F401 - resolved first, in every process

    load_general_plugins()
    from ..ipc.channel import Channel
    from ..transformers_utils.tokenizer import get_tokenizer

    channel = Channel("frontend")
    config = channel.config()
    tokenizer = get_tokenizer(config.model_config)
    asyncio.run(_serve(config, tokenizer, channel, args))
    return 0


async def _serve(config, tokenizer, channel, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    from .. import envs
    from ..engine.core_client import CoreClient
    from .openai import build_app, serve_http

    loop = asyncio.get_running_loop()
    shutdown_event = asyncio.Event()
    ready_parts: set[str] = set()
    ready_lock = threading.Lock()

    def part_ready(part: str) -> None:
        with ready_lock:
            ready_parts.add(part)
            if ready_parts == {"engine", "http"}:
                channel.ready()
                logger.info("Front end is ready")

    client = CoreClient(
        config, tokenizer, channel,
        on_engine_ready=lambda: part_ready("engine"),
        on_shutdown=lambda: loop.call_soon_threadsafe(shutdown_event.set),
    )
    client.stream_interval = args.stream_interval
    app = build_app(client, config.model_config.served_model_name, api_key=os.environ.get("LOOM_API_KEY"),
                    chat_template=args.chat_template)
    envs.enable_envs_cache()
    await serve_http(app, args.host, args.port, ready_callback=lambda host, port: part_ready("http"),
                     shutdown_event=shutdown_event, grace_period=args.grace_period)
    await client.shutdown()


if __name__ == "__main__":
    sys.exit(main())
