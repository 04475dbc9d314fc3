"""``loom plugins check NAME``: run the conformance kit (``loom_plugin_api.testing``) against
the installed platform whose detector is NAME, as ``pytest --pyargs loom_plugin_api.testing
--loom-platform NAME`` would, from an empty folder so that no project's pytest settings or
conftest files take part."""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path

from loom_plugin_api.testing import TIERS

__all__ = ["add_subcommand", "run"]


def add_subcommand(plugins_parser: argparse.ArgumentParser) -> None:
    """Give ``loom plugins`` its ``check`` subcommand (``args.plugins_command == "check"``), next
    to any subcommand it already has."""
    sub = next((a for a in plugins_parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        sub = plugins_parser.add_subparsers(dest="plugins_command", metavar="COMMAND")
    p = sub.add_parser("check", help="run the conformance kit against an installed platform")
    p.add_argument("name", metavar="NAME", help="the platform detector's name, as `loom plugins` lists it")
    p.add_argument("--tiers", default=None, metavar="TIER[,TIER...]",
                   help=f"only these tiers (default: all): {', '.join(TIERS)}")
    p.add_argument("--report", default=None, metavar="PATH", help="write the JSON report to PATH")
    p.add_argument("--platform-class", default=None, metavar="QUALNAME",
                   help="the Platform class to check when the detector answers None here (device absent)")
    p.add_argument("--pytest-args", default="", metavar="ARGS",
                   help='more pytest arguments, as one string: --pytest-args="-x -k rms_norm"')


def pytest_args(args: argparse.Namespace, workdir: Path) -> list[str]:
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\n")
    # --confcutdir: no conftest.py above the empty folder takes part (a project's own rules,
    # such as a checkout's, would otherwise apply to the kit where it is installed).
    argv = ["--pyargs", "loom_plugin_api.testing", "--loom-platform", args.name, "-c", str(ini),
            "--rootdir", str(workdir), "--confcutdir", str(workdir), "-p", "no:cacheprovider", "-q", "-rfs",
            # The contract is already imported here; the kit's messages do not come from asserts.
            "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if args.tiers:
        tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
        unknown = [t for t in tiers if t not in TIERS]
        if unknown:
            raise ValueError(f"unknown tier(s) {', '.join(unknown)}; the tiers are {', '.join(TIERS)}")
        argv += ["-m", " or ".join(tiers)]
    if args.report:
        argv += ["--loom-report", str(Path(args.report).resolve())]
    if args.platform_class:
        argv += ["--loom-platform-class", args.platform_class]
    return argv + shlex.split(args.pytest_args)


def run(args: argparse.Namespace) -> int:
    import pytest  # lazy: optional dependency (loom plugins works without pytest; only check runs it)

    with tempfile.TemporaryDirectory(prefix="loom-plugins-check-") as workdir:
        return int(pytest.main(pytest_args(args, Path(workdir))))
