"""Engine outputs to responses: a JSON body, or an SSE stream of text deltas, in the
shapes of OpenAI's completions and chat completions."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.engine import CompletionOutput, RequestOutput, TokenLogprob
from pagedserve.models.reasoning import ReasoningParser, ReasoningSplitter
from pagedserve.server.async_engine import ConstraintFailed, EngineDeadError, RequestFailed
from pagedserve.server.disconnects import unless_disconnected
from pagedserve.server.logprobs import LogprobFormatter
from pagedserve.server.protocol import APIError, error_body
from pagedserve.server.request_group import RequestGroup, final_outputs, merge_deltas
from pagedserve.server.tools import ToolCallReader, finish_reason, reader_for

log = logging.getLogger("pagedserve.server")


def failure(e: RequestFailed) -> APIError:
    code = "engine_dead" if isinstance(e, EngineDeadError) else \
        "invalid_value" if isinstance(e, ConstraintFailed) else "step_failed"
    return APIError(e.status, str(e), param=e.param, code=code)


@dataclass
class _Meta:
    kind: str  # "completion" | "chat"
    id: str
    model: str
    n: int
    echo: list[str]  # per prompt: text to put in front of each choice ("" for none)
    logprobs: LogprobFormatter | None  # None: logprobs off
    created: int = field(default_factory=lambda: int(time.time()))
    best_of: int | None = None  # completions: samples generated per prompt, when above n
    tool_mode: str | None = None  # chat with tools: "auto", "required" or "named"
    tool_name: str | None = None  # the named function
    tool_parser: str = "hermes"  # how auto reads calls (--tool-call-parser)
    parallel_tool_calls: bool = True
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top k per prompt token
    echo_logprobs: int | None = None  # completions echo + logprobs: the prompt's, top k
    # chat: the answer's role; vLLM's: the last message's where no generation prompt opened
    # an assistant turn (add_generation_prompt false)
    role: str = "assistant"
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's ids and each choice's
    # --reasoning-parser's: chat answers' thinking apart, as "reasoning" (include_reasoning
    # false: left out); whether the answers start in it (the prompt did not close it)
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True
    starts_thinking: bool = False

    def split(self, splitter: ReasoningSplitter | None, text: str, last: bool
              ) -> tuple[str, str]:
        """A chat answer's new (reasoning, content): all content without a parser."""
        if splitter is None:
            return "", text
        reasoning, content = splitter.feed(text)
        if last:
            more, more_content = splitter.finish()
            reasoning, content = reasoning + more, content + more_content
        return reasoning if self.include_reasoning else "", content

    def reasoning_tokens(self, output: list[int]) -> int:
        return self.reasoning.reasoning_tokens(output, self.starts_thinking)

    @property
    def hides_thinking(self) -> bool:
        """include_reasoning false: no thinking token shows, in logprobs either (vLLM's)."""
        return self.reasoning is not None and not self.include_reasoning

    def prompt_pieces(self, out: RequestOutput, p: int) -> tuple[dict[str, list] | None, Any]:
        """Prompt ``p``'s parts of its response, built once for all of its choices (n of
        them repeat them): the echoed prompt's logprobs, to go in front of each choice's
        (_with_head), and vLLM's prompt_logprobs; None where not asked for."""
        if out.prompt_logprobs is None or self.logprobs is None:
            return None, None
        head = vllm = None
        if self.echo_logprobs is not None:
            head = self.logprobs.legacy_prompt(out.prompt_token_ids, out.prompt_logprobs,
                                               self.echo_logprobs, self.echo[p])
        if self.prompt_logprobs is not None:
            vllm = self.logprobs.vllm_prompt(out.prompt_logprobs, self.prompt_logprobs)
        return head, vllm

    def tool_reader(self, echo: str = "") -> ToolCallReader | None:
        """A choice's reader; ``echo``: the echoed text its output goes on from (the
        whitespace where they join is kept)."""
        reader = reader_for(self.tool_mode, self.tool_name, self.tool_parser,
                            self.parallel_tool_calls)
        if reader is not None:
            reader.started = bool(echo.strip())
        return reader

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def new_meta(kind: str, base_id: str, model: str, n: int, echo: list[str],
             logprobs: LogprobFormatter | None, tool_mode: str | None = None,
             tool_name: str | None = None) -> _Meta:
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    return _Meta(kind, prefix + base_id, model, n, echo, logprobs,
                 tool_mode=tool_mode, tool_name=tool_name)


