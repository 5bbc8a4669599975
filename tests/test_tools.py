"""Tool-call readers at the parser level, on mocked model output: whole and split at every
character (the stream must add up to the whole), and tool rendering into chat templates."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from pagedserve.models.chat_template import render_tools_in_messages
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.server.chat_messages import FunctionDefinition, function_parameters
from pagedserve.server.tools import (
    AutoReader,
    JsonCallsReader,
    NamedReader,
    RequiredReader,
    ToolCallReader,
    finish_reason,
)

CALL_A = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
CALL_B = {"name": "get_time", "arguments": {"city": "Tōkyō </tool_call?"}}
AUTO_TEXT = (f"Let me check. <tool_call>\n{json.dumps(CALL_A)}\n</tool_call>"
             f"<tool_call>{json.dumps(CALL_B, ensure_ascii=False)}</tool_call> Done <tool")


def whole(reader: ToolCallReader, text: str) -> ToolCallReader:
    reader.feed(text)
    reader.finish()
    return reader


def streamed(reader: ToolCallReader, pieces: list[str]) -> tuple[str, list[dict]]:
    """Content and calls rebuilt from the stream entries, as an OpenAI client does."""
    content, calls = "", {}
    results = [reader.feed(p) for p in pieces] + [reader.finish()]
    for text, entries in results:
        content += text
        assert len({e["index"] for e in entries}) == len(entries)  # one entry a call a chunk
        for e in entries:
            if "id" in e:  # a call opens with its id, type and name (and arguments so far)
                assert e["type"] == "function" and e["index"] not in calls
                calls[e["index"]] = {"name": e["function"]["name"], "arguments": ""}
            calls[e["index"]]["arguments"] += e["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def as_pairs(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


def split_everywhere(text: str) -> list[list[str]]:
    return [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]


def test_auto_reads_tagged_calls_and_keeps_the_text():
    r = whole(AutoReader(), AUTO_TEXT)
    assert r.content == "Let me check.  Done <tool"
    calls = [c["function"] for c in r.calls]
    assert as_pairs(calls) == [(CALL_A["name"], CALL_A["arguments"]),
                               (CALL_B["name"], CALL_B["arguments"])]
    assert len({c["id"] for c in r.calls}) == 2 and all(c["id"].startswith("call_")
                                                        for c in r.calls)
    # auto's calls end as "tool_calls" however the text ended (vLLM's); required's only when
    # it ended by itself, a named call's never
    assert finish_reason(r, "stop") == finish_reason(r, "length") == "tool_calls"
    required = whole(RequiredReader(), json.dumps([CALL_A]))
    assert finish_reason(required, "stop") == "tool_calls"
    assert finish_reason(required, "length") == "length"
    named = whole(NamedReader(name="get_weather"), json.dumps(CALL_A["arguments"]))
    assert finish_reason(named, "stop") == "stop" and finish_reason(named, "length") == "length"
    assert finish_reason(AutoReader(), "length") == "length"  # no call


@pytest.mark.parametrize("pieces", split_everywhere(AUTO_TEXT)[::7])
def test_auto_stream_adds_up_to_the_whole(pieces):
    content, calls = streamed(AutoReader(), pieces)
    reference = whole(AutoReader(), AUTO_TEXT)
    assert content == reference.content
    assert as_pairs(calls) == as_pairs([c["function"] for c in reference.calls])


def test_auto_holds_back_only_what_may_open_a_tag():
    r = AutoReader()
    assert r.feed("Hello, <tool") == ("Hello,", [])  # "<tool" may open a tag
    assert r.feed("box> is here ") == (" <toolbox> is here", [])  # it did not
    # The stream shows the content stripped, as the whole response does.
    assert r.finish() == ("", []) and r.content.strip() == "Hello, <toolbox> is here"


@pytest.mark.parametrize("text, content, names", [
    ("no calls at all", "no calls at all", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    # The text ended before the closing tag: a complete call inside still counts.
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', "", ["f"]),
    ('<tool_call>{"name": "f", "arg', '<tool_call>{"name": "f", "arg', []),
    # Qwen's older spelling of the arguments.
    ('<tool_call>{"name": "g", "parameters": {"y": 2}}</tool_call>', "", ["g"]),
    # A number past a float's range would be Infinity in the arguments: not JSON, no call.
    ('<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>', []),
    # Arguments as a string: JSON text goes as it is, other text as a JSON string.
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", ["f"]),
    ('<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>', "", ["f"]),
])
def test_auto_edge_cases(text, content, names):
    r = whole(AutoReader(), text)
    assert r.content == content
    assert [c["function"]["name"] for c in r.calls] == names
    for call in r.calls:  # OpenAI's arguments: a string that parses as JSON
        assert json.loads(call["function"]["arguments"]) in ({"x": 1}, {"y": 2}, "Paris")


DEEP = "[" * 5000  # past json's recursion limit: the decoder raises RecursionError


@pytest.mark.parametrize("text", [f"<tool_call>{DEEP}</tool_call> after", f"<tool_call>{DEEP}"],
                         ids=["closed", "unclosed"])
def test_auto_call_nested_too_deep_is_text(text):
    r = whole(AutoReader(), text)
    assert r.content == text and r.calls == []


def test_required_arguments_past_a_floats_range_make_no_call():
    """The JSON grammar lets 1e400 through; read, it is inf, and "Infinity" is not JSON."""
    text = '[{"name": "f", "arguments": {"x": 1e400}}, ' + json.dumps(CALL_A) + "]"
    content, calls = streamed(RequiredReader(), [text])
    assert as_pairs(calls) == [(CALL_A["name"], CALL_A["arguments"])]


def test_required_element_nested_too_deep_makes_no_call():
    text = json.dumps([CALL_A])[:-1] + ', {"name": "f", "arguments": ' + DEEP
    content, calls = streamed(RequiredReader(), [text[:40], text[40:]])
    assert content == "" and as_pairs(calls) == [(CALL_A["name"], CALL_A["arguments"])]


@pytest.mark.parametrize("text", ["[", '[{"name": "f", "argu'])
def test_required_output_without_a_whole_call_is_content_not_lost(text):
    """max_tokens cut the array short, or a schema no output can satisfy ended it (the
    probe's {"$ref": "#"}): the text comes back as content, where it was dropped."""
    content, calls = streamed(RequiredReader(), [text[:2], text[2:]])
    assert content == text and calls == []
    assert whole(RequiredReader(), text).content == text


# Llama 3.1's form (vLLM's llama3_json): "parameters", several calls joined by ";".
LLAMA_TEXT = ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
              '{"name": "get_time", "parameters": {"city": "Tōkyō; later"}}')


