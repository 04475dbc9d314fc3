"""ServerConfig: the options of the HTTP server and of the serve's processes, declared once.

``loom serve`` and ``loom-supervisor serve`` parse them (``add_cli_args``); the launch plan
passes them to the front end as the same flags (``to_argv``), which the front end parses
with the same parser. The API key never travels on a command line: it reaches the front
end as ``LOOM_API_KEY`` in its environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _opt(default: Any, help: str | None = None, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass(slots=True, kw_only=True)
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to listen on (default 127.0.0.1)")
    port: int = _opt(8000, type=int)
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' on /v1/* (default: $LOOM_API_KEY)")
    startup_timeout: float = _opt(300.0, "seconds each start-up phase of each process may take", type=float)
    grace_period: float = _opt(10.0, "seconds in-flight requests get to finish on SIGINT/SIGTERM", type=float)
    chat_template: str | None = _opt(
        None, "chat template for /v1/chat/completions instead of the tokenizer's: the path of a "
              "Jinja file, or the template itself")
    stream_interval: int = _opt(
        1, "tokens per streamed event at least (default 1: every token); larger values send fewer, "
           "larger SSE events when many streams share a small machine", type=positive_int)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("server")
        for f in dataclasses.fields(cls):
            default = os.environ.get("LOOM_API_KEY") if f.name == "api_key" else f.default
            g.add_argument(f"--{f.name.replace('_', '-')}", default=default, **f.metadata)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def to_argv(self) -> list[str]:
        """The flags that give a parser of ``add_cli_args`` this config (the API key left out)."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "api_key" and value is not None:
                argv += [f"--{f.name.replace('_', '-')}", str(value)]
        return argv

    @property
    def ready_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"
