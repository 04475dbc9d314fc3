"""``loom serve``: build the config and the launch plan here, then supervise the processes."""

from __future__ import annotations

import argparse

from ..plan import add_serve_args, plan_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_serve_args(subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)  # config errors end here, before anything is spawned
    import loom_supervisor  # lazy: an optional wheel (plan_from_args said so if it is missing)

    return int(loom_supervisor.run(plan))