@pytest.mark.parametrize("pieces", split_everywhere(LLAMA_TEXT)[::7]
                         + [["<|python_tag|>", LLAMA_TEXT], ["<|python_tag|> \n", LLAMA_TEXT]])
def test_llama3_json_reads_calls_held_to_the_end(pieces):
    content, calls = streamed(JsonCallsReader(), pieces)
    assert content == ""
    assert as_pairs(calls) == [("get_weather", {"city": "Paris", "unit": "c"}),
                               ("get_time", {"city": "Tōkyō; later"})]


def test_parallel_tool_calls_false_keeps_the_first_call():
    """vLLM's: with parallel_tool_calls false, auto's later calls are dropped."""
    for pieces in ([AUTO_TEXT], list(AUTO_TEXT)):
        content, calls = streamed(AutoReader(max_calls=1), pieces)
        assert as_pairs(calls) == [("get_weather", {"city": "Paris", "unit": "c"})]
        assert content == "Let me check.  Done <tool"
    reader = whole(JsonCallsReader(max_calls=1), LLAMA_TEXT)
    assert [c["function"]["name"] for c in reader.calls] == ["get_weather"]


@pytest.mark.parametrize("text", ["It is sunny in Paris.", '{"not": "a call"}',
                                  '{"name": "f", "parameters": {}} and then some text', " <|",
                                  '{"name": "f", "parameters": {"a": NaN}}'])
