"""A JSON schema's subschemas, for the checks and rewrites made before it is compiled."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# Keywords whose value maps names to subschemas (the names are data, not keywords).
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
# Keywords whose value is data, never a schema.
_DATA = {"enum", "const", "default", "examples", "required", "dependentRequired"}


def subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object schema in ``schema``, itself first (each once, whatever shares them)."""
    todo, seen = [schema], set()
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(reversed(node))
            continue
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        todo.extend(_parts(node))


def _parts(node: dict[str, Any]) -> Iterator[Any]:
    """What a schema holds that may be or hold schemas (its keywords' values, not data)."""
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            yield from value.values()
        elif key not in _DATA:
            yield value


def closed(schema: Any) -> Any:
    """A copy of ``schema`` with ``additionalProperties: false`` on each object schema that
    says nothing of it (vLLM's disable_additional_properties). ValueError for a schema
    nested past what JSON's encoder takes."""
    try:
        copy = json.loads(json.dumps(schema))
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None
    for node in subschemas(copy):
        if _is_object_schema(node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return copy


def rebased(schema: Any, base: str, prefix: str) -> Any:
    """A copy of ``schema`` to sit at ``base`` (a pointer) inside another schema, beside
    others: each local ``$ref`` ("#", "#/$defs/X", "#/properties/a") made relative to
    ``base``; each ``$anchor`` and the references to it ("#place") renamed with ``prefix``,
    so that two schemas' anchors of one name stay apart; and its root's ``$id`` dropped
    (pointers would resolve inside that resource, not the whole), references by it made
    local. ValueError for a schema nested past what JSON's encoder takes, or with an
    ``$id`` below its root (a resource of its own, whose pointers are its own)."""
    try:
        copy = json.loads(json.dumps(schema))
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None
    root_id = copy.pop("$id", None) if isinstance(copy, dict) else None
    for node in subschemas(copy):
        if node is not copy and isinstance(node.get("$id"), str):
            raise ValueError("an $id below the schema's root is not supported here")
        ref, anchor = node.get("$ref"), node.get("$anchor")
        if isinstance(root_id, str) and isinstance(ref, str) and ref.split("#")[0] == root_id:
            ref = ref[len(root_id):] or "#"
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
        elif isinstance(ref, str) and ref.startswith("#"):
            node["$ref"] = "#" + prefix + ref[1:]
        if isinstance(anchor, str):
            node["$anchor"] = prefix + anchor
    return copy


def depth(schema: Any) -> int:
    """How deep ``schema``'s subschemas nest, each local "#/..." ``$ref`` followed into what
    it names (a reference back into its own chain adds nothing). RecursionError past
    Python's recursion limit."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def visit(node: Any) -> int:
        if not isinstance(node, dict | list):
            return 0
        key = id(node)
        if key in memo or key in active:
            return memo.get(key, 0)
        active.add(key)
        deepest = max(map(visit, _children(node, schema)), default=0)
        active.discard(key)
        memo[key] = deepest + 1
        return deepest + 1

    return visit(schema)


def _children(node: dict[str, Any] | list[Any], root: Any) -> list[Any]:
    if isinstance(node, list):
        return node
    ref = node.get("$ref")
    named = [_pointed(root, ref)] if isinstance(ref, str) and ref.startswith("#/") else []
    return [*_parts(node), *named]


def _pointed(root: Any, ref: str) -> Any:
    """What a local JSON pointer names in ``root`` (None where it names nothing)."""
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        "type" not in node and "properties" in node)
