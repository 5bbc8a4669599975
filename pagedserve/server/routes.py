"""The HTTP routes. Each reads the server's state from ``request.app.state.ctx``; request
bodies are the models of protocol.py, so /openapi.json describes them."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from pagedserve.server.beam_search import beam_search_group
from pagedserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from pagedserve.server.request_ids import base_request_id
from pagedserve.server.responses import new_meta, respond
from pagedserve.server.serving import (
    ServerContext,
    chat_prompt,
    completion_prompts,
    kept_prompt_tokens,
    submit,
    template_kwargs,
)


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
            408: "The body arrived too slowly", 413: "Request body too large",
            429: "Too many unfinished requests (--max-queue)", 500: "The request failed",
            503: "The model is loading or the engine is unavailable"}
    return {s: {"model": ErrorResponse, "description": text[s]} for s in statuses}


_BODY_ERRORS = (400, 408, 413, 500, 503)
GENERATION_ERRORS = _errors(*_BODY_ERRORS, 401, 404, 429)
TOKENIZER_ERRORS = _errors(*_BODY_ERRORS, 401, 404)


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


async def _auth(request: Request) -> None:
    # async: a plain def dependency would run in a worker thread, a hop per request.
    _ctx(request).check_api_key(request.headers.get("authorization", ""))


# /v1 and the tokenizer routes need the key when one is set; /health, /metrics and /version
# stay open for probes and scrapers, as in vLLM.
protected = APIRouter(dependencies=[Depends(_auth)])
public = APIRouter()


@protected.post("/v1/completions", responses=GENERATION_ERRORS)
async def completions(req: CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    eng = ctx.engine_info()
    model = ctx.check_model(req.model)
    base_id = base_request_id(request, req.request_id)
    prompts = await completion_prompts(ctx, req.prompt, req.add_special_tokens,
                                       kept_prompt_tokens(ctx, req.truncate_prompt_tokens,
                                                          req.max_tokens),
                                       req.truncation_side or "left")
    ids = [ids for ids, _ in prompts]
    group = await (beam_search_group(ctx, ids, req, request) if req.use_beam_search
                   else submit(ctx, ids, req, request, req.echo_only))
    echo = [""] * len(prompts)
    if req.echo:  # a text as sent; ids as decoded, special tokens kept (as vLLM echoes them)
        echo = [text if text is not None else await ctx.run(eng.tokenizer.decode, ids, False)
                for ids, text in prompts]
    wants = (req.logprobs is not None or req.prompt_logprobs is not None
             or bool(req.logprob_token_ids))
    formatter = ctx.logprobs(req.return_tokens_as_token_ids) if wants else None
    meta = new_meta("completion", base_id, model, req.n, echo, formatter)
    meta.echo_logprobs = req.logprobs if req.echo else None
    meta.prompt_logprobs, meta.token_ids = req.prompt_logprobs, bool(req.return_token_ids)
    if req.candidates > req.n:
        meta.best_of = req.candidates
    return await respond(meta, group, request, req.stream, req.include_usage,
                         req.continuous_usage)


@protected.post("/v1/chat/completions", responses=GENERATION_ERRORS)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    tokenizer = await ctx.chat_tokenizer(req)
    model = ctx.check_model(req.model)
    base_id = base_request_id(request, req.request_id)
    mode = req.tool_mode
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    # tool_choice "none": the tools still reach a template that reads them (vLLM's default,
    # unless --exclude-tools-when-tool-choice-none), but not the server's own tool prompt,
    # which asks for calls.
    if tools and not mode and (ctx.exclude_tools_when_tool_choice_none
                               or not tokenizer.template_takes_tools):
        tools = None
    # A template that reads no tools gets the server's own tool prompt, which asks for
    # Hermes tags: those are read back, whatever --tool-call-parser says.
    parser = ctx.tool_call_parser if mode and tokenizer.template_takes_tools else "hermes"
    if mode == "auto" and parser == "hermes":
        # Some models' <tool_call> tags are special tokens: kept in the text, or the calls
        # would be read as content (vLLM's Hermes parser sets this too).
        req.skip_special_tokens = False
    prompt = await chat_prompt(ctx, req.messages, req, tools,
                               kept_prompt_tokens(ctx, req.truncate_prompt_tokens,
                                                  req.max_completion_tokens or req.max_tokens),
                               req.truncation_side or "left", tokenizer)
    # A thinking model's answer (--reasoning-parser): its reasoning apart, and a grammar
    # after it, unless the prompt closed it or the reasoning is left out (vLLM's)
    reasoning, starts_thinking = ctx.engine_info().reasoning, False
    if reasoning is not None:
        starts_thinking = reasoning.opens_thinking(prompt, reasoning.thinking(
            template_kwargs(ctx, req)))
    group = await (beam_search_group(ctx, [prompt], req, request) if req.use_beam_search else
                   submit(ctx, [prompt], req, request, reasoning_ended=None if reasoning is None
                          else not (starts_thinking and req.include_reasoning)))
    # The answer's role (vLLM's): the last message's where no generation prompt opened an
    # assistant turn; echo shows the last message if it has that role.
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    echo = [last.text() if req.echo and last.role == role else ""]
    named = req.tool_choice.function.name if mode == "named" else None
    wants = req.logprobs or req.prompt_logprobs is not None
    formatter = ctx.logprobs(req.return_tokens_as_token_ids) if wants else None
    meta = new_meta("chat", base_id, model, req.n, echo, formatter, mode, named)
    meta.prompt_logprobs, meta.parallel_tool_calls = req.prompt_logprobs, req.parallel_tool_calls
    meta.tool_parser, meta.role = parser, role
    meta.reasoning, meta.include_reasoning = reasoning, req.include_reasoning
    # (a hidden thinking hides its ids too: vLLM's)
    meta.token_ids = bool(req.return_token_ids) and not meta.hides_thinking
    # (include_reasoning false under a constraint: the answer is constrained at once, and
    # is all content; vLLM reads it as thinking, and leaves the content null)
    meta.starts_thinking = starts_thinking and (req.include_reasoning
                                                or group.params.structured_outputs is None)
    return await respond(meta, group, request, req.stream, req.include_usage,
                         req.continuous_usage)


@protected.post("/invocations", responses=GENERATION_ERRORS, openapi_extra={"requestBody": {
    "required": True, "content": {"application/json": {"schema": {"anyOf": [
        {"$ref": "#/components/schemas/ChatCompletionRequest"},
        {"$ref": "#/components/schemas/CompletionRequest"}]}}}}})
async def invocations(request: Request) -> Response:
    """SageMaker's route (vLLM's too): a body with messages is a chat completion, one with
    a prompt a completion."""
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise APIError(400, "The body is not JSON.", code="invalid_value") from None
    kind = next((k for k in ("messages", "prompt") if isinstance(body, dict) and k in body),
                None)
    if kind is None:
        raise APIError(400, "The body needs messages (a chat) or a prompt (a completion).",
                       param="messages", code="invalid_value")
    model = ChatCompletionRequest if kind == "messages" else CompletionRequest
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    if isinstance(req, ChatCompletionRequest):
        return await chat_completions(req, request)
    return await completions(req, request)


@protected.get("/v1/models", responses=_errors(401, 503))
async def models(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    return {"object": "list", "data": [_model_card(ctx, name) for name in ctx.model_names]}


@protected.get("/v1/models/{model:path}", responses=_errors(401, 404, 503))
async def model(model: str, request: Request) -> dict[str, Any]:
    """OpenAI's retrieve (the SDK's ``models.retrieve``)."""
    ctx = _ctx(request)
    ctx.engine_info()  # 503 while loading, as /v1/models (the served names are the model's)
    return _model_card(ctx, ctx.check_model(model))


def _model_card(ctx: ServerContext, name: str) -> dict[str, Any]:
    eng = ctx.engine_info()
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
            "root": eng.model_name, "max_model_len": eng.max_model_len}


@protected.post("/tokenize", responses=TOKENIZER_ERRORS)
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    eng = ctx.engine_info()
    ctx.check_model(req.model)
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        tokens = await chat_prompt(ctx, req.messages, req, tools)
    elif req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ctx.check_prompt_chars(len(req.prompt))
        tokens = await ctx.run(eng.tokenizer.encode, req.prompt, add)
    else:
        raise APIError(400, "Either prompt or messages is required.", param="prompt",
                       code="invalid_value")
    out = {"count": len(tokens), "max_model_len": eng.max_model_len, "tokens": tokens}
    if req.return_token_strs:  # off the event loop, as all tokenizer work
        out["token_strs"] = await ctx.run(lambda: [eng.tokenizer.backend.id_to_token(t)
                                                   for t in tokens])
    return out


@protected.post("/detokenize", responses=TOKENIZER_ERRORS)
async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    eng = ctx.engine_info()
    ctx.check_model(req.model)
    vocab = max(eng.vocab_size, eng.tokenizer.vocab_size)  # any id the model can emit too
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"Token ids must be in [0, {vocab}).", param="tokens",
                       code="invalid_value")
    return {"prompt": await ctx.run(eng.tokenizer.decode, req.tokens, False)}


_NOT_READY = {503: {"description": "Loading, rebuilding or dead"}}


@public.get("/health", responses=_NOT_READY)
@public.get("/ping", responses=_NOT_READY, operation_id="ping_get")  # vLLM's (SageMaker's)
@public.post("/ping", responses=_NOT_READY, operation_id="ping_post")
async def health(request: Request) -> Response:
    engine = _ctx(request).engine
    if engine.ready:
        return JSONResponse({"status": "ok"})
    body: dict[str, Any] = {"status": engine.state}
    if engine.error:
        body["error"] = engine.error
    return JSONResponse(body, status_code=503)


@public.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@public.get("/version")
async def server_version(request: Request) -> dict[str, str]:
    return {"version": request.app.version}