def test_llama3_json_text_that_is_not_calls_is_content(text):
    content, calls = streamed(JsonCallsReader(), [text[:3], text[3:]])
    assert content == text.strip() and calls == []
    reader = JsonCallsReader()  # text that opens otherwise streams as it comes
    assert reader.feed("It is")[0] == "It is"


def test_named_streams_argument_pieces():
    args = '{"city": "Paris", "unit": "c"}'
    pieces = ['{"', "city", '": "', "Paris", '", "unit": "c"}']
    reader = NamedReader(name="get_weather")
    first_text, first = reader.feed(pieces[0])
    assert first_text == "" and first[0]["id"] and first[0]["function"]["name"] == "get_weather"
    content, calls = streamed(NamedReader(name="get_weather"), pieces)
    assert content == "" and calls == [{"name": "get_weather", "arguments": args}]
    assert whole(NamedReader(name="get_weather"), args).calls[0]["function"]["arguments"] == args


REQUIRED_TEXT = json.dumps([CALL_A, CALL_B], ensure_ascii=False)


@pytest.mark.parametrize("pieces", split_everywhere(REQUIRED_TEXT)[::5])
def test_required_reads_the_array_as_it_streams(pieces):
    content, calls = streamed(RequiredReader(), pieces)
    assert content == ""
    assert as_pairs(calls) == [(CALL_A["name"], CALL_A["arguments"]),
                               (CALL_B["name"], CALL_B["arguments"])]


# ---- rendering ----------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def test_fallback_rendering_for_a_template_without_tools(embedded):
    tok = embedded.tokenizer
    assert not tok.template_takes_tools  # SmolLM2's template ignores `tools`
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools")  # replaces the default system line
    assert json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<|im_start|>tool\n<tool_response>\n21 C\n</tool_response><|im_end|>" in text
    plain = tok.apply_chat_template(CONVERSATION[:1])
    assert "# Tools" not in plain and "You are a helpful AI assistant" in plain
    # A system message of the caller's own is kept, with the tools after it.
    own = render_tools_in_messages([{"role": "system", "content": "Be brief."}], TOOLS)
    assert own[0]["content"].startswith("Be brief.\n\n# Tools")


def test_a_template_with_tools_gets_them(embedded):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}({{ c.function.arguments.city }}){% endfor %}"
                "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}")
    tok = Tokenizer(Backend(models.BPE()), bos_token_id=None, eos_token_ids=[],
                    add_bos=False, chat_template=template)
    assert tok.template_takes_tools
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False, tools=TOOLS) \
        == "[get_weather]user:Weather in Paris?|assistant:(Paris)|tool:21 C#call_1|"


@pytest.mark.parametrize("arguments", ["", "null", "  "])
def test_an_earlier_call_without_arguments_renders_them_as_an_empty_object(arguments):
    """vLLM renders "" (and null) arguments of an earlier call as {} for the template."""
    from pagedserve.server.chat_messages import template_messages
    from pagedserve.server.protocol import ChatCompletionRequest

    call = {"id": "call_1", "type": "function",
            "function": {"name": "ping", "arguments": arguments}}
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]}]})
    assert template_messages(req.messages)[1]["tool_calls"][0]["function"]["arguments"] == {}


def test_a_model_without_a_template_takes_no_tools():
    """(No template to render with: the chat's 400 says so; this property raised, a 500.)"""
    tok = Tokenizer(Backend(models.BPE()), bos_token_id=None, eos_token_ids=[], add_bos=False)
    assert not tok.template_takes_tools


def test_parameters_given_are_the_schema_even_an_empty_one():
    """Only a function that omits ``parameters`` takes none (OpenAI's rule: ``{}`` only);
    one that gives a schema, ``{}`` included (JSON Schema's "anything"), keeps it as given."""
    none = function_parameters(FunctionDefinition(name="f"))
    assert none == {"type": "object", "properties": {}, "additionalProperties": False}
    assert function_parameters(FunctionDefinition(name="f", parameters={})) == {}
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert function_parameters(FunctionDefinition(name="f", parameters=schema)) == schema
