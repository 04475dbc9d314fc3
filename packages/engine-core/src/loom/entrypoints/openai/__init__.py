"""The OpenAI-compatible HTTP front end: ``build_app(engine_client, ...)`` and ``serve_http(app, ...)``."""

from __future__ import annotations

from .api_server import build_app
from .run import serve_http

__all__ = ["build_app", "serve_http"]
