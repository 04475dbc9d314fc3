"""Streaming plumbing: an SSE response that always releases its request, and first-item prefetch."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .serving_engine import api_error_from

T = TypeVar("T")


class SSEResponse(StreamingResponse):
    """``text/event-stream`` whose ``on_close`` runs however the response ends.

    Starlette cancels the body when the client disconnects; ``on_close`` then closes the
    engine streams, which aborts their requests and frees their KV blocks, even when the
    body never started (a client gone before the first byte).
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[Any]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close()


class Prefetched(Generic[T]):
    """An async iterator whose first item was already fetched (see :func:`prefetch`)."""

    def __init__(self, first: T, rest: AsyncIterator[T]) -> None:
        self._first: list[T] = [first]
        self._rest = rest

    def __aiter__(self) -> Prefetched[T]:
        return self

    async def __anext__(self) -> T:
        if self._first:
            return self._first.pop()
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        await self._rest.aclose()  # type: ignore[attr-defined]


async def prefetch(iterator: AsyncIterator[T]) -> Prefetched[T]:
    """Fetch the first item now, so an engine rejection becomes an HTTP error, not a stream event."""
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        raise api_error_from(RuntimeError("the engine ended the request without output")) from None
    except Exception as e:
        await iterator.aclose()  # type: ignore[attr-defined]
        raise api_error_from(e) from e
    except BaseException:
        await iterator.aclose()  # type: ignore[attr-defined]
        raise
    return Prefetched(first, iterator)
