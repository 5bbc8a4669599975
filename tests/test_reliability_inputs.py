"""Reliability: each reproduction of "one bad request must never take the server down" as an
explicit test against a real server on the tiny Llama (streamed and not where it applies).
Bad values are 400 in OpenAI's shape (never 422 or 500); odd-but-legal ones are served; the
engine stays alive and, once idle, holds no KV block."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server_utils import (
    assert_alive_and_idle,
    openai_error,
    sse_events,
    tiny_server,
)

pytestmark = pytest.mark.slow

MAX_QUEUE = 4
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = tiny_server(tiny_llama_dir, "--max-queue", str(MAX_QUEUE))
    try:
        yield srv
    finally:
        srv.stop()


def body_for(path: str, **fields) -> dict:
    base = ({"prompt": "Hello there", "max_tokens": 4} if path == COMPLETIONS
            else {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
    return {**base, **fields}


def post(server, path: str, body: dict | str | bytes, stream: bool = False) -> httpx.Response:
    """POST ``body`` (a dict, or raw JSON text); a streamed answer is read in full."""
    if isinstance(body, dict):
        content = json.dumps({**body, "stream": True} if stream else body).encode()
    else:
        content = body.encode() if isinstance(body, str) else body
    headers = {"Content-Type": "application/json"}
    with httpx.stream("POST", server.url + path, content=content, headers=headers,
                      timeout=120) as r:
        r.read()
    return r


def events(r: httpx.Response) -> list[dict | str]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    out = list(sse_events(r.text.splitlines()))
    assert out and out[-1] == "[DONE]", out[-3:]
    assert not any(isinstance(e, dict) and "error" in e for e in out), out
    return out


def streamed_text(r: httpx.Response) -> tuple[str, str | None]:
    """The concatenated text of choice 0 and its finish reason."""
    text, finish = "", None
    for e in events(r)[:-1]:
        for c in e["choices"]:
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            finish = c.get("finish_reason") or finish
    return text, finish


def bad(server, path: str, param: str | None, stream: bool = False, **fields) -> dict:
    err = openai_error(post(server, path, body_for(path, **fields), stream), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err


BOTH = pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_a_content_part_that_is_not_text_is_named(server, part):
    """A multimodal part gets a 400 that names its type, not the union's first complaint
    ("Input should be a valid string")."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    err = bad(server, CHAT, "messages", messages=messages)
    assert repr(part["type"]) in err["message"] and "text parts only" in err["message"]
    assert_alive_and_idle(server.url)


# ---- integers that do not fit, token ids outside the vocabulary ------------------------------
@BOTH
@STREAM
@pytest.mark.parametrize("top_k", [10**30, 2**63], ids=["1e30", "2**63"])
def test_top_k_beyond_int64_is_400(server, path, stream, top_k):
    bad(server, path, "top_k", stream, top_k=top_k)


@BOTH
@pytest.mark.parametrize("bias", [{"abc": 1}, {"-1": 1}, {"10000000": 1}, {"5": 101},
                                  {"5": -100.5}, {"9" * 5000: 1}],
                         ids=["word", "negative", "past-vocab", "over-100", "under-100",
                              "5000-digits"])
def test_bad_logit_bias_is_400(server, path, bias):
    bad(server, path, "logit_bias", logit_bias=bias)


@BOTH
def test_logit_bias_is_applied_not_ignored(server, path):
    """+100 on one token makes greedy decoding emit nothing else."""
    token = 1234
    body = body_for(path, temperature=0, max_tokens=3, ignore_eos=True,
                    logit_bias={str(token): 100})
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice.get("text") if path == COMPLETIONS else choice["message"]["content"]
    want = httpx.post(server.url + "/detokenize", json={"tokens": [token] * 3}).json()
    assert text == want["prompt"]


@BOTH
@STREAM
@pytest.mark.parametrize("token", [5, 111], ids=["special", "not-utf8"])
def test_tokens_without_text_read_as_the_whole_decode(server, path, stream, token):
    """A request that forces a token with no text of its own, 20 times: a special token
    (skipped: no text) or a byte that is no UTF-8 character (each one a replacement
    character). Streamed or not, the text is the whole decode's, the bytes' included (the
    stream used to end without them), and the engine stays sound."""
    body = body_for(path, temperature=0, max_tokens=20, ignore_eos=True,
                    logit_bias={str(token): 100})
    r = post(server, path, body, stream)
    if stream:
        chunks = [e["choices"][0] for e in events(r) if isinstance(e, dict) and e["choices"]]
        text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in chunks)
    else:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text") if path == COMPLETIONS else choice["message"]["content"]
    assert text == ("" if token == 5 else "\ufffd" * 20)
    assert_alive_and_idle(server.url)


