"""The launch plan of ``loom serve``: which processes to start, with which environment.

The CLI process builds the ``LoomConfig`` once (stops 3-7) and the plan carries it,
pickled, to every child through the supervisor's CONFIG frame. ``python -m
loom.entrypoints.plan ARGS`` prints the plan as msgpack for the ``loom-supervisor``
binary.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys
from typing import Any

from ..config import LoomConfig
from ..ipc.messages import PROTOCOL_VERSION

MAX_FRAME_BYTES = 64 << 20


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("LOOM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $LOOM_API_KEY)")
    g.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds each start-up phase of each process may take")
    g.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    g.add_argument("--chat-template", default=None,
                   help="chat template for /v1/chat/completions instead of the tokenizer's: the path of a "
                        "Jinja file, or the template itself")
    g.add_argument("--stream-interval", type=_positive_int, default=1,
                   help="tokens per streamed event at least (default 1: every token); larger values "
                        "send fewer, larger SSE events when many streams share a small machine")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def worker_env(env: dict[str, str], tp: int) -> dict[str, str]:
    """The workers' environment: a rendezvous address for torch.distributed, and a share of
    the cores each, so that ranks do not oversubscribe them."""
    wenv = dict(env, LOOM_DIST_INIT_METHOD=f"tcp://127.0.0.1:{_free_port()}")
    if tp > 1:
        per_rank = max(1, (os.cpu_count() or 1) // tp)
        wenv.setdefault("LOOM_CPU_NUM_THREADS", str(per_rank))
        wenv.setdefault("OMP_NUM_THREADS", str(per_rank))
    return wenv


def build_plan(config: LoomConfig, args: argparse.Namespace) -> dict[str, Any]:
    python = sys.executable
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("LOOM_API_KEY", None)
    frontend_env = dict(env)
    if args.api_key:
        frontend_env["LOOM_API_KEY"] = args.api_key  # not on the command line, where ps shows it
    tp = config.parallel_config.tensor_parallel_size
    wenv = worker_env(env, tp)
    frontend_argv = [python, "-m", "loom.entrypoints.frontend", "--host", args.host, "--port", str(args.port),
                     "--grace-period", str(args.grace_period),
                     "--stream-interval", str(args.stream_interval)]
    chat_template = args.chat_template
    if chat_template is not None:
        # The template text, read and checked once here (plan_from_args): the front end takes it as is.
        frontend_argv += ["--chat-template", chat_template]
    processes = [
        {"role": "frontend", "rank": 0, "env": frontend_env, "argv": frontend_argv},
        {"role": "engine_core", "rank": 0, "env": env, "argv": [python, "-m", "loom.engine.core_proc"]},
    ]
    for rank in range(tp):
        processes.append({"role": "worker", "rank": rank, "env": wenv,
                          "argv": [python, "-m", "loom.worker.proc", "--rank", str(rank)]})
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    return {
        "processes": processes,
        "config": pickle.dumps(config),
        "startup_timeout_s": float(args.startup_timeout),
        "grace_period_s": float(args.grace_period),
        "max_frame_bytes": MAX_FRAME_BYTES,
        "ready_url": f"http://{host}:{args.port}",
        "protocol_version": PROTOCOL_VERSION,
    }


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of ``loom serve``: the model, the server, then the engine (plugins first)."""
    from ..engine.arg_utils import EngineArgs

    parser.add_argument("model", nargs="?", default=None,
                        help="model path (default: the embedded SmolLM2-135M-Instruct)")
    add_server_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


def plan_from_args(args: argparse.Namespace) -> dict[str, Any]:
    from ..engine.arg_utils import EngineArgs
    from .chat_utils import load_chat_template

    args.chat_template = load_chat_template(args.chat_template)  # a bad template fails before the model loads
    config = EngineArgs.from_cli_args(args).create_engine_config()
    return build_plan(config, args)


def main(argv: list[str] | None = None) -> int:
    import msgpack

    args = add_serve_args(argparse.ArgumentParser(prog="loom serve")).parse_args(argv)
    try:
        plan = plan_from_args(args)
    except (ValueError, TypeError, OSError, RuntimeError, ImportError) as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(msgpack.packb(plan, use_bin_type=True))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
