"""The FastAPI app: OpenAI-compatible routes, errors in OpenAI's shape, API-key check,
health, metrics, tokenize/detokenize, version."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from pagedserve.engine import LLMEngine
from pagedserve.server.async_engine import AsyncEngine
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    parse_body,
    validation_error,
)
from pagedserve.server.serving import (
    ClientDisconnected,
    ServerContext,
    chat_prompt,
    completion_prompts,
    new_meta,
    respond,
    submit,
)


@dataclass
class ServerConfig:
    served_model_names: list[str] | None = None
    api_key: str | None = None
    max_queue: int | None = None  # refuse (429) beyond this many unfinished requests


def _version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}",
                       code="invalid_json") from None


def build_app(config: ServerConfig, factory: Callable[[], LLMEngine]) -> FastAPI:
    """An app whose engine ``factory()`` builds in the loop thread when the app starts."""
    metrics = ServerMetrics(lambda: engine.snapshot, lambda: ctx.model_names[0])
    engine = AsyncEngine(factory, config.max_queue, observer=metrics)
    ctx = ServerContext(engine, config.served_model_names)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="pagedserve", version=_version(), lifespan=lifespan)
    app.state.ctx = ctx
    app.state.metrics = metrics

    # ---- errors ---------------------------------------------------------------------------
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
    async def internal(_: Request, e: Exception) -> Response:
        return JSONResponse(error_body(500, f"Internal server error: {type(e).__name__}: {e}"),
                            status_code=500)

    def auth(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, config.api_key.encode()):
            raise APIError(401, "Invalid or missing API key (send Authorization: Bearer KEY).",
                           code="invalid_api_key")

    protected = [Depends(auth)]  # the /v1 routes, as vLLM does

    # ---- generation -----------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await _json_body(request))
        eng = ctx.ready_engine()
        model = ctx.check_model(req.model)
        prompts = completion_prompts(eng, req.prompt)
        group = await submit(ctx, [ids for ids, _ in prompts], req)
        echo = [""] * len(prompts)
        if req.echo:
            echo = [text if text is not None else eng.tokenizer.decode(ids)
                    for ids, text in prompts]
        lp = ctx.logprobs() if req.logprobs is not None else None
        meta = new_meta("completion", model, req.n, echo, lp)
        return await respond(ctx, meta, group, request, req.stream, req.include_usage,
                             req.continuous_usage)

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await _json_body(request))
        eng = ctx.ready_engine()
        model = ctx.check_model(req.model)
        group = await submit(ctx, [chat_prompt(eng, req)], req)
        last = req.messages[-1]
        echo = [last.text() if req.echo and last.role == "assistant" else ""]
        meta = new_meta("chat", model, req.n, echo, ctx.logprobs() if req.logprobs else None)
        return await respond(ctx, meta, group, request, req.stream, req.include_usage,
                             req.continuous_usage)

    # ---- models, tokenizer ----------------------------------------------------------------
    @app.get("/v1/models", dependencies=protected)
    async def models() -> dict[str, Any]:
        eng = ctx.ready_engine()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()),
             "owned_by": "pagedserve", "root": eng.model_name,
             "max_model_len": eng.max_model_len}
            for name in ctx.model_names]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_body(TokenizeRequest, await _json_body(request))
        eng = ctx.ready_engine()
        ctx.check_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt)
            tokens = chat_prompt(eng, chat)
            if req.add_special_tokens and eng.tokenizer.add_bos and eng.tokenizer.bos_token_id:
                tokens = [eng.tokenizer.bos_token_id, *tokens]
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = eng.tokenizer.encode(req.prompt, add_special_tokens=add)
        else:
            raise APIError(400, "Either prompt or messages is required.", param="prompt",
                           code="invalid_value")
        return {"count": len(tokens), "max_model_len": eng.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, await _json_body(request))
        eng = ctx.ready_engine()
        ctx.check_model(req.model)
        vocab = eng.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"Token ids must be in [0, {vocab}).", param="tokens",
                           code="invalid_value")
        return {"prompt": eng.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    # ---- operations -----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if engine.ready:
            return JSONResponse({"status": "ok"})
        body: dict[str, Any] = {"status": engine.state}
        if engine.error:
            body["error"] = engine.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": _version()}

    return app
