"""The constraints' limits and rewrites (structured/limits.py, schema.py), as a mutation
survey asked: a tool's schema that refers to itself by its root $id still compiles once
moved under $defs (as tool_choice "required" moves every tool's parameters), the longest
choice list, minProperties against repeated required names, and multipleOf 0."""

import json

import pytest

from pagedserve.engine import InvalidRequest
from pagedserve.scheduler import StructuredOutputs
from pagedserve.structured import GrammarCompiler
from pagedserve.structured.schema import rebased

TREE = {"$id": "urn:example:tree", "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "kids": {"type": "array", "maxItems": 2,
                                "items": {"$ref": "urn:example:tree"}}},
        "required": ["name"], "additionalProperties": False}


def test_a_reference_to_the_roots_id_points_at_the_schemas_new_place(tiny_llama):
    moved = rebased(TREE, "#/$defs/tool_0", "tool_0_")
    assert "$id" not in moved
    assert moved["properties"]["kids"]["items"] == {"$ref": "#/$defs/tool_0"}
    calls = {"$defs": {"tool_0": moved}, "type": "array", "minItems": 1,
             "items": {"$ref": "#/$defs/tool_0"}}
    compiler = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size)
    assert compiler.compile(StructuredOutputs(json=json.dumps(calls), param="tools"))


def test_a_choice_list_of_the_most_choices_compiles_one_more_is_refused(tiny_llama):
    """llguidance takes 1,999 alternatives in one rule: a list of that many compiles, one of
    2,000 is refused at once, by name."""
    compiler = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size)
    most = [f"c{i}" for i in range(1999)]
    assert compiler.compile(StructuredOutputs(choice=most, param="guided_choice"))
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(StructuredOutputs(choice=[*most, "one more"], param="guided_choice"))
    assert e.value.param == "guided_choice" and "more than 1,999 choices" in str(e.value)


def test_min_properties_counts_required_names_once(tiny_llama):
    """minProperties 2 with "a" listed twice in required (one property): past the required
    properties, so refused (llguidance would let {"a": 1, "a": 2} meet it)."""
    compiler = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "required": ["a", "a"], "minProperties": 2,
              "additionalProperties": {"type": "integer"}}
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(StructuredOutputs(json=json.dumps(schema), param="guided_json"))
    assert e.value.param == "guided_json" and "minProperties" in str(e.value)


def test_a_multiple_of_zero_is_refused_by_name(tiny_llama):
    """JSON Schema's multipleOf must be greater than 0: 0 is refused (400) with that reason,
    as a negative one is."""
    compiler = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size)
    for step in (0, -2):
        schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": step}},
                  "required": ["n"]}
        with pytest.raises(InvalidRequest) as e:
            compiler.compile(StructuredOutputs(json=json.dumps(schema), param="guided_json"))
        assert "multipleOf must be greater than 0" in str(e.value), step


def test_the_regex_grammar_and_depth_limits_sit_where_they_say():
    """A regex ending in an escaped backslash is whole (only a lone one is refused); a GBNF
    grammar is held to its own 16 KB (its conversion runs in Python), a Lark one to 128 KB;
    a schema exactly MAX_DEPTH deep passes, one level more is refused."""
    from pagedserve.structured.limits import (
        MAX_DEPTH,
        MAX_GBNF_CHARS,
        check_constraint,
        check_schema,
    )
    from pagedserve.structured.schema import depth

    check_constraint(StructuredOutputs(regex="a\\\\"))  # a, then an escaped backslash
    with pytest.raises(InvalidRequest, match="lone backslash"):
        check_constraint(StructuredOutputs(regex="a\\"))
    gbnf = 'root ::= "a"\n' + "# padding\n" * (MAX_GBNF_CHARS // 10)
    with pytest.raises(InvalidRequest, match="longer than 16 KB"):
        check_constraint(StructuredOutputs(grammar=gbnf))
    schema: dict = {"type": "integer"}
    while depth(schema) < MAX_DEPTH:
        schema = {"type": "array", "items": schema}
    assert depth(schema) == MAX_DEPTH
    check_schema(json.dumps(schema))
    with pytest.raises(InvalidRequest, match="nested more than"):
        check_schema(json.dumps({"type": "array", "items": schema}))


def test_depth_follows_a_pointer_into_a_list_and_past_its_end_to_nothing():
    """"#/anyOf/0" names the list's first item (followed: its nesting counts); "#/anyOf/1",
    one past the end, names nothing (a pointer a client wrote wrong is no server error)."""
    from pagedserve.structured.schema import depth

    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "string"}}}}}
    def pointing(ref: str) -> dict:  # (the pointer sits deeper than the list it names)
        return {"anyOf": [deep], "properties": {"x": {"properties": {"y": {"$ref": ref}}}}}

    assert depth(pointing("#/anyOf/0")) == depth(deep) + 3  # x, y, then what y names
    assert depth(pointing("#/anyOf/1")) == depth(deep) + 2  # the list's own path


def test_depth_reads_a_pointers_escapes():
    """RFC 6901: "~1" is "/" and "~0" is "~" in a pointer's parts."""
    from pagedserve.structured.schema import depth

    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "string"}}}}}
    named = {"$defs": {"a/b~c": deep}, "properties": {"x": {"$ref": "#/$defs/a~1b~0c"}}}
    plain = {"$defs": {"abc": deep}, "properties": {"x": {"$ref": "#/$defs/abc"}}}
    assert depth(named) == depth(plain) > depth({"$defs": {}, "properties": {"x": {}}}) + 2


def test_one_of_is_read_as_any_of(tiny_llama):
    """pydantic's unions write oneOf, which llguidance refuses as such: read as anyOf (the
    README says so), a schema with overlapping branches compiles."""
    from pagedserve.structured import GrammarCompiler

    grammars = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size)
    schema = {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert grammars.guide(StructuredOutputs(json=json.dumps(schema))) is not None