@BOTH
@pytest.mark.parametrize("top_k", [2**63 - 1, 10**6], ids=["int64max", "1e6"])
def test_top_k_beyond_the_vocabulary_means_off(server, path, top_k):
    r = post(server, path, body_for(path, top_k=top_k, ignore_eos=True, max_tokens=3))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@BOTH
@STREAM
@pytest.mark.parametrize("ids", [[1000000], [-1], [2**70]], ids=["1e6", "-1", "2**70"])
def test_stop_token_ids_outside_the_vocabulary_are_400(server, path, stream, ids):
    bad(server, path, "stop_token_ids", stream, stop_token_ids=ids, min_tokens=2)


@pytest.mark.parametrize("ids", [[1000000], [-1], [2**70], [[5, 2**70]]],
                         ids=["1e6", "-1", "2**70", "nested"])
def test_prompt_token_ids_outside_the_vocabulary_are_400(server, ids):
    bad(server, COMPLETIONS, "prompt", prompt=ids)


@BOTH
@STREAM
@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"),  # OpenAI's [0, 2]
    ({"stop": list("abcde")}, "stop"),  # OpenAI's "up to 4"
    ({"stop": ["a", ""]}, "stop"),  # it would stop before any text
    ({"stop": ""}, "stop"),
    ({"max_tokens": 257}, "max_tokens"),  # past the whole context (256)
], ids=["temperature", "5-stops", "empty-stop", "empty-stop-str", "max-tokens"])
def test_values_vllm_and_openai_refuse_are_400(server, path, stream, fields, param):
    """Values the server took where vLLM's (0.32) and OpenAI's refuse them."""
    bad(server, path, param, stream, **fields)
    fields = {"stop": list("abcd"), "temperature": 2.0, "max_tokens": 256}  # at the edges
    assert post(server, path, body_for(path, **fields), stream).status_code == 200


def test_an_empty_tool_list_is_400(server):
    bad(server, CHAT, "tools", tools=[])


@pytest.mark.parametrize("field", ["n", "max_tokens", "min_tokens", "seed", "logprobs"])
def test_ints_beyond_int64_are_400(server, field):
    bad(server, COMPLETIONS, field, **{field: 2**64})


# ---- floats at the edges -----------------------------------------------------------------
@BOTH
@STREAM
def test_denormal_temperature_is_raised_and_generates(server, path, stream):
    fields = {"temperature": 1e-320, "ignore_eos": True, "max_tokens": 6}
    r = post(server, path, body_for(path, **fields), stream)
    if stream:
        text, finish = streamed_text(r)
    else:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text") or choice.get("message", {}).get("content")
        finish = choice["finish_reason"]
        assert r.json()["usage"]["completion_tokens"] == 6
    assert text, "an empty generation"
    assert finish == "length"


@BOTH
@STREAM
def test_denormal_repetition_penalty_generates(server, path, stream):
    fields = {"repetition_penalty": 1e-320, "temperature": 0.8, "ignore_eos": True,
              "max_tokens": 6, "seed": 1}
    r = post(server, path, body_for(path, **fields), stream)
    if stream:
        text, finish = streamed_text(r)
    else:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text") or choice.get("message", {}).get("content")
        finish = choice["finish_reason"]
    assert text, "an empty generation"
    assert finish == "length"


@pytest.mark.parametrize("raw", ["1e999", "-1e999", "NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty",
                                   "presence_penalty"])
def test_non_finite_floats_are_400(server, raw, field):
    text = ('{"prompt": "Hi", "max_tokens": 2, "%s": %s}' % (field, raw))  # noqa: UP031
    openai_error(post(server, COMPLETIONS, text), 400)


# ---- n and best_of --------------------------------------------------------------------------
@BOTH
@STREAM
def test_n_beyond_max_n_is_400(server, path, stream):
    err = bad(server, path, "n", stream, n=2000)
    assert "at most" in err["message"]


@STREAM
def test_best_of_below_n_is_400(server, stream):
    bad(server, COMPLETIONS, "best_of", stream, best_of=1, n=2)


def test_best_of_above_n_is_400_streamed(server):
    bad(server, COMPLETIONS, "best_of", True, best_of=3, n=1)


def test_best_of_equal_to_n_is_served(server):
    r = post(server, COMPLETIONS, body_for(COMPLETIONS, best_of=2, n=2, max_tokens=2))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


# ---- strings that are not Unicode, JSON that is too deep --------------------------------------
LONE = '"ab\\ud800cd"'  # JSON text: a lone high surrogate inside a string


@STREAM
def test_lone_surrogate_in_prompt_is_400(server, stream):
    text = '{"prompt": %s, "max_tokens": 2, "stream": %s}' % (LONE, json.dumps(stream))  # noqa: UP031
    openai_error(post(server, COMPLETIONS, text), 400)
    text = '{"prompt": ["ok", %s], "max_tokens": 2}' % LONE  # noqa: UP031
    openai_error(post(server, COMPLETIONS, text), 400)


