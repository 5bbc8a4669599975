"""Structured outputs and tool calls through the `openai` SDK against a real `pagedserve
serve` with the embedded SmolLM2-135M: every answer follows its schema, regex, choice or
tool's parameters; bad constraints are OpenAI-shaped 400s before anything is queued; the
pool is all free afterwards."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_server_utils import RemoteServer, wait_kv_free

from pagedserve.server.structured_fields import StructuredOutputsField

pytestmark = pytest.mark.slow


class Person(BaseModel):
    # Bounded fields: the grammar guarantees validity once the object closes, and bounds
    # guarantee it closes within max_tokens whatever a 135M model likes to repeat.
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad", "calm"]


SUBJECTS = ["a pirate", "a baker", "a chess champion", "a sleepy cat owner", "an astronaut",
            "a jazz drummer", "a retired teacher", "a marathon runner", "a beekeeper",
            "a lighthouse keeper", "a toddler", "a museum guard", "a surfer", "a violinist",
            "a farmer", "a detective", "a librarian", "a chef", "a pilot", "a gardener"]

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "vip": {"type": "boolean"}},
            "required": ["name", "vip"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {
                "sku": {"enum": ["apple", "bread", "milk"]},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["customer", "items", "status"],
    "additionalProperties": False,
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server():
    # SmolLM2's template reads no tools, so the server's own tool prompt asks for Hermes
    # tags: those are read back whatever the parser flag says (llama3_json here).
    srv = RemoteServer("--tool-call-parser", "llama3_json")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(autouse=True)
def pool_is_free_after(server):
    yield
    assert wait_kv_free(server.url) == 0, "KV blocks leaked"


def test_parse_with_a_pydantic_model_for_20_prompts(client, model):
    def ask(subject: str):
        return client.chat.completions.parse(
            model=model, response_format=Person, max_tokens=60, temperature=0,
            messages=[{"role": "user", "content": f"Describe {subject} as JSON."}])

    with ThreadPoolExecutor(len(SUBJECTS)) as pool:  # one batch in the engine
        answers = list(pool.map(ask, SUBJECTS))
    parsed = [a.choices[0].message.parsed for a in answers]
    assert all(isinstance(p, Person) for p in parsed), [a.choices[0] for a in answers]
    assert all(a.choices[0].finish_reason == "stop" for a in answers)
    assert len({p.model_dump_json() for p in parsed}) > 1  # the prompts matter


def test_json_schema_every_sample_of_n4(client, model):
    out = client.chat.completions.create(
        model=model, n=4, temperature=0.9, seed=5, max_tokens=80,
        messages=[{"role": "user", "content": "Write a grocery order as JSON."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "order", "schema": ORDER_SCHEMA, "strict": True}})
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), ORDER_SCHEMA)


def test_json_object(client, model):
    out = client.chat.completions.create(
        model=model, max_tokens=80, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with a city and its country."}])
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, pattern", [
    ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, r"[0-9]{3}-[0-9]{4}"),
    ({"structured_outputs": {"regex": "(cat|dog)s? [a-z]{2,8}"}}, r"(cat|dog)s? [a-z]{2,8}"),
    ({"guided_choice": ["Paris", "Rome", "Berlin"]}, r"Paris|Rome|Berlin"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
    ({"guided_grammar": 'root ::= "#" [a-f0-9] [a-f0-9] [a-f0-9]'}, r"#[a-f0-9]{3}"),
], ids=["guided_regex", "so_regex", "guided_choice", "so_choice", "guided_grammar"])
def test_regex_choice_and_grammar_match(client, model, extra, pattern):
    chat = client.chat.completions.create(
        model=model, max_tokens=20, temperature=0.7, seed=1, n=2, extra_body=extra,
        messages=[{"role": "user", "content": "Answer briefly: a phone number, an animal, "
                                              "a capital or a colour."}])
    comp = client.completions.create(model=model, prompt="The answer is:", max_tokens=20,
                                     temperature=0, extra_body=extra)
    texts = [c.message.content for c in chat.choices] + [comp.choices[0].text]
    for text in texts:
        assert re.fullmatch(pattern, text), texts
    assert {c.finish_reason for c in chat.choices} | {comp.choices[0].finish_reason} == {"stop"}


# ---- tools --------------------------------------------------------------------------------
def _stream_tool_calls(client, **kw) -> tuple[str, list[dict], str | None]:
    """Content, the calls rebuilt from delta.tool_calls as OpenAI streams them, and the
    finish reason."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            entries = choice.delta.tool_calls or []
            assert len({d.index for d in entries}) == len(entries)  # one entry a call a chunk
            # calls and the finish in chunks of their own, as OpenAI's (the SDK's stream
            # helper never closed a call that came beside the finish)
            assert not (entries and choice.finish_reason), choice
            for d in entries:
                if d.index not in calls:  # a call opens with its id, type and name
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def _check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


