"""Completions and chat completions, requests in: the server's context (engine, names, key,
limits), and prompts checked, tokenized and submitted as engine request groups. Their
responses are built in responses.py."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request

from pagedserve.engine import InvalidRequest, PromptTooLong, SamplingParams
from pagedserve.models.chat_template import TEMPLATE_VARIABLES
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReady,
)
from pagedserve.server.chat_messages import ChatMessage, template_messages
from pagedserve.server.disconnects import unless_disconnected
from pagedserve.server.engine_messages import EngineInfo
from pagedserve.server.logprobs import LogprobFormatter, TokenIdFormatter
from pagedserve.server.protocol import APIError, RequestLimits
from pagedserve.server.queue_limit import QueueFull
from pagedserve.server.request_group import RequestGroup

T = TypeVar("T")
log = logging.getLogger("pagedserve.server")


@dataclass
class ServerContext:
    engine: AsyncEngine
    # ServerConfig's fields of these names (their defaults are there)
    served_model_names: list[str] | None
    api_keys: list[str] | None
    max_n: int
    max_prompts: int
    tool_call_parser: str
    exclude_tools_when_tool_choice_none: bool
    default_chat_template_kwargs: dict[str, Any] | None
    trust_request_chat_template: bool = False
    # Tokenizing, detokenizing and rendering templates run here, off the event loop (the
    # tokenizer releases the GIL), so that no request's prompt can stall the others.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="pagedserve-tok"))
    formatter: LogprobFormatter | None = field(default=None, repr=False)
    # Copies of the tokenizer with a request's own template, compiled once a template
    templated: OrderedDict[str, Tokenizer] = field(default_factory=OrderedDict, repr=False)

    @property
    def model_names(self) -> list[str]:
        if self.served_model_names:
            return self.served_model_names
        info = self.engine.info
        return [info.model_name] if info else ["unknown"]

    def engine_info(self) -> EngineInfo:
        """What the HTTP side reads of the loaded engine (tokenizer, max_model_len)."""
        eng = self.engine
        if eng.state == "dead":
            raise APIError(503, f"The engine has died: {eng.error}", code="engine_dead")
        if eng.state == "rebuilding":
            raise APIError(503, "The engine is rebuilding after a failure; retry shortly.",
                           code="engine_rebuilding", headers={"Retry-After": "1"})
        if not eng.ready or eng.info is None:
            raise APIError(503, "The model is still loading; retry shortly.",
                           code="model_loading", headers={"Retry-After": "5"})
        return eng.info

    def check_api_key(self, authorization: str) -> None:
        if not self.api_keys:
            return
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        # Every key compared, so that the time taken tells nothing of which one nearly matched.
        matches = [hmac.compare_digest(given, key.encode()) for key in self.api_keys]
        if not any(matches):
            raise APIError(401, "Invalid or missing API key (send Authorization: Bearer KEY).",
                           code="invalid_api_key")

    def check_model(self, name: str | None) -> str:
        """The name to answer with: the requested one, or the first served name."""
        names = self.model_names
        if name is not None and name not in names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")
        return name or names[0]

    def max_prompt_chars(self) -> int:
        """No token spells more than ``max_chars_per_token`` characters, so a longer text
        must tokenize past the context: refused before paying to tokenize it."""
        eng = self.engine_info()
        return eng.max_model_len * eng.tokenizer.max_chars_per_token

    def check_prompt_chars(self, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars():
            raise self.prompt_too_long(num_chars)

    def prompt_too_long(self, num_chars: int) -> APIError:
        eng = self.engine_info()
        return APIError(
            400, f"This model's maximum context length is {eng.max_model_len} tokens, but the "
            f"prompt has {num_chars} characters: more than that many tokens can hold (at most "
            f"{eng.tokenizer.max_chars_per_token} characters each).", param="prompt",
            code="context_length_exceeded")

    def limits(self) -> RequestLimits:
        info = self.engine_info()
        return RequestLimits(info.vocab_size, self.max_n, info.sampling_defaults,
                             info.max_model_len)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def chat_tokenizer(self, how: ChatRendering) -> Tokenizer:
        """The tokenizer a chat renders with: the engine's, or, under
        --trust-request-chat-template, a copy with the request's own template (its
        chat_template, or chat_template_kwargs' "chat_template", as vLLM reads both)."""
        tok = self.engine_info().tokenizer
        template = how.chat_template
        if template is None:
            template = (how.chat_template_kwargs or {}).get("chat_template")
        if template is None:
            return tok
        if not self.trust_request_chat_template:  # (vLLM's words)
            raise APIError(400, "Chat template is passed with request, but "
                           "--trust-request-chat-template is not set. Refused request with "
                           "untrusted chat template.", param="chat_template",
                           code="invalid_value")
        if not isinstance(template, str):
            raise APIError(400, "chat_template must be a string", param="chat_template",
                           code="invalid_value")
        if (copy_ := self.templated.get(template)) is None:
            copy_ = copy.copy(tok)
            try:  # (compiling is template work: off the event loop)
                await self.run(copy_.set_chat_template, template)
            except ValueError as e:
                raise APIError(400, str(e), param="chat_template",
                               code="invalid_value") from None
            self.templated[template] = copy_
            if len(self.templated) > TEMPLATES_KEPT:
                self.templated.popitem(last=False)
        self.templated.move_to_end(template)
        return copy_

    def logprobs(self, as_token_ids: bool = False) -> LogprobFormatter:
        if as_token_ids:  # vLLM's return_tokens_as_token_ids (a formatter with no cache)
            return TokenIdFormatter(self.engine_info().tokenizer)
        if self.formatter is None:
            self.formatter = LogprobFormatter(self.engine_info().tokenizer)
        return self.formatter


