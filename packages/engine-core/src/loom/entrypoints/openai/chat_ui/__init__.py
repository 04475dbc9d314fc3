"""The chat page ``loom serve`` shows at ``/``: ``index.html`` beside this module, one file with its
CSS and JavaScript inline, shipped as package data (no CDN, no build step: it works offline).

The page talks to the server's own ``/v1/models`` and ``/v1/chat/completions``; its
Content-Security-Policy lets it load nothing and connect nowhere else.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi.responses import HTMLResponse

__all__ = ["chat_page"]

_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@cache
def _html() -> str:
    """Read once per process."""
    return resources.files(__name__).joinpath("index.html").read_text(encoding="utf-8")


def chat_page() -> HTMLResponse:
    return HTMLResponse(_html(), headers=_HEADERS)
