"""What a request may say about structured outputs (vLLM's structured_outputs object,
OpenAI's response_format), and the engine's StructuredOutputs made of it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagedserve.engine import InvalidRequest, StructuredOutputs
from pagedserve.server.chat_messages import ToolDefinition, function_parameters
from pagedserve.server.fields import Body, Text
from pagedserve.structured.schema import closed, rebased


class StructuredOutputsField(Body):
    """vLLM's ``structured_outputs`` object: one of its constraints, and its options (an
    unknown key is a 400: an option dropped would change the output unsaid)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    # Hold whatever their value: JSON is always laid out as json.dumps does (no free
    # whitespace), and there is no other backend to fall back to.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False  # additionalProperties false where unsaid
    whitespace_pattern: Any = None  # refused: the layout is fixed
    structural_tag: Any = None  # refused: not built

    def constraint(self) -> StructuredOutputs:
        param = "structured_outputs"
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise InvalidRequest(f"{param}.{name} is not supported by this server", param)
        schema = self.json_schema
        if self.disable_additional_properties and schema is not None:
            try:
                schema = closed(json.loads(schema) if isinstance(schema, str) else schema)
            except (ValueError, RecursionError) as e:
                raise InvalidRequest(f"Invalid JSON schema: {e}", param) from None
        return constraint(param, schema, bool(self.json_object), self.regex, self.choice,
                          self.grammar)


def _schema_text(schema: dict[str, Any] | str) -> str:
    # Key order kept: the grammar writes properties in the schema's order.
    return schema if isinstance(schema, str) else json.dumps(schema)


def constraint(param: str, json_schema: dict[str, Any] | str | None = None,
                json_object: bool = False, regex: str | None = None,
                choice: list[str] | None = None, grammar: str | None = None
                ) -> StructuredOutputs:
    return StructuredOutputs(
        json=None if json_schema is None else _schema_text(json_schema),
        json_object=json_object, regex=regex,
        choice=None if choice is None else tuple(choice), grammar=grammar, param=param)


class JsonSchemaFormat(Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Text  # OpenAI's and vLLM's: required
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def response_format_constraint(rf: ResponseFormat | None) -> StructuredOutputs | None:
    """OpenAI's response_format as a constraint (None for text, or none given)."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise InvalidRequest("response_format json_schema needs json_schema.schema",
                                 "response_format")
        return constraint("response_format", rf.json_schema.json_schema)
    return constraint("response_format", json_object=True)


def required_calls_constraint(tools: list[ToolDefinition], parallel: bool) -> StructuredOutputs:
    """tool_choice "required": one call or more (one at most unless ``parallel``), each of
    a tool by name with arguments of its schema. Each tool's schema sits under $defs of its
    own, its "#..." references moved there: nested under the calls' array they would point
    at the array's root."""
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t.function.name},
                                          "arguments": {"$ref": f"#/$defs/tool_{i}"}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for i, t in enumerate(tools)]},
        "$defs": {f"tool_{i}": _rebased(function_parameters(t.function), i)
                  for i, t in enumerate(tools)}}
    if not parallel:
        calls["maxItems"] = 1
    return constraint("tools", calls)


def _rebased(schema: dict[str, Any], i: int) -> Any:
    try:
        return rebased(schema, f"#/$defs/tool_{i}", f"tool_{i}_")
    except ValueError as e:
        raise InvalidRequest(f"Invalid JSON schema: {e}", "tools") from None