TEMPLATES_KEPT = 8  # requests' own chat templates kept compiled


def invalid_request(e: InvalidRequest) -> APIError:
    return APIError(400, str(e), param=e.param, code=e.code)


# vLLM's header: a request's priority, in place of its body's
PRIORITY_HEADER = "X-Vllm-Priority"


async def submit(ctx: ServerContext, prompts: list[list[int]], request: Any,
                 http: Request | None = None, echo_only: bool = False,
                 reasoning_ended: bool | None = None) -> RequestGroup:
    """Engine requests for ``prompts``, with every refusal turned into an APIError.
    ``http``: the HTTP request, whose client going away during a compile ends it, and whose
    PRIORITY_HEADER, an integer, is the request's priority;
    ``echo_only``: completions' echo of the prompts alone (max_tokens 0);
    ``reasoning_ended``: SamplingParams', the chat's reading of its prompt."""
    log_ignored_fields(request)
    try:
        params = request.to_params(ctx.limits())
        if reasoning_ended is not None:
            params.reasoning_ended = reasoning_ended
        take_priority_header(params, http)
        added = ctx.engine.submit(prompts, params, echo_only)
        if params.structured_outputs is not None and http is not None:
            # The engine loop adds it once its constraint has compiled (on the compile
            # threads; a bad one is its 400): a client gone meanwhile aborts it, and its
            # compile with it.
            added = unless_disconnected(added, http)
        return await added
    except InvalidRequest as e:
        raise refusal(e, request) from None
    except (QueueFull, EngineNotReady, EngineDeadError) as e:
        raise engine_refusal(e) from None


def log_ignored_fields(request: Any) -> None:
    """As vLLM: fields no one knows are dropped, and said where the operator sees it."""
    if extra := request.model_extra:
        names = [repr(name[:40]) for name in sorted(extra)[:10]]  # (the client's text)
        log.warning("fields ignored in a request: %s%s", ", ".join(names),
                    f" and {len(extra) - 10} more" if len(extra) > 10 else "")


def refusal(e: InvalidRequest, request: Any) -> APIError:
    """A request's 400, naming the field the client sent."""
    if e.param == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
        e.param = "max_completion_tokens"  # (chat)
    return invalid_request(e)


def take_priority_header(params: SamplingParams, http: Request | None) -> None:
    if http is not None and (header := http.headers.get(PRIORITY_HEADER)) is not None:
        with contextlib.suppress(ValueError):  # (a header no integer is unused: vLLM's)
            params.priority = int(header)


def engine_refusal(e: QueueFull | EngineNotReady | EngineDeadError) -> APIError:
    """The answer to a request the engine cannot take now."""
    if isinstance(e, QueueFull):
        return APIError(429, f"Too many requests in the queue: {e}",
                        code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(e, EngineNotReady):
        return APIError(503, str(e), code="model_loading", headers={"Retry-After": "5"})
    return APIError(503, str(e), code="engine_dead")


# ---- prompts ----------------------------------------------------------------------------------
def kept_prompt_tokens(ctx: ServerContext, truncate: int | None, max_tokens: int | None
                       ) -> int | None:
    """vLLM's truncate_prompt_tokens: how many of a prompt's last tokens to keep (-1: as many
    as the context holds beside the request's max_tokens, or one token); None: all."""
    if truncate is None:
        return None
    limit = ctx.engine_info().max_model_len
    if truncate == -1:
        truncate = limit - (max_tokens or 1)
    elif not 1 <= truncate <= limit:
        raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, {limit}]",
                       param="truncate_prompt_tokens", code="invalid_value")
    if truncate < 1:
        raise APIError(400, f"max_tokens {max_tokens} leaves no room for a prompt in the "
                       f"context of {limit} tokens", param="max_tokens", code="invalid_value")
    return truncate


