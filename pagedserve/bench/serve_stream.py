"""One streamed request of `bench serve`: its body, and its timing read off the SSE stream.

A request succeeds only on HTTP 200 with an SSE stream that carries at least one content
chunk (vLLM's rule: without one there is no TTFT to measure). Whatever the server sends, a
bad response fails that request alone, never the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.bench.workloads import BenchRequest

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
NO_CHUNK = "Never received a valid chunk to calculate TTFT"  # vLLM's words


@dataclass
class RequestResult:
    ok: bool
    e2e: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_missing: bool = False
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class BadChunk(ValueError):
    """A stream event that is not an OpenAI-shaped chunk."""


def request_body(req: BenchRequest, endpoint: str, model: str, temperature: float,
                 ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": req.output_len, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def parse_chunk(data: str) -> dict[str, Any]:
    """The JSON object of one ``data:`` event: one with ``choices`` (a list of objects),
    ``usage`` or ``error``; BadChunk otherwise."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise BadChunk(f"malformed stream chunk (not JSON): {data[:100]!r}") from None
    if not isinstance(chunk, dict) or not {"choices", "usage", "error"} & chunk.keys():
        raise BadChunk(f"malformed stream chunk (no choices, usage or error): {data[:100]}")
    choices = chunk.get("choices")
    if choices is not None and not (
            isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        raise BadChunk(f"malformed stream chunk (choices not a list of objects): {data[:100]}")
    if chunk.get("usage") is not None and not isinstance(chunk["usage"], dict):
        raise BadChunk(f"malformed stream chunk (usage not an object): {data[:100]}")
    return chunk


def content(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        if not isinstance(delta, dict):
            return ""
        parts = (delta.get("content"), delta.get("reasoning_content"))
    else:
        parts = (choices[0].get("text"),)
    return "".join(p for p in parts if isinstance(p, str))


async def send(client: Any, path: str, body: dict[str, Any], endpoint: str) -> RequestResult:
    import httpx

    start = last = time.perf_counter()
    result = RequestResult(ok=False)
    usage: dict[str, Any] | None = None
    chunks = events = 0
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                events += 1
                data = line[5:].strip()
                if data == "[DONE]":
                    # Not break: read on to the body's end (nothing but the chunked
                    # encoding's last chunk), or httpx closes the connection rather than
                    # keep it alive, and every request pays a new one (the openai SDK
                    # reads on too).
                    continue
                chunk = parse_chunk(data)
                if chunk.get("error"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return result
                usage = chunk.get("usage") or usage
                if content(chunk, endpoint):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
            if not events:
                kind = resp.headers.get("content-type", "none")
                result.error = f"HTTP 200 but not an SSE stream (content-type: {kind})"
                return result
    except BadChunk as e:
        result.error = str(e)[:200]
        return result
    except (httpx.HTTPError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    if result.ttft is None:
        result.error = NO_CHUNK
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    tokens = (usage or {}).get("completion_tokens")
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        result.output_tokens = tokens
        prompt_tokens = usage.get("prompt_tokens") if usage else None
        result.prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else None
    else:
        result.output_tokens, result.usage_missing = chunks, True
    return result


async def send_within(client: Any, path: str, body: dict[str, Any], endpoint: str,
                      timeout: float | None) -> RequestResult:
    """``send`` bounded as a whole (connect, every read, the stream's end) to ``timeout``
    seconds; any unexpected failure fails this request only."""
    try:
        return await asyncio.wait_for(send(client, path, body, endpoint), timeout)
    except TimeoutError:
        return RequestResult(ok=False, error=f"timeout: no complete response in {timeout:g} s")
    except Exception as e:  # noqa: BLE001 - a server's bytes must not end the whole run
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}"[:200])