@pytest.mark.parametrize("tool_choice, names, reason", [
    ("required", None, "tool_calls"),
    # a call forced by name ends as "stop", as OpenAI's and vLLM's do
    ({"type": "function", "function": {"name": "get_time"}}, ["get_time"], "stop"),
], ids=["required", "named"])
def test_required_and_named_tool_calls(client, model, tool_choice, names, reason):
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
              max_tokens=80, temperature=0)
    out = client.chat.completions.create(**kw)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == reason
    whole = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in message.tool_calls]
    _check_calls(whole)
    assert names is None or [c["name"] for c in whole] == names
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    assert _stream_tool_calls(client, **kw) == ("", whole, reason)  # greedy: the same


# A pydantic model's schema: nested models and enums under $defs, referenced from the root.
DEFS_TOOL = {"type": "function", "function": {"name": "forecast", "parameters": {
    "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string",
                                                                "maxLength": 12}},
                      "required": ["city"], "additionalProperties": False},
              "Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"},
                                     "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["loc", "unit"], "additionalProperties": False}}}


def test_required_tools_with_defs(client, model):
    """tool_choice required over tools whose schemas hold $defs (every pydantic model with a
    nested model or an enum): a 400 "Pointer '/$defs/Loc' does not exist" before
    (tests/test_structured_tokens.py checks the references' grammar)."""
    out = client.chat.completions.create(model=model, messages=ASK, max_tokens=60,
                                         tools=[DEFS_TOOL, TIME], tool_choice="required")
    for call in out.choices[0].message.tool_calls:
        schema = {"forecast": DEFS_TOOL, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments),
                            schema["function"]["parameters"])


def test_auto_tool_call_parsed_from_the_tags(client, model):
    """auto: the model's own <tool_call> tags, read back into tool_calls. The 135M model
    never emits them unprompted, so a regex makes it (its city is its own choice)."""
    forced = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Za-z ]{1,20}", '
              r'"unit": "(c|f)"\}\}\n</tool_call>')
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=80,
              temperature=0, extra_body={"guided_regex": forced})
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    whole = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls]
    _check_calls(whole)
    assert _stream_tool_calls(client, **kw) == ("", whole, "tool_calls")
    # max_tokens cutting the text after a call still ends in "tool_calls" (vLLM's)
    cut = dict(kw, max_tokens=out.usage.completion_tokens + 2,
               extra_body={"guided_regex": forced + " and then [a-z ]{30,40}"})
    out = client.chat.completions.create(**cut)
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.tool_calls
    assert _stream_tool_calls(client, **cut)[1:] == (whole, "tool_calls")
    # A call is read from the output only: an echoed assistant prefix is content, as is the
    # output that closes its tags.
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    echoed = dict(kw, messages=[*ASK, {"role": "assistant", "content": prefix}],
                  extra_body={"guided_regex": r'[A-Za-z]{1,10}", "unit": "c"\}\}\n</tool_call>',
                              "continue_final_message": True, "add_generation_prompt": False,
                              "echo": True})
    out = client.chat.completions.create(**echoed)
    message = out.choices[0].message
    assert message.tool_calls is None and message.content.startswith(prefix)
    assert message.content.endswith('"unit": "c"}}\n</tool_call>')
    assert _stream_tool_calls(client, **echoed) == (message.content, [], "stop")
    # and the space where the echo and the output join is kept, streamed or not
    spaced = dict(echoed, messages=[*ASK, {"role": "assistant", "content": "It is"}],
                  extra_body=dict(echoed["extra_body"], guided_regex=r" [0-9]{2} degrees\."))
    content = client.chat.completions.create(**spaced).choices[0].message.content
    assert content.startswith("It is ") and content.endswith(" degrees."), content
    assert _stream_tool_calls(client, **spaced) == (content, [], "stop")
    # An echo before a call comes back as it is, whitespace too (vLLM's), streamed or not
    said = "  Let me check. "
    called = dict(echoed, messages=[*ASK, {"role": "assistant", "content": said}],
                  extra_body=dict(echoed["extra_body"], guided_regex=forced))
    out = client.chat.completions.create(**called)
    assert out.choices[0].message.content == said and out.choices[0].message.tool_calls
    assert _stream_tool_calls(client, **called)[0] == said
    # Without tags the text stays content, and nothing is held back from the stream.
    plain = dict(kw, extra_body={"guided_choice": ["It is sunny in Paris."]})
    out = client.chat.completions.create(**plain)
    assert out.choices[0].message.content == "It is sunny in Paris."
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
    assert _stream_tool_calls(client, **plain) == ("It is sunny in Paris.", [], "stop")
    # Two calls; parallel_tool_calls false keeps the first (vLLM's), streamed or not.
    two = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    two = [two + "\n" + two.replace("Oslo", "Rome")]
    out = client.chat.completions.create(**dict(kw, extra_body={"guided_choice": two}))
    assert [c.function.arguments for c in out.choices[0].message.tool_calls] == [
        '{"city": "Oslo"}', '{"city": "Rome"}']
    one = dict(kw, extra_body={"guided_choice": two}, parallel_tool_calls=False)
    out = client.chat.completions.create(**one)
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", '{"city": "Oslo"}')
    assert _stream_tool_calls(client, **one) == (
        "", [{"name": "get_time", "arguments": '{"city": "Oslo"}'}], "tool_calls")