def usage(group: RequestGroup, completion_tokens: int, cached: int,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; the thinking's tokens where a reasoning parser counts them (vLLM's)."""
    prompt_tokens = sum(len(p) for p in group.prompts)
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def _with_head(head: dict[str, list] | None, lp: Any) -> Any:
    """A choice's legacy logprobs with the echoed prompt's in front."""
    if head is None or lp is None:
        return lp
    return {key: head[key] + lp[key] for key in head}


def _logprobs(meta: _Meta, lps: list[TokenLogprob] | None, offset: int) -> tuple[Any, int]:
    """Logprobs of a run of tokens in the endpoint's shape, and the next text offset."""
    if meta.logprobs is None or lps is None or meta.hides_thinking:
        return None, offset
    if meta.kind == "chat":
        return {"content": meta.logprobs.chat(lps)}, offset
    return meta.logprobs.legacy(lps, offset)


async def respond(meta: _Meta, group: RequestGroup, request: Request,
                  stream: bool, include_usage: bool, continuous_usage: bool) -> Response:
    if stream:
        events = _stream(meta, group, include_usage, continuous_usage)
        return SSEResponse(events, on_close=group.abort)
    outputs = await _collect(group, request)
    choices: list[bytes] = []  # each encoded, in pieces: the body is joined once
    reasoning_tokens = 0
    for p, out in enumerate(outputs):
        samples = out.outputs if meta.best_of is None else pick_best(out.outputs, meta.n)
        head, prompt_lp = meta.prompt_pieces(out, p)
        # vLLM repeats a prompt's prompt_logprobs in each of its choices (once in chat's
        # body): built and encoded once, then spliced in. Built and encoded per choice, on
        # the event loop, they held every client for 27 s (n=64, a 6,000-token prompt,
        # prompt_logprobs=20; a 541 MB body)
        shared = b"" if prompt_lp is None or meta.kind != "completion" \
            else b',"prompt_logprobs":' + _to_body_json(prompt_lp).encode()
        for o in samples:
            text = meta.echo[p] + o.text
            lp, _ = _logprobs(meta, o.logprobs, len(meta.echo[p]))
            lp = _with_head(head, lp)
            choice: dict[str, Any] = {"index": p * meta.n + o.index}
            reason = o.finish_reason
            if meta.kind == "chat":
                message = choice["message"] = {"role": meta.role, "content": text}
                answer = o.text
                if meta.reasoning is not None:  # (vLLM's: null for an empty part)
                    thought, answer = meta.split(meta.reasoning.splitter(meta.starts_thinking),
                                                 o.text, True)
                    message.update(content=meta.echo[p] + answer or None,
                                   reasoning=thought or None)
                    reasoning_tokens += meta.reasoning_tokens(o.token_ids)
                if (reader := meta.tool_reader(meta.echo[p])) is not None:  # (output's calls)
                    # What a stream shows: the echo as it is (vLLM's), then what the reader
                    # shows of the content
                    echo = meta.echo[p] if meta.echo[p].strip() else ""
                    content = echo + reader.feed(answer)[0] + reader.finish()[0]
                    choice["message"]["content"] = content or None
                    if reader.calls:
                        choice["message"]["tool_calls"] = reader.calls
                    reason = finish_reason(reader, reason)
            else:
                choice["text"] = text
            choice.update(logprobs=lp, finish_reason=reason, stop_reason=o.stop_reason)
            if meta.token_ids:  # (chat's prompt ids are the body's)
                choice.update({} if meta.kind == "chat" else {
                    "prompt_token_ids": group.prompts[p]}, token_ids=o.token_ids)
            choices += [b"," if choices else b"", _to_body_json(choice)[:-1].encode(), shared,
                        b"}"]
    opening = _to_body_json(meta.head("chat.completion" if meta.kind == "chat"
                                      else "text_completion"))[:-1]
    rest: dict[str, Any] = {}
    if meta.kind == "chat" and meta.prompt_logprobs is not None:
        rest["prompt_logprobs"] = meta.prompt_pieces(outputs[0], 0)[1]
    if meta.kind == "chat" and meta.token_ids:
        rest["prompt_token_ids"] = group.prompts[0]
    completion_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    rest["usage"] = usage(group, completion_tokens, sum(o.num_cached_tokens for o in outputs),
                          reasoning_tokens if meta.reasoning is not None else None)
    body = b"".join([opening.encode(), b',"choices":[', *choices, b"],",
                     _to_body_json(rest)[1:].encode()])
    return Response(body, media_type="application/json")


