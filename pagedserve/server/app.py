"""The FastAPI app: the routes of routes.py, errors in OpenAI's shape, the request-body limit,
and an OpenAPI document that lists the error responses (never FastAPI's 422)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from pagedserve.engine import LLMEngine
from pagedserve.server import routes
from pagedserve.server.async_engine import AsyncEngine
from pagedserve.server.config import ServerConfig
from pagedserve.server.disconnects import ClientDisconnected
from pagedserve.server.limits import BodyLimit
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import APIError, error_body, validation_error
from pagedserve.server.request_ids import RequestIdHeader
from pagedserve.server.serving import ServerContext

log = logging.getLogger("pagedserve.server")


def _version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


def build_app(config: ServerConfig, factory: Callable[[], LLMEngine] | None) -> FastAPI:
    """An app whose engine ``factory()`` builds in the engine loop's thread (or process)
    when the app starts (none: ``config.engine_pipes`` lead to an engine already started)."""
    metrics = ServerMetrics(lambda: engine.snapshot, lambda: ctx.model_names[0])
    engine = AsyncEngine(factory, config.max_queue, observer=metrics,
                         engine_process=config.engine_process,
                         engine_pipes=config.engine_pipes, server_index=config.server_index,
                         shared_queue=config.shared_queue)
    ctx = ServerContext(engine, config.served_model_names, config.api_keys, config.max_n,
                        config.max_prompts, config.tool_call_parser,
                        config.exclude_tools_when_tool_choice_none,
                        config.default_chat_template_kwargs,
                        config.trust_request_chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(engine.stop)
        ctx.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedserve", version=_version(), lifespan=lifespan)
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.include_router(routes.protected)
    app.include_router(routes.public)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes,
                       timeout=config.request_read_timeout)
    # Outermost (added last): a preflight is answered before a body is read, and the limit's
    # 413 and 408 carry CORS headers too, so that a page can read them.
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                       allow_credentials=config.allow_credentials,
                       allow_methods=config.allowed_methods, allow_headers=config.allowed_headers)
    if config.enable_request_id_headers:  # outermost: every response, a 413 and a 401 too
        app.add_middleware(RequestIdHeader)
    _add_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def request_validation(_: Request, e: RequestValidationError) -> Response:
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> Response:
        # The details go to the log, not to the client.
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        request_id = getattr(request.state, "request_id", None)  # --enable-request-id-headers
        return JSONResponse(error_body(500, "Internal server error (see the server log)."),
                            status_code=500,
                            headers={"X-Request-Id": request_id} if request_id else None)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, less the 422 it adds to every route with a body: this server
    answers validation errors with 400 in OpenAI's shape (listed per route)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
