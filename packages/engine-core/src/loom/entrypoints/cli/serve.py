"""``loom serve``: build the config and the launch plan here, then supervise the processes."""

from __future__ import annotations

import argparse

from ..plan import add_serve_args, plan_from_args
from ..startup_trace import StartupTrace


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_serve_args(subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    parser.add_argument("--startup-trace", metavar="FILE", default=None,
                        help="write every process's start-up phases to FILE as one Chrome trace (open it in "
                             "https://ui.perfetto.dev), and print the time to ready and the longest steps")
    return parser


def run(args: argparse.Namespace) -> int:
    trace = StartupTrace(args.startup_trace, "cli", root="loom serve: start-up until READY") \
        if args.startup_trace else None
    try:
        plan = plan_from_args(args)  # config errors end here, before anything is spawned
        import loom_supervisor  # lazy: an optional wheel (plan_from_args said so if it is missing)

        if trace is not None:
            trace.watch_supervisor()
        return int(loom_supervisor.run(plan))
    finally:
        if trace is not None:
            trace.finish()  # a serve that ended before READY: what was recorded until then