def pick_best(samples: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """best_of: the n samples of highest cumulative logprob, numbered 0..n-1 in that order."""
    ranked = sorted(samples, key=lambda o: -(o.cumulative_logprob or 0.0))
    return [dataclasses.replace(o, index=k) for k, o in enumerate(ranked[:n])]


async def _collect(group: RequestGroup, request: Request) -> list[RequestOutput]:
    """Final outputs in prompt order; aborts the group if the client goes away first."""
    try:
        return await unless_disconnected(final_outputs(group), request)
    except RequestFailed as e:
        raise failure(e) from None
    finally:
        group.abort()  # no-op once every request has finished


# One encoder for every chunk: json.dumps with an option builds a new one each call.
_to_json = json.JSONEncoder(ensure_ascii=False).encode
# A whole response's, compact as starlette's JSONResponse encodes
_to_body_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False,
                                 separators=(",", ":")).encode


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {_to_json(payload)}\n\n"


async def _stream(meta: _Meta, group: RequestGroup, include_usage: bool,
                  continuous_usage: bool) -> AsyncIterator[str]:
    chat = meta.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    offsets: dict[int, int] = {}  # per choice: text_offset of its next token (completions)
    held: dict[int, list[TokenLogprob]] = {}  # logprobs of tokens whose text is not out yet
    held_ids: dict[int, list[int]] = {}  # the same tokens' ids (return_token_ids)
    num_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    done: set[int] = set()
    readers: dict[int, ToolCallReader | None] = {}  # per choice, when tools are in play
    splitters: dict[int, ReasoningSplitter | None] = {}  # per choice, under a reasoning parser
    outputs: dict[int, list[int]] = {}  # per choice, its token ids (reasoning_tokens)
    heads: dict[int, dict[str, list] | None] = {}  # per prompt: the echoed prompt's logprobs
    pending_echo = {p * meta.n + k: text for p, text in enumerate(meta.echo) if text
                    for k in range(meta.n)}

    head = _to_json(meta.head(obj))[:-1]  # every chunk's first fields, encoded once

    def chunk(choice: dict[str, Any], tail: str = "") -> str:
        if continuous_usage:  # vLLM's: the choice's own prompt and tokens so far
            i = choice["index"]
            prompt, done_tokens = len(group.prompts[i // meta.n]), num_tokens.get(i, 0)
            tail += ', "usage": ' + _to_json({"prompt_tokens": prompt,
                                              "completion_tokens": done_tokens,
                                              "total_tokens": prompt + done_tokens})
        return f'data: {head}, "choices": [{_to_json(choice)}]{tail}}}\n\n'

    def chunks_of(p: int, out: RequestOutput) -> Iterator[str]:
        """The chunks of one delta of prompt ``p``'s request (none while held back)."""
        cached[p] = out.num_cached_tokens
        for o in out.outputs:
            i = p * meta.n + o.index
            if i in done or o.finish_reason == "abort":
                continue
            num_tokens[i] = num_tokens.get(i, 0) + len(o.token_ids)
            if o.logprobs is not None:
                held.setdefault(i, []).extend(o.logprobs)
            if meta.token_ids:
                held_ids.setdefault(i, []).extend(o.token_ids)
            if meta.reasoning is not None:
                outputs.setdefault(i, []).extend(o.token_ids)
            if not o.text and o.finish_reason is None and i not in pending_echo:
                continue
            echo = pending_echo.pop(i, "")
            reason = o.finish_reason
            first = i not in readers  # (the choice's first chunk, the one with its echo)
            if first:
                readers[i] = meta.tool_reader(echo) if chat else None
                splitters[i] = meta.reasoning and meta.reasoning.splitter(meta.starts_thinking)
            thought, answer = meta.split(splitters[i], o.text, reason is not None) if chat \
                else ("", o.text)
            text = echo + answer
            delta: dict[str, Any] = {"content": text} if text else {}
            reader = readers[i]
            if reader is not None:  # (calls in the output only: the echo is content)
                delta, reason = _tool_delta(reader, answer, reason)
                if echo.strip():
                    delta["content"] = echo + delta.get("content", "")
            if thought:
                delta = {"reasoning": thought, **delta}
            if chat and not delta and reason is None:
                continue  # held back (a tag may be opening): nothing to send yet
            offset = offsets.get(i, len(meta.echo[p]))  # text_offset counts the echo
            lp, offsets[i] = _logprobs(meta, held.pop(i, None), offset)
            if echo:  # the first chunk of an echoed choice: the prompt's logprobs too
                if heads.get(p) is None:  # built once for the prompt's choices
                    heads[p] = meta.prompt_pieces(out, p)[0]
                lp = _with_head(heads[p], lp)
            choice: dict[str, Any] = {"index": i}
            if chat:
                choice["delta"] = delta
            else:
                choice["text"] = text
            choice.update(logprobs=lp, finish_reason=reason)
            if meta.token_ids:  # vLLM's: a choice's first chunk has its prompt's (completions)
                choice.update({"prompt_token_ids": group.prompts[p]} if first and not chat
                              else {}, token_ids=held_ids.pop(i, []))
            if reason is not None and "tool_calls" in delta:
                # The calls, then the finish alone, as OpenAI sends it: the SDK's stream
                # helper reads a finish before the calls beside it, and never closes them.
                yield chunk({**choice, "finish_reason": None})
                choice = {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
            if o.finish_reason is not None:
                choice["stop_reason"] = o.stop_reason  # vLLM's, with the finish reason
                done.add(i)
            yield chunk(choice)

    try:
        if chat:  # each choice opens with its role (vLLM's: and the prompt's ids)
            ids = f', "prompt_token_ids": {_to_json(group.prompts[0])}' if meta.token_ids else ""
            for i in range(len(group.prompts) * meta.n):
                yield chunk({"index": i, "delta": {"role": meta.role, "content": ""},
                             "logprobs": None, "finish_reason": None}, ids)
        async for batch in group.batches():
            # What piled up while the stream was away: one chunk per choice, written in one
            # piece.
            parts = [c for p, out in merge_deltas(batch) for c in chunks_of(p, out)]
            if parts:
                yield "".join(parts)
        if include_usage:
            body = meta.head(obj)
            body["choices"] = []
            body["usage"] = usage(group, sum(num_tokens.values()), sum(cached.values()),
                                  None if meta.reasoning is None else sum(
                                      map(meta.reasoning_tokens, outputs.values())))
            yield _sse(body)
    except RequestFailed as e:
        yield _sse(failure(e).body())
    except Exception:  # a bug here: the details go to the log, the stream ends in order
        log.exception("a stream's chunks failed")
        yield _sse(error_body(500, "Internal server error (see the server log)."))
    yield "data: [DONE]\n\n"


def _tool_delta(reader: ToolCallReader, text: str, reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
    """A chunk's delta (content and/or tool_calls) from the reader, and its finish reason."""
    content, entries = reader.feed(text)
    if reason is not None:
        more, last = reader.finish()
        content, entries = content + more, entries + last
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if entries:
        delta["tool_calls"] = entries
    return delta, finish_reason(reader, reason)


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that runs ``on_close`` however it ends (finished, client
    gone, server shutting down), so a disconnect aborts the request at once."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
