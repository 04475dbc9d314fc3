"""The flags of ``loom serve`` and the plan they make.

``python -m loom.entrypoints.plan ARGS`` prints the plan as msgpack for the
``loom-supervisor`` binary (its ``serve`` command); ``loom serve`` hands the same plan to
``loom_supervisor.run``. The plan itself is built in :mod:`loom.engine.launch`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from loom_plugin_api import tracing
from loom_plugin_api.tracing import span

from ..config import LoomConfig
from ..config.server import SERVE_START_ENV, ServerConfig, parse_lora_module
from ..engine.arg_utils import EngineArgs
from ..lora.peft import check_adapter
from .chat_utils import load_chat_template

if TYPE_CHECKING:
    from loom_supervisor import Plan


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of ``loom serve``: the model, the server, then the engine (plugins first)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="model path (default: the embedded SmolLM2-135M-Instruct)")
    ServerConfig.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The config first (its errors end a serve before anything else), then the plan."""
    server = ServerConfig.from_cli_args(args)
    # the front end's ready line counts from here (the CLI's own start, where /proc tells it)
    os.environ[SERVE_START_ENV] = str(tracing.process_start_ns() or time.time_ns())
    # The template text, read and checked once here (before the model loads): the front end takes it as is.
    server.chat_template = load_chat_template(server.chat_template)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    with span("check the LoRA adapters"):
        _check_lora_modules(server, config)
    try:
        from ..engine.launch import build_plan  # lazy: loom_supervisor is an optional wheel
    except ImportError as e:
        raise ImportError(f"loom serve needs the supervisor: pip install ./supervisor-rs (loom-supervisor); {e}") from None
    with span("build the launch plan"):
        return build_plan(config, server)


def _check_lora_modules(server: ServerConfig, config: LoomConfig) -> None:
    """``--lora-modules``: each adapter checked against the model before anything starts."""
    if server.lora_modules and not config.lora_config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names: set[str] = set()
    checked = []
    for module in map(parse_lora_module, server.lora_modules):
        name, path = module.name, module.path
        if name in names or name == config.model_config.served_model_name:
            raise ValueError(f"--lora-modules: the name {name!r} is taken (by another adapter or the base model)")
        names.add(name)
        path = os.path.abspath(path)  # the front end may run elsewhere (its own working directory)
        check_adapter(path, config.model_config.hf_config, config.lora_config.max_lora_rank, name=name)
        checked.append(f"{name}={path}")
    server.lora_modules = checked


def main(argv: list[str] | None = None) -> int:
    args = add_serve_args(argparse.ArgumentParser(prog="loom serve")).parse_args(argv)
    try:
        plan = plan_from_args(args)
    except (ValueError, TypeError, OSError, RuntimeError, ImportError) as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(plan.to_msgpack())
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
