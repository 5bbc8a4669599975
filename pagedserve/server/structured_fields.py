"""What a request may say about structured outputs (vLLM's structured_outputs object,
OpenAI's response_format), and the engine's StructuredOutputs made of it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagedserve.engine import InvalidRequest, StructuredOutputs
from pagedserve.server.fields import Body, Text


class StructuredOutputsField(Body):
    """vLLM's ``structured_outputs`` object: one of its keys."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_schema: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


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
    name: Text = "response"
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