def test_auto_tool_choice_keeps_special_tokens_in_the_text(server, model):
    """vLLM's Hermes parser reads a chat with tools with special tokens kept: some models'
    <tool_call> tags are special tokens, and skipped they left the calls as content."""
    body = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 2,
            "temperature": 0, "logit_bias": {"1": 100}}  # <|im_start|>, a special token
    auto = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert auto["choices"][0]["message"]["content"] == "<|im_start|><|im_start|>", auto
    plain = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={**body, "tool_choice": "none"}).json()
    assert not plain["choices"][0]["message"]["content"], plain


def test_a_named_function_without_parameters_is_called_with_none(client, model):
    """OpenAI's rule: a function that omits parameters takes none, so its arguments are {}."""
    out = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=20, temperature=0,
        tools=[{"type": "function", "function": {"name": "ping"}}],
        tool_choice={"type": "function", "function": {"name": "ping"}})
    assert out.choices[0].message.tool_calls[0].function.arguments == "{}"


def test_tokenize_counts_the_tools_as_chat_does(server, client, model):
    """/tokenize with tools renders them as a chat request does (vLLM's tokenize takes
    tools): its count is the chat's prompt_tokens."""
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1)
    r = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["count"] == out.usage.prompt_tokens
    plain = httpx.post(server.url + "/tokenize", json={"messages": ASK}).json()["count"]
    assert plain < out.usage.prompt_tokens


def test_tool_results_go_back_into_the_template(client, model):
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                         max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > 150  # tools, the call and its result were all rendered


# ---- best_of ------------------------------------------------------------------------------
def test_best_of_returns_the_most_likely_samples(client, model):
    """best_of=4, n=2: the 2 of the 4 samples (each with seed + i, as with n=4) whose tokens
    have the highest summed logprob, best first."""
    kw = dict(model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **kw)
    score = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == sorted(score, key=score.get, reverse=True)[:2]
    assert best.choices[0].logprobs is None  # ranked by logprobs, shown only when asked
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all 4 generated


# ---- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    ({"guided_grammar": "root ::= (("}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),  # vLLM's 400 too
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"}, "tools"),
    # beyond llguidance's limits from the first token on, or not kept by it (a key twice)
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
    ({"guided_json": {"type": "object", "minProperties": 2,
                      "additionalProperties": {"type": "integer"}}}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_everything": True}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),  # no name: OpenAI's and vLLM's 400
], ids=["schema", "ref", "regex", "so_regex", "so_json", "grammar", "two", "missing_tool",
        "no_tools", "auto_no_tools", "bad_tool_schema", "matcher_limit", "min_properties",
        "so_option", "so_unknown", "unnamed_schema"])
def test_bad_constraints_are_400(server, model, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "hi", "guided_regex": "(unclosed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


def test_a_matcher_that_gives_up_mid_output_is_a_400(server, model):
    """A limit of the grammar engine met after a free first token (no check before the
    request runs sees it) is the request's 400, or a stream's error event: never a "stop"
    of an output cut short. The server goes on serving."""
    body = {"model": model, "prompt": "b", "max_tokens": 8, "temperature": 0,
            "guided_regex": "(b|c)a{500000}"}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("guided_regex", "invalid_value"), error
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["error"]["param"] == "guided_regex", events
    assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])
    ok = httpx.post(server.url + "/v1/completions", timeout=60,
                    json={**body, "guided_regex": "(b|c)a{5}"}).json()["choices"][0]
    assert re.fullmatch("(b|c)a{5}", ok["text"]) and ok["finish_reason"] == "stop", ok


def test_a_matcher_that_gives_up_fails_its_request_alone(server, model):
    """A request that runs its matcher's lexer out of states (the b branch) is a 400; the
    requests of the same constraint after it, on the other branch, are served whole: the
    lexer was that request's own, not the cached constraint's."""
    def first(text: str) -> int:
        r = httpx.post(server.url + "/tokenize", timeout=60, json={
            "model": model, "prompt": text, "add_special_tokens": False})
        return r.json()["tokens"][0]

    body = {"model": model, "prompt": "Pick:", "max_tokens": 6, "temperature": 0,
            "guided_regex": "ba{500000}|c[a-z]{0,8}"}
    b, c = ({"logit_bias": {str(first(t)): 100}} for t in "bc")
    for branch in (c, b, c, b, c):
        r = httpx.post(server.url + "/v1/completions", json={**body, **branch}, timeout=60)
        if branch is b:
            assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        else:
            assert r.status_code == 200, r.text
            assert re.fullmatch("c[a-z]{0,8}", r.json()["choices"][0]["text"]), r.text


def test_structured_outputs_options_of_vllms():
    """disable_additional_properties closes the schema; the options that hold here anyway
    are taken (JSON is always laid out compactly, and there is no backend to fall back to)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    field = StructuredOutputsField.model_validate({
        "json": schema, "disable_additional_properties": True, "disable_any_whitespace": True,
        "disable_fallback": True})
    assert json.loads(field.constraint().json) == {**schema, "additionalProperties": False}
    assert json.loads(StructuredOutputsField(json=schema).constraint().json) == schema
