"""The ``loom`` command. Subcommand modules are imported only when chosen."""

from __future__ import annotations

import argparse
import importlib
import sys

from loom_plugin_api import tracing

from ... import __version__
from ...logger import init_logger
from .. import startup_trace

logger = init_logger(__name__)

# name -> (module, one-line help). Modules define add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("loom.entrypoints.cli.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("loom.entrypoints.cli.generate", "generate text with a model, offline"),
    "bench": ("loom.entrypoints.cli.bench", "measure loom on fixed workloads: offline, serve, startup"),
    "plugins": ("loom.entrypoints.cli.plugins", "show every plugin group, entry point and platform verdict"),
    "collect-env": ("loom.entrypoints.cli.collect_env", "print versions, the platform and plugins"),
}


def _chosen(argv: list[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="loom: a plugin-first LLM inference server")
    parser.add_argument("--version", action="version", version=f"loom {__version__}")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    chosen = _chosen(argv)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module_name).add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _chosen(argv) == "serve" and startup_trace.requested(argv):
        startup_trace.begin("cli")  # before the parser: the CLI's plugins and config are spans too
        tracing.mark("main")
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if args.subcommand is None:
            parser.print_help()
            return 2
        module = importlib.import_module(SUBCOMMANDS[args.subcommand][0])
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, OSError, RuntimeError, ImportError) as e:
        # User-facing errors are one line; LOOM_LOGGING_LEVEL=DEBUG shows the traceback.
        logger.debug("loom failed", exc_info=True)
        print(f"loom: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
