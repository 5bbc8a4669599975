"""What a constraint may hold, checked before llguidance compiles it: sizes past which a
compile would stall or crash the server, and what llguidance takes but would not keep."""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance.gbnf_to_lark import is_lark_syntax

from pagedserve.scheduler import InvalidRequest, StructuredOutputs
from pagedserve.structured.schema import depth, subschemas

NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
         "choice": "choice list", "grammar": "grammar"}
# A Lark grammar: a chain of ~20,000 rules at most, well inside what the compile threads'
# stack holds (workers.py); real grammars take a few KB.
MAX_GRAMMAR_CHARS = 128 << 10
# llguidance turns GBNF into Lark in Python, in time quadratic in the rules, holding the GIL
# (every other thread slows: the engine's steps wait on it): 8,000 rules (125 KB) took
# 2.3 s, 50,000 minutes, and a 31.6 KB grammar of many references 0.45 s. 16 KB takes a
# quarter of that; llama.cpp's own grammars are a few KB. (grammar.py converts one at a time.)
MAX_GBNF_CHARS = 16 << 10
# llguidance's most alternatives in one rule (its row of 2,000 items holds one more): a
# longer choice list is refused at once here, not after seconds of compiling.
MAX_CHOICES = 1999
# How deep a JSON schema may nest, its $refs followed: llguidance follows them recursively.
MAX_DEPTH = 400
_JSON_IN_LARK = re.compile(r"%json\b\s*")


def check_constraint(c: StructuredOutputs) -> None:
    """InvalidRequest (worded as the compile's errors are) for what must not reach
    llguidance."""
    kind = c.kind
    if kind == "json":
        check_schema(c.json)
    elif kind == "grammar":
        _check_grammar(c.grammar)
    elif kind == "regex" and (len(c.regex) - len(c.regex.rstrip("\\"))) % 2:
        # (llguidance would drop it, and match the rest)
        raise InvalidRequest("Invalid regex: it ends with a lone backslash")
    elif kind == "choice" and len(c.choice) > MAX_CHOICES:
        raise InvalidRequest(f"Invalid choice list: more than {MAX_CHOICES:,} choices")


def _check_grammar(text: str) -> None:
    lark = is_lark_syntax(text)
    limit = MAX_GRAMMAR_CHARS if lark else MAX_GBNF_CHARS
    if len(text) > limit:
        raise InvalidRequest(f"Invalid grammar: longer than {limit // 1024} KB "
                             f"({'Lark' if lark else 'GBNF'})")
    # A Lark grammar's %json {...} is a JSON schema: the same checks hold.
    decoder = json.JSONDecoder()
    for found in _JSON_IN_LARK.finditer(text) if lark else ():
        try:
            schema, _ = decoder.raw_decode(text, found.end())
        except (ValueError, RecursionError):
            continue  # not JSON: the compile says so
        _check_schema_value(schema, "grammar (its %json schema)")


def check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return  # not JSON: the grammar's compile says so
    _check_schema_value(schema, "JSON schema")


def _check_schema_value(schema: Any, name: str) -> None:
    """Too deep for llguidance's recursion, or what it accepts but does not keep: it counts
    an object's keys, not its distinct keys, so a minProperties past the required ones can
    be met by one key twice (``{"a": 1, "a": 2}``, one property once parsed); and a
    multipleOf that is not positive (JSON Schema's rule) it reads as its absolute value."""
    try:
        too_deep = depth(schema) > MAX_DEPTH
    except RecursionError:
        too_deep = True
    if too_deep:
        raise InvalidRequest(f"Invalid {name}: nested more than {MAX_DEPTH} levels deep (its "
                             "$refs followed)")
    for node in subschemas(schema):
        least = node.get("minProperties")
        required = node.get("required")
        known = len({r for r in required if isinstance(r, str)}) \
            if isinstance(required, list) else 0
        if _is_number(least) and least > known:
            raise InvalidRequest(f"Invalid {name}: minProperties beyond the required "
                                 "properties is not supported (list the properties in "
                                 "required instead)")
        step = node.get("multipleOf")
        if _is_number(step) and step <= 0:
            raise InvalidRequest(f"Invalid {name}: multipleOf must be greater than 0")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
