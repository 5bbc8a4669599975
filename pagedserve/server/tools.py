"""Tool calls read out of generated text, whole or as it streams.

One reader per tool_choice mode:
- ``auto``: the model's own Hermes/Qwen-style tags, ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, anywhere in the text; the rest is content. Text that might open a
  tag is held back until it cannot. With --tool-call-parser llama3_json, Llama 3.1+'s form
  instead: the whole output one JSON object ``{"name", "parameters"}``, or several joined by
  ";" (after its ``<|python_tag|>``, a special token the text leaves out).
- ``named``: the grammar made the whole output the function's arguments object.
- ``required``: the grammar made the whole output a JSON array of ``{"name", "arguments"}``.

Each reader takes text pieces (``feed``) and returns the content to show and the
``delta.tool_calls`` entries OpenAI streams, one per call in a chunk: the first entry of a
call carries its index, id, type, name and the arguments read so far, later ones carry
argument pieces. ``finish`` flushes what is left; ``calls`` and ``content`` hold the whole
result for a non-streamed response. ``max_calls`` (1 for parallel_tool_calls false) keeps
the first calls and drops the rest, as vLLM does."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallReader:
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls, OpenAI's shape
    content: str = ""  # all content so far
    max_calls: int | None = None
    # Content other than whitespace was shown (or an echoed prefix, which the content
    # goes on from: its whitespace at the join is kept)
    started: bool = False
    _held: str = ""  # whitespace at the end of the content, not shown yet

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []

    def _call(self, name: str, arguments: Any) -> list[dict[str, Any]]:
        """Record a call (none past max_calls); its stream entry."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return []
        if not isinstance(arguments, str):
            try:  # OpenAI's arguments are JSON: 1e400, read as inf, would be "Infinity"
                arguments = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
            except ValueError:
                return []
        call = {"id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return [{"index": len(self.calls) - 1, **call, "function": dict(call["function"])}]

    def _content(self, text: str) -> str:
        """Record content; what to show of it now. A stream shows the content stripped, as a
        whole response does: whitespace at the start is dropped, and whitespace at the end
        (between calls, say) is held until more text follows it."""
        self.content += text
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        shown, self._held = self._held + body, text[len(body):]
        return shown


def parse_call(body: str) -> tuple[str, Any] | None:
    """(name, arguments) of one tagged call's JSON, or None if it is not one."""
    try:
        obj = _DECODER.decode(body)
    except (ValueError, RecursionError):  # nested past the decoder's limit: text too
        return None
    return _as_call(obj)


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: Infinity once read
        raise ValueError(f"{text} is past a float's range")
    return value


# NaN and Infinity are Python's, not JSON's: arguments holding them would not parse anywhere
_DECODER = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)


def _as_call(obj: Any) -> tuple[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # JSON text as a string goes as it is; other text as JSON
        try:
            _DECODER.decode(arguments)
        except (ValueError, RecursionError):
            arguments = json.dumps(arguments, ensure_ascii=False)
    return obj["name"], arguments


@dataclass
class AutoReader(ToolCallReader):
    buffer: str = ""
    in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        shown, entries = "", []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = _partial_tag(self.buffer, OPEN)
                    shown += self._content(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return shown, entries
                shown += self._content(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(OPEN):], True
            end = self.buffer.find(CLOSE)
            if end < 0:
                return shown, entries
            body, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE):]
            self.in_call = False
            call = parse_call(body)
            if call is None:  # not a call after all: it was text
                shown += self._content(OPEN + body + CLOSE)
            else:
                entries += self._call(*call)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return self._content(rest), []
        self.in_call = False
        call = parse_call(rest)  # the text ended inside the tags (no closing tag)
        if call is None:
            return self._content(OPEN + rest), []
        return "", self._call(*call)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class NamedReader(ToolCallReader):
    name: str = ""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if not self.calls:
            return "", self._call(self.name, text)
        if not text:
            return "", []
        self.calls[0]["function"]["arguments"] += text
        return "", [{"index": 0, "function": {"arguments": text}}]


@dataclass
class RequiredReader(ToolCallReader):
    buffer: str = ""
    position: int = 0  # where the next array element may start

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        entries = []
        decoder = json.JSONDecoder()
        while True:
            while self.position < len(self.buffer) and self.buffer[self.position] in "[, \n\t\r":
                self.position += 1
            if self.position >= len(self.buffer) or self.buffer[self.position] != "{":
                return "", entries
            try:
                obj, end = decoder.raw_decode(self.buffer, self.position)
            except (ValueError, RecursionError):  # not complete yet (or nested past the
                return "", entries  # decoder's limit, which no later text undoes: no call)
            self.position = end
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                entries += self._call(obj["name"], obj.get("arguments", {}))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """With no whole call (max_tokens cut the array short, or a schema that no output can
        satisfy ended it), the text is the content rather than lost."""
        if self.calls:
            return "", []
        rest, self.buffer = self.buffer, ""
        return self._content(rest), []


@dataclass
class JsonCallsReader(ToolCallReader):
    """--tool-call-parser llama3_json (vLLM's name): an output that opens with "{" is held to
    its end and read as calls; any other is content, streamed as it comes."""

    buffer: str = ""
    held: bool | None = None  # None: no text yet to tell

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.held is False:
            return self._content(text), []
        self.buffer += text
        head = self.buffer.lstrip().removeprefix(PYTHON_TAG).lstrip()
        if not head or PYTHON_TAG.startswith(self.buffer.lstrip()):
            return "", []
        self.held = head.startswith("{")
        if self.held:
            return "", []
        rest, self.buffer = self.buffer, ""
        return self._content(rest), []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self.buffer = self.buffer, ""
        calls = _json_calls(rest) if self.held else None
        if calls is None:  # not calls after all: it was text
            return self._content(rest), []
        return "", [entry for call in calls for entry in self._call(*call)]


def _json_calls(text: str) -> list[tuple[str, Any]] | None:
    """The calls of a text that is nothing but JSON call objects joined by ";"; else None."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, at = _DECODER, [], 0
    while at < len(text):
        try:
            obj, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        call = _as_call(obj)
        if call is None:
            return None
        calls.append(call)
        while at < len(text) and text[at] in "; \n\t\r":
            at += 1
    return calls or None


PYTHON_TAG = "<|python_tag|>"
PARSERS = ("hermes", "llama3_json")  # --tool-call-parser's choices (vLLM's names)


def reader_for(mode: str | None, function_name: str | None = None, parser: str = "hermes",
               parallel: bool = True) -> ToolCallReader | None:
    if mode == "auto":
        most = None if parallel else 1
        return JsonCallsReader(max_calls=most) if parser == "llama3_json" \
            else AutoReader(max_calls=most)
    if mode == "named":
        return NamedReader(name=function_name or "")
    if mode == "required":
        return RequiredReader()
    return None


def finish_reason(reader: ToolCallReader | None, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when a sample chose to make calls: with auto, however it ended
    (vLLM's: max_tokens may cut the text after a call), with required when it ended by
    itself; a call forced by name ends as "stop", as OpenAI's and vLLM's do."""
    if reader is None or not reader.calls or isinstance(reader, NamedReader):
        return reason
    chose = isinstance(reader, AutoReader | JsonCallsReader)
    return "tool_calls" if reason == "stop" or (chose and reason == "length") else reason
