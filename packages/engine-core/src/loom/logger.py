"""Logging set-up: one handler on the ``loom`` logger, level from ``LOOM_LOGGING_LEVEL``."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """Return a logger under ``loom`` and make sure loom's handler is installed."""
    _configure_root()
    return logging.getLogger(name if name.startswith("loom") else f"loom.{name}")


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger("loom")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(os.environ.get("LOOM_LOGGING_LEVEL", "INFO").upper())
    root.propagate = True
