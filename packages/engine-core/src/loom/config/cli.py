"""Command-line flags declared on config dataclasses: each default is written once, on its field."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

_CLI = "cli"
"""Metadata key of a field that has a flag: what :func:`flag` was given besides the default."""


def flag(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
         flag: str | None = None, aliases: tuple[str, ...] = (),
         choices: list[str] | Callable[[], list[str]] | None = None, **options: Any) -> Any:
    """A dataclass field with a command-line flag; the field's default is the flag's.

    ``flag`` defaults to ``--field-name``; ``aliases`` are further option strings (``-tp``);
    ``choices`` may be a callable, called each time a parser is built (after the general
    plugins ran, so that they can add choices); ``options`` (``help``, ``type``, ``action``)
    go to ``add_argument`` as they are.
    """
    cli = {"flag": flag, "aliases": aliases, **options}
    if choices is not None:  # store_true and store_false actions take no choices
        cli["choices"] = choices
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_CLI: cli})


def add_flags(group: argparse._ArgumentGroup, cls: type) -> None:
    """One argument per field of ``cls`` made with :func:`flag`, in field order."""
    for f in dataclasses.fields(cls):
        cli = f.metadata.get(_CLI)
        if cli is None:
            continue  # a field without a flag
        options = dict(cli)
        name = options.pop("flag") or "--" + f.name.replace("_", "-")
        aliases = options.pop("aliases")
        if callable(options.get("choices")):
            options["choices"] = options["choices"]()  # now: the general plugins may have added some
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        group.add_argument(name, *aliases, dest=f.name, default=default, **options)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """``cls`` from the parsed flags: its fields that the namespace has."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})