@STREAM
def test_lone_surrogate_in_chat_content_is_400(server, stream):
    for content in (LONE, '[{"type": "text", "text": %s}]' % LONE):  # noqa: UP031
        text = ('{"messages": [{"role": "user", "content": %s}], "max_tokens": 2, '  # noqa: UP031
                '"stream": %s}' % (content, json.dumps(stream)))
        openai_error(post(server, CHAT, text), 400)


@BOTH
@pytest.mark.parametrize("field", ["model", "stop", "user"])
def test_lone_surrogate_in_other_strings_is_400(server, path, field):
    base = json.dumps(body_for(path))[:-1]
    openai_error(post(server, path, f'{base}, "{field}": {LONE}}}'), 400)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_lone_surrogate_on_tokenizer_routes_is_400(server, path):
    body = '{"prompt": %s}' % LONE if path == "/tokenize" else '{"tokens": [1], "model": %s}' % LONE  # noqa: UP031,E501
    openai_error(post(server, path, body), 400)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize", "/detokenize"])
def test_deeply_nested_json_is_400(server, path):
    depth = 10_000
    openai_error(post(server, path, "[" * depth + "]" * depth), 400)
    key = "prompt" if path != CHAT else "messages"
    openai_error(post(server, path, '{"%s": %s%s}' % (key, "[" * depth, "]" * depth)), 400)  # noqa: UP031


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_tool_arguments_nested_too_deep_are_kept_as_text(server, path):
    """An assistant's tool-call arguments past json's recursion limit go into the template
    as the text they are, as arguments that do not parse do (not a 500)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    body = {"messages": messages} | ({"max_tokens": 2} if path == CHAT else {})
    r = post(server, path, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", [COMPLETIONS, "/tokenize"])
@pytest.mark.parametrize("raw", [b'{"prompt": ', b"\xff\xfe", b"{'prompt': 'x'}"],
                         ids=["truncated", "not-utf8", "single-quotes"])
def test_malformed_json_is_400_naming_no_field(server, path, raw):
    # Not a field's fault: param is null, and the message names no field (FastAPI's error
    # location for a body that does not parse is ("body", <offset>)).
    err = openai_error(post(server, path, raw), 400)
    assert err["param"] is None, err
    assert not err["message"].split(":")[0].isdigit(), err


def test_tokenize_empty_messages_is_400(server):
    openai_error(post(server, "/tokenize", {"messages": []}), 400)
    openai_error(post(server, "/tokenize", {}), 400)
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text


def test_text_past_the_char_bound_is_400_before_tokenizing(server):
    err = openai_error(post(server, COMPLETIONS, body_for(COMPLETIONS, prompt="a" * 200_000)),
                       400)
    assert err["code"] == "context_length_exceeded"
    err = openai_error(post(server, "/tokenize", {"prompt": "a" * 200_000}), 400)
    assert err["code"] == "context_length_exceeded"


# ---- the queue ------------------------------------------------------------------------------
@STREAM
def test_more_prompts_than_max_queue_is_400_without_retry_after(server, stream):
    r = post(server, COMPLETIONS, body_for(COMPLETIONS, prompt=["a"] * (MAX_QUEUE + 1)), stream)
    openai_error(r, 400)
    assert "retry-after" not in r.headers
    r = post(server, COMPLETIONS, body_for(COMPLETIONS, prompt=["a"] * MAX_QUEUE, max_tokens=2))
    assert r.status_code == 200, r.text


# ---- the OpenAPI document -------------------------------------------------------------------
def test_openapi_documents_bodies_and_errors_and_no_422(server):
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    assert "422" not in r.text
    doc = r.json()
    schemas = doc["components"]["schemas"]
    assert "ErrorResponse" in schemas
    assert not {"HTTPValidationError", "ValidationError"} & set(schemas)
    expected = {"/v1/completions": "CompletionRequest",
                "/v1/chat/completions": "ChatCompletionRequest",
                "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
    for path, model in expected.items():
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model), (path, ref)
        assert model in schemas
        statuses = set(op["responses"])
        wanted = {"400", "401", "404", "413", "500", "503"}
        if path.startswith("/v1"):
            wanted.add("429")
        assert wanted <= statuses, (path, statuses)
        for status in wanted:
            content = op["responses"][status]["content"]["application/json"]["schema"]
            assert content["$ref"].endswith("/ErrorResponse"), (path, status, content)
    # SageMaker's route takes either body (was undescribed).
    body = doc["paths"]["/invocations"]["post"]["requestBody"]["content"]["application/json"]
    assert [ref["$ref"].rsplit("/", 1)[1] for ref in body["schema"]["anyOf"]] == [
        "ChatCompletionRequest", "CompletionRequest"]


# ---- the server survived all of it ---------------------------------------------------------
def test_zz_alive_and_idle_after_everything(server):
    assert_alive_and_idle(server.url)
    r = post(server, COMPLETIONS, body_for(COMPLETIONS, max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.output()