async def completion_prompts(ctx: ServerContext, prompt: Any, add_special_tokens: bool = True,
                             keep: int | None = None, side: str = "left"
                             ) -> list[tuple[list[int], str | None]]:
    """A string, list of strings, token ids, or list of token-id lists -> (token ids, text)
    per prompt; text is None for a prompt given as token ids, or cut to its last ``keep``
    tokens."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif not prompt:
        raise APIError(400, "The prompt must not be empty.", param="prompt", code="invalid_value")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if len(items) > ctx.max_prompts:
        raise APIError(400, f"A request may carry at most {ctx.max_prompts} prompts "
                       f"(--max-prompts); this one has {len(items)}.", param="prompt",
                       code="invalid_value")
    texts = [p for p in items if isinstance(p, str)]
    for text in texts:
        if keep is None:  # (a prompt to be cut may be longer: the body limit bounds it)
            ctx.check_prompt_chars(len(text))
    tok = ctx.engine_info().tokenizer
    encoded = iter(await ctx.run(lambda: [tok.encode(t, add_special_tokens) for t in texts])
                   if texts else [])
    # Token ids go to the engine as they are: add_request copies them and checks the length
    # before anything that scans them.
    prompts = [(next(encoded), p) if isinstance(p, str) else (p, None) for p in items]
    if keep is None:
        return prompts
    # Left: a text keeps its BOS (as vLLM cuts one); token ids are cut as they are. Right
    # (vLLM's truncation_side): the first tokens kept.
    return [(ids, text) if len(ids) <= keep else
            (ids[:keep] if side == "right" else ids[-keep:] if text is None
             else tok.keep_last(ids, keep, add_special_tokens), None)
            for ids, text in prompts]


class ChatRendering(Protocol):
    """What a request says of its chat template's rendering (chat and /tokenize alike)."""

    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] | None
    chat_template: str | None  # its own, used under --trust-request-chat-template
    add_special_tokens: bool | None  # the tokenizer's BOS in front of the rendered text


def template_kwargs(ctx: ServerContext, how: ChatRendering) -> dict[str, Any]:
    """The template's own variables: chat_template_kwargs, and vLLM's documents and
    reasoning_effort (a chat's; the effort "none" asks for no thinking, as in vLLM), over
    --default-chat-template-kwargs'."""
    passed = {k: v for k in ("documents", "reasoning_effort")
              if (v := getattr(how, k, None)) is not None}
    own = {k: v for k, v in (how.chat_template_kwargs or {}).items() if k != "chat_template"}
    if "reasoning_effort" in passed and "enable_thinking" not in own:
        passed["enable_thinking"] = passed["reasoning_effort"] != "none"
    return {**(ctx.default_chat_template_kwargs or {}), **passed, **own}


async def chat_prompt(ctx: ServerContext, messages: list[ChatMessage], how: ChatRendering,
                      tools: list[dict[str, Any]] | None = None, keep: int | None = None,
                      side: str = "left", tok: Tokenizer | None = None) -> list[int]:
    """The rendered conversation's token ids (``keep`` of them where given: the last, or the
    first where ``side`` is "right"); ``tok``: ctx.chat_tokenizer(how), where already had."""
    if how.continue_final_message and how.add_generation_prompt:  # vLLM's 400 too
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be "
                       "true", param="continue_final_message", code="invalid_value")
    kwargs = template_kwargs(ctx, how)
    if taken := TEMPLATE_VARIABLES & set(kwargs):
        raise APIError(400, f"chat_template_kwargs may not set {sorted(taken)}",
                       param="chat_template_kwargs", code="invalid_value")
    tok = tok or await ctx.chat_tokenizer(how)
    max_chars = ctx.max_prompt_chars() if keep is None else None
    try:
        ids = await ctx.run(lambda: tok.encode_chat(
            template_messages(messages), how.add_generation_prompt, max_chars=max_chars,
            tools=tools, continue_final_message=how.continue_final_message,
            chat_template_kwargs=kwargs))
    except PromptTooLong as e:
        raise ctx.prompt_too_long(e.num_chars) from None
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    if how.add_special_tokens and tok.add_bos and tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]
    return ids if keep is None else ids[:keep] if side == "right" else ids[-keep:]

