"""Chat messages and tool definitions as clients send them, and the messages as chat
templates want them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from pagedserve.models.chat_template import check_part_type, content_text, template_message
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
            if isinstance(kind, str):
                check_part_type(kind)
        return content

    def text(self) -> str:
        return content_text([p.model_dump() for p in self.content]
                            if isinstance(self.content, list) else self.content)


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
    """Messages as chat templates want them (models/chat_template.py's template_message):
    the fields a client may send, and no others."""
    return [template_message(m.model_dump(exclude_none=True)) for m in messages]
