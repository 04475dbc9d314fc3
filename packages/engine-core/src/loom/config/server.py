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
from dataclasses import dataclass

from .cli import add_flags, flag, from_args


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _heartbeat_timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value != 0 and not 3 <= value < float("inf"):  # children beat every second
        raise argparse.ArgumentTypeError(f"expected 0 (off) or at least 3 seconds, got {text}")
    return value


def _api_key_file(path: str) -> str:
    try:
        with open(os.path.expanduser(path)) as f:
            key = f.readline().strip()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read the API key from {path!r}: {e.strerror or e}") from None
    if not key:
        raise argparse.ArgumentTypeError(f"{path!r} is empty; its first line must be the API key")
    return path


SERVE_START_ENV = "LOOM_SERVE_START_NS"
"""When ``loom serve`` started (``time.time_ns()``), in every child's environment: the front end's
ready line says how long start-up took."""


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: an adapter's name and its PEFT directory."""

    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModulePath:
    """``NAME=PATH``; a ValueError says what the form is."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"expected NAME=PATH (an adapter's name and its PEFT directory), got {text!r}")
    return LoRAModulePath(name.strip(), path.strip())


def _lora_module(text: str) -> str:
    try:
        parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@dataclass(slots=True, kw_only=True)
class ServerConfig:
    host: str = flag("127.0.0.1", help="address to listen on (default 127.0.0.1)")
    port: int = flag(8000, type=int)
    api_key: str | None = flag(default_factory=lambda: os.environ.get("LOOM_API_KEY"),
                               help="require 'Authorization: Bearer KEY' on /v1/* (default: $LOOM_API_KEY); "
                                    "visible in ps: prefer --api-key-file or LOOM_API_KEY")
    api_key_file: str | None = flag(None, type=_api_key_file, help="read the API key from this file (its first "
                                                                    "line), so it stays out of ps")
    startup_timeout: float = flag(300.0, type=float, help="seconds each start-up phase of each process may take")
    grace_period: float = flag(10.0, type=float, help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    step_timeout: float = flag(600.0, type=float,
                               help="seconds one model step may take; a longer one (a worker stuck in a kernel) "
                                    "stops the serve with a report (default 600; 0: no limit)")
    heartbeat_timeout: float = flag(10.0, type=_heartbeat_timeout,
                                    help="a process silent this many seconds once serving (stopped, frozen) is "
                                         "reported like a death and the serve stops (default 10; 0: not watched)")
    chat_template: str | None = flag(
        None, help="chat template for /v1/chat/completions instead of the tokenizer's: the path of a "
                   "Jinja file, or the template itself")
    max_n: int = flag(128, type=positive_int, help="completions one request may ask for: n times its prompts "
                                                  "(default 128)")
    max_request_body_bytes: int = flag(8 * 2**20, type=positive_int,
                                       help="largest request body in bytes; larger ones get 413 (default 8 MiB)")
    stream_interval: int = flag(
        1, type=positive_int, help="tokens per streamed event at least, after the first token, which goes out "
                                   "at once (default 1: every token); larger values send fewer, larger SSE "
                                   "events when many streams share a small machine")

    disable_chat_ui: bool = flag(False, action="store_true",
                                 help="do not serve the chat page at / (the API is the same either way)")

    lora_modules: list[str] = flag(
        default_factory=list, type=_lora_module, action="extend", nargs="+", metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served from the start, by name: a request's model names one "
             "(needs --enable-lora)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_flags(parser.add_argument_group("server"), cls)
        return parser

    def __post_init__(self) -> None:
        if self.api_key_file is not None:  # the key itself travels in the front end's environment
            with open(os.path.expanduser(self.api_key_file)) as f:
                self.api_key = f.readline().strip()
            self.api_key_file = None

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerConfig:
        return from_args(cls, args)

    def to_argv(self) -> list[str]:
        """The flags that give a parser of ``add_cli_args`` this config (the API key left out)."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "api_key" or value is None or value is False:
                continue
            if value is True:  # a store_true flag takes no value
                argv.append(f"--{f.name.replace('_', '-')}")
                continue
            for item in value if isinstance(value, list) else [value]:
                argv.append(f"--{f.name.replace('_', '-')}={item}")  # one word: a value may start with "-"
        return argv

    @property
    def ready_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"
