"""Chat messages and tool definitions as clients send them, and the messages as chat
templates want them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from pagedserve.server.fields import Body, Text


class TextPart(Body):
    type: Literal["text"]
    text: Text


class RefusalPart(Body):
    """An assistant's earlier refusal (OpenAI's part): text to the template, as vLLM reads it."""

    type: Literal["refusal"]
    refusal: Text


class FunctionCall(Body):
    name: Text
    arguments: Text = "{}"  # a JSON object, as a string (OpenAI)


class ToolCall(Body):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[Annotated[TextPart | RefusalPart, Field(discriminator="type")]] \
        | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # which call a "tool" message answers
    # An earlier turn's reasoning, for templates that show it (Qwen3's); `reasoning` is the
    # newer name of the same field (vLLM's and OpenAI-compatible clients' use both).
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Named here: the union's first complaint would be "Input should be a valid string".
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "refusal"):
                raise ValueError(f"content parts of type {kind!r} are not supported: this "
                                 "server reads text parts only (and refusal parts)")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text if isinstance(part, TextPart) else part.refusal
                             for part in self.content)
        return self.content or ""


class FunctionDefinition(Body):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: Text


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


def function_parameters(function: FunctionDefinition) -> dict[str, Any]:
    """The function's JSON schema of arguments (none given: OpenAI's empty parameter list,
    so ``{}`` only)."""
    return function.parameters if function.parameters is not None else {
        "type": "object", "properties": {}, "additionalProperties": False}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates want them: role and plain-text content, and for tool use
    an assistant's ``tool_calls`` (arguments as an object, as HF templates expect) and a
    tool message's ``tool_call_id``."""
    roles = {"developer": "system"}
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": roles.get(m.role, m.role), "content": m.text()}
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            item["reasoning_content"] = reasoning
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    return out


def _arguments(text: str) -> Any:
    """A call's arguments as JSON for the template, or the text as it is where it does not
    parse (nested past the decoder's recursion limit too); none ("" or null) are ``{}``,
    as vLLM renders them."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return {} if value is None else value
