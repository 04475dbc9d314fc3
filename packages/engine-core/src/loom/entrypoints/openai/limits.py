"""The limits a request must stay within, checked before any work is done for it.

A request over a limit gets a 400 (413 for the body size) naming the field and the limit:
one client must never make the server loop, grow without bound, or fail a step that other
clients' requests share. The limits that depend on the model (vocabulary size,
``max_model_len``) are checked in :mod:`.serving_engine`; the ones here are the server's.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodySizeLimitMiddleware", "RequestLimits"]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_n: int = 128
    """Completions one request may ask for: ``n`` times the number of prompts (``--max-n``)."""
    max_request_body_bytes: int = 8 * 2**20
    """Bytes of a request body (``--max-request-body-bytes``); over it: 413."""
    max_stop: int = 64
    """Entries of ``stop`` and of ``stop_token_ids``, each."""
    max_stop_chars: int = 1024
    """Characters of one stop string."""


class BodySizeLimitMiddleware:
    """413 for a body over ``limit`` bytes: refused from ``Content-Length`` before it is read, or
    as soon as a chunked body passes the limit (pure ASGI: responses stream untouched)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            error = {"message": self._message(f"declares {declared} bytes"), "type": "invalid_request_error",
                     "param": None, "code": 413}  # OpenAI's error shape, as APIError writes it
            await JSONResponse({"error": error}, status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI lets an HTTPException from reading the body through to the error handler.
                    raise HTTPException(413, self._message(f"has more than {self.limit} bytes"))
            return message

        await self.app(scope, limited, send)

    def _message(self, what: str) -> str:
        return (f"the request body {what}; the limit is {self.limit} bytes (--max-request-body-bytes). "
                "Send a shorter prompt or fewer prompts per request")
