"""``loom plugins new NAME --kind platform|model|general [--dir PATH]``: write a plugin package.

The skeleton is a setuptools project (``pip install ./NAME``) that depends on
``loom-plugin-api`` only; its templates are this package's data, under
``templates/<kind>/``: every ``*.tmpl`` file is written without the suffix, with
``{{dist}}``, ``{{package}}``, ``{{Prefix}}`` and ``{{PREFIX}}`` filled in, and the folder
``__package__`` renamed to the import name.
"""

from __future__ import annotations

import argparse
import keyword
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = ["KINDS", "PluginNames", "add_subcommand", "create", "plugin_names", "run"]

KINDS: dict[str, str] = {
    "platform": "a platform plugin: detector, Platform, worker, attention backend, a replaced op, communicator",
    "model": "a model plugin: a general plugin that registers an architecture (lazily)",
    "general": "a general plugin: register() runs once in every process",
}
_TEMPLATES = files("loom.entrypoints.cli") / "templates"
_SUFFIX = ".tmpl"
# PEP 508 distribution names: letters, digits, ".", "_", "-", starting and ending alphanumeric.
_DIST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


@dataclass(frozen=True, slots=True)
class PluginNames:
    dist: str
    """The distribution name (``pip install``, the folder)."""
    package: str
    """The import name; also the entry-point name (``LOOM_PLUGINS``, ``LOOM_PLATFORM``)."""
    prefix: str
    """CamelCase prefix of the generated classes."""

    def fill(self, text: str) -> str:
        return (text.replace("{{dist}}", self.dist).replace("{{package}}", self.package)
                .replace("{{Prefix}}", self.prefix).replace("{{PREFIX}}", self.prefix.upper()))


def plugin_names(name: str) -> PluginNames:
    """The names of a plugin called ``name``; a ValueError that says why when it cannot be one."""
    if not _DIST_NAME.match(name):
        raise ValueError(f"{name!r} is not a valid distribution name: use letters, digits, '-', '_' and '.', "
                         "starting and ending with a letter or digit (e.g. loom-platform-acme)")
    package = re.sub(r"[-.]+", "_", name).lower()
    if not package.isidentifier() or keyword.iskeyword(package):
        raise ValueError(f"{name!r} gives the import name {package!r}, which is not a Python identifier; "
                         "start the name with a letter (e.g. loom-platform-acme)")
    prefix = "".join(part[:1].upper() + part[1:] for part in package.split("_"))
    return PluginNames(dist=name, package=package, prefix=prefix)


def _render(source: Traversable, target: Path, names: PluginNames) -> list[Path]:
    written = []
    for entry in sorted(source.iterdir(), key=lambda e: e.name):
        if entry.name == "__pycache__":
            continue
        out_name = names.package if entry.name == "__package__" else entry.name.removesuffix(_SUFFIX)
        out = target / out_name
        if entry.is_dir():
            out.mkdir()
            written += _render(entry, out, names)
        elif entry.name.endswith(_SUFFIX):
            out.write_text(names.fill(entry.read_text(encoding="utf-8")), encoding="utf-8")
            written.append(out)
    return written


def create(name: str, kind: str, parent: Path) -> Path:
    """Write the ``kind`` skeleton of plugin ``name`` into ``parent / name``; return that folder."""
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; choose one of {', '.join(KINDS)}")
    names = plugin_names(name)
    target = parent / name
    if target.exists():
        raise ValueError(f"{target} already exists; choose another NAME or --dir, or remove it")
    if not parent.is_dir():
        raise ValueError(f"--dir {parent} is not a folder")
    target.mkdir()
    _render(_TEMPLATES / kind, target, names)
    return target


def add_subcommand(plugins_parser: argparse.ArgumentParser) -> None:
    """Give ``loom plugins`` its ``new`` subcommand (``args.plugins_command == "new"``), next to
    any subcommand it already has."""
    sub = next((a for a in plugins_parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        sub = plugins_parser.add_subparsers(dest="plugins_command", metavar="COMMAND")
    p = sub.add_parser("new", help="write the skeleton of a plugin package",
                       description="Write a plugin package that installs with `pip install ./NAME`.")
    p.add_argument("name", metavar="NAME", help="distribution name, e.g. loom-platform-acme")
    p.add_argument("--kind", required=True, choices=list(KINDS),
                   help="; ".join(f"{k}: {v}" for k, v in KINDS.items()))
    p.add_argument("--dir", default=".", metavar="PATH", help="folder to create NAME/ in (default: here)")


def run(args: argparse.Namespace) -> int:
    target = create(args.name, args.kind, Path(args.dir))
    names = plugin_names(args.name)
    print(f"Wrote the {args.kind} plugin {names.dist} (import name {names.package}) to {target}")
    print("Next:")
    shown = target if target.is_absolute() else f"./{target.as_posix()}"
    print(f"  pip install {shown}")
    print("  loom plugins")
    if args.kind == "platform":
        print(f"  pytest --pyargs loom_plugin_api.testing --loom-platform {names.package} "
              '-m "static or config or ops"')
        print(f"  LOOM_PLATFORM={names.package} loom serve MODEL")
    return 0
