"""The FastAPI app of the OpenAI-compatible server, built on any :class:`EngineClient`.

``build_app`` adds the OpenAI routes, ``/health``, ``/version`` and ``/metrics``, the chat page at
``/`` (open: the page asks for the key), the API-key check on ``/v1/*``, the request-body size
limit, OpenAI-shaped error bodies for every failure, and finally the routes of the
``loom.endpoint_plugins`` group (each a ``(app) -> None``), once per app.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from loom_plugin_api import ENDPOINT_PLUGINS_GROUP, PluginError, load_plugins_strict
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from ... import __version__
from ...config.server import LoRAModulePath
from ...engine.client import EngineClient
from ...logger import init_logger
from ...metrics import ServerMetrics
from .chat_ui import chat_page
from .limits import BodySizeLimitMiddleware, RequestLimits
from .protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_engine import APIError, TokenizerThread
from .serving_models import OpenAIServingModels

logger = init_logger(__name__)

__all__ = ["apply_endpoint_plugins", "build_app"]


def build_app(
    engine_client: EngineClient,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    *,
    chat_template: str | None = None,
    endpoint_plugins: Mapping[str, Callable[[FastAPI], None]] | None = None,
    limits: RequestLimits | None = None,
    lora_modules: Sequence[LoRAModulePath] = (),
    chat_ui: bool = True,
) -> FastAPI:
    """The server's app. ``endpoint_plugins=None`` loads the ``loom.endpoint_plugins`` group;
    ``lora_modules`` are the adapters served from the start (each checked: a broken one is a ValueError);
    ``chat_ui=False`` (``--disable-chat-ui``) leaves ``/`` unrouted."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name is empty; give at least one name")
    limits = limits or RequestLimits()
    metrics = ServerMetrics(names[0])
    tokenizer_thread = TokenizerThread(engine_client.tokenizer)  # one for both endpoints
    model = engine_client.config.model_config.model
    models = OpenAIServingModels(engine_client.config, names, {model} - {None} - set(names))
    models.add_startup_adapters(lora_modules)
    completion = OpenAIServingCompletion(engine_client, names, metrics, limits=limits,
                                         tokenizer_thread=tokenizer_thread, models=models)
    chat = OpenAIServingChat(engine_client, names, metrics, chat_template, limits=limits,
                             tokenizer_thread=tokenizer_thread, models=models)
    app = FastAPI(title="loom", version=__version__)
    app.state.engine_client = engine_client
    app.state.metrics = metrics
    _add_error_handlers(app)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_responses(
        _GENERATION_ERRORS, stream=CompletionChunk))
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        return _respond(await _unless_disconnected(raw_request, completion.create_completion(request)))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_responses(
        _GENERATION_ERRORS, stream=ChatCompletionChunk))
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return _respond(await _unless_disconnected(raw_request, chat.create_chat_completion(request)))

    @app.get("/v1/models", responses=_responses({401: "the API key is missing or wrong"}))
    async def show_models() -> ModelList:
        # root is the served name: the model's (and an adapter's) path on the server's disk is not the client's
        return ModelList(data=models.model_cards())

    if models.runtime_updates:
        _add_lora_routes(app, models)

    health_errors = _responses({503: "a process of the serve is dead or not responding, or the engine is starting"})

    @app.head("/health", operation_id="health_head", responses=health_errors, response_class=Response)
    @app.get("/health", operation_id="health", responses=health_errors, response_class=Response)
    async def health() -> Response:
        dead = engine_client.dead_error
        if dead is not None:
            return APIError(dead, status=503, type="engine_dead_error").response()
        if not engine_client.is_ready:
            return APIError("the engine is starting", status=503, type="service_unavailable").response()
        return Response(status_code=200)

    ready_errors = _responses({503: "the engine takes no new requests: starting, draining or dead"})

    @app.head("/ready", operation_id="ready_head", responses=ready_errors, response_class=Response)
    @app.get("/ready", operation_id="ready", responses=ready_errors, response_class=Response)
    async def ready() -> Response:
        """200 only while the engine takes new requests: not while starting, draining or dead (a load
        balancer's readiness probe; ``/health`` is liveness)."""
        if engine_client.is_ready:
            return Response(status_code=200)
        why = engine_client.dead_error or ("the server is shutting down" if engine_client.stopping
                                           else "the engine is starting")
        return APIError(why, status=503, type="service_unavailable").response()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                          "description": "Prometheus metrics"}})
    async def show_metrics() -> Response:
        metrics.update_engine_stats(engine_client.get_stats())
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    if chat_ui:
        @app.get("/", include_in_schema=False, response_class=HTMLResponse)
        async def show_chat_page() -> HTMLResponse:
            return chat_page()

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, limit=limits.max_request_body_bytes)
    apply_endpoint_plugins(app, endpoint_plugins)
    return app


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """Loading and unloading adapters while serving (``LOOM_ALLOW_RUNTIME_LORA_UPDATING=1``)."""
    errors = _responses({400: "the adapter is broken, already loaded, or the server runs without --enable-lora",
                         401: "the API key is missing or wrong", 404: "no adapter of that name is loaded"})

    @app.post("/v1/load_lora_adapter", responses=errors, response_class=PlainTextResponse)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await models.load_lora_adapter(request.lora_name, request.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=errors, response_class=PlainTextResponse)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        models.unload_lora_adapter(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


def apply_endpoint_plugins(app: FastAPI, plugins: Mapping[str, Callable[[FastAPI], None]] | None = None) -> None:
    """Let each endpoint plugin add its routes; a plugin that fails, or shadows a route, stops start-up."""
    if plugins is None:
        plugins = load_plugins_strict(ENDPOINT_PLUGINS_GROUP, kind="endpoint")
    for name, add_routes in plugins.items():
        before = {_route_key(r) for r in app.router.routes}
        try:
            add_routes(app)
        except Exception as e:
            raise PluginError(
                f"endpoint plugin {name!r} ({getattr(add_routes, '__module__', '?')}."
                f"{getattr(add_routes, '__qualname__', add_routes)}) raised {type(e).__name__}: {e} "
                "while adding its routes"
            ) from e
        added = [_route_key(r) for r in app.router.routes[len(before):]]
        shadowed = [key for key in added if key in before]
        if shadowed:
            raise PluginError(f"endpoint plugin {name!r} adds routes that already exist: {shadowed}; "
                              "the first route wins, so the plugin's would never run")
        logger.info("Endpoint plugin %s added %s", name, ", ".join(f"{m} {p}" for p, m in added) or "no routes")


_GENERATION_ERRORS = {
    400: "the request is invalid or over a limit (the message names the field and the limit)",
    401: "the API key is missing or wrong",
    404: "the model named does not exist",
    413: "the request body is over --max-request-body-bytes",
    500: "the model step failed for this request (its own error; other requests are unaffected)",
    503: "the engine is starting, shutting down, dead, or not taking requests fast enough (Retry-After)",
}


def _responses(errors: Mapping[int, str], stream: type[BaseModel] | None = None) -> dict[int | str, Any]:
    """OpenAPI declarations of what a route answers besides its 200: OpenAI's error body for each
    status, and server-sent events of ``stream`` chunks when the request asks to stream."""
    out: dict[int | str, Any] = {status: {"model": ErrorResponse, "description": why} for status, why in errors.items()}
    if stream is not None:
        out[200] = {"description": f"JSON; or with stream=true, server-sent events: `data: <{stream.__name__}>` "
                                   "lines (an error event in OpenAI's error shape if one happens), then `data: [DONE]`",
                    "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
    return out


_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "one server-sent event (the fields of its lines); `data` is a chunk's JSON or `[DONE]`",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}},
    "required": ["data"],
}
"""The schema of each event of a stream (not of the whole body): what OpenAPI 3.2's ``itemSchema``
says for ``text/event-stream``, and what schemathesis checks every event of a streamed answer against."""


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without the 422 it adds to every route with a body: loom answers 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _respond(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return result


def _route_key(route: BaseRoute) -> tuple[str, str]:
    methods = getattr(route, "methods", None) or {"*"}
    return getattr(route, "path", repr(route)), ",".join(sorted(methods))


async def _unless_disconnected(request: Request, handler: Awaitable[Any]) -> Any:
    """Run a handler, cancelling it (and so aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    logger.info("Client disconnected before the response; its request was aborted")
    return Response(status_code=499)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        if "json" not in request.headers.get("content-type", ""):
            return APIError("the body must be JSON, sent with 'Content-Type: application/json'").response()
        parts, param, fields = [], None, set()
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            loc = _field_path(err.get("loc", ()))
            field = loc[0] if loc else "body"
            if field in fields:  # a union's other members failed too: their errors say nothing new
                continue
            fields.add(field)
            param = param or (field if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {str(err.get('msg')).removeprefix('Value error, ')}")
            if len(parts) == 5:
                break
        return APIError("; ".join(parts) or "invalid request", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(str(exc.detail), status=exc.status_code, type=kind).response()


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: Sequence[Any]) -> list[str]:
    """A validation error's location as the client wrote it: field names and list indices, without
    ``body`` and without the tags pydantic adds for union members (``str``, ``list[int]``, ...)."""
    path = []
    for part in loc:
        text = str(part)
        if part == "body" and not path or "[" in text or "(" in text or text in _TYPE_TAGS:
            continue
        path.append(text)
    return path


class _ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every ``/v1/*`` request (pure ASGI: streams stay untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")) and scope["method"] != "OPTIONS":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                response = APIError("Incorrect or missing API key; send it as 'Authorization: Bearer <key>'",
                                    status=401, code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
