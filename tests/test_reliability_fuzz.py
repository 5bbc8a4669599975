"""Reliability fuzzing against a real server on the tiny Llama:

* schemathesis generates requests from the served /openapi.json (schema-valid and schema-
  violating ones, fixed seed, a small budget per operation) and checks `not_a_server_error`;
* hypothesis sends an arbitrary JSON value in each sampling field of an otherwise valid
  request; the answer must be a 400 in OpenAI's shape (404 for an unknown model name), or a
  normal completion (a well-formed SSE stream ending in [DONE] when streamed).

After each, /health is 200 and every KV block is free."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from test_server_utils import (
    assert_alive_and_idle,
    sse_events,
    tiny_server,
)

pytestmark = pytest.mark.slow

SCHEMA_EXAMPLES = 20  # per operation and generation mode
FIELD_EXAMPLES = 400  # arbitrary values spread over every field of both endpoints


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # A 64-token context keeps every generation the fuzzers ask for (max_tokens null, n 4)
    # cheap; the validation under test does not depend on it.
    srv = tiny_server(tiny_llama_dir, "--max-model-len", "64")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


# ---- 1. schemathesis over the served OpenAPI document ----------------------------------------
def test_schemathesis_finds_no_server_error(server, capsys):
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import Failure

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
        "POST /detokenize"}
    cases: dict[str, int] = {}
    seconds: dict[str, float] = {}
    errors: list[str] = []
    failures: list[str] = []

    def fuzz(op, mode, key: str) -> None:
        def run(case) -> None:
            cases[key] += 1
            response = case.call(base_url=server.url, timeout=120)
            if response.status_code >= 500:
                errors.append(f"{response.status_code} {case.as_curl_command()}\n"
                              f"{response.text[:300]}")
            try:
                case.validate_response(response, checks=[not_a_server_error])
            except (Failure, AssertionError) as e:  # keep going; counted and asserted below
                failures.append(str(e)[:300])

        # A fixed, derandomized budget per operation and mode (no example database).
        test = settings(max_examples=SCHEMA_EXAMPLES, derandomize=True, deadline=None,
                        database=None, suppress_health_check=list(HealthCheck))(
            given(case=op.as_strategy(generation_mode=mode))(run))
        start = time.monotonic()
        # Unsatisfiable: no schema-violating request exists (a GET without parameters).
        with contextlib.suppress(Unsatisfiable):
            test()
        seconds[key] = time.monotonic() - start

    for op in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE,
                     schemathesis.GenerationMode.NEGATIVE):
            key = f"{op.label} [{mode.value}]"
            cases[key] = 0
            fuzz(op, mode, key)

    total, num_5xx = sum(cases.values()), len(errors)
    with capsys.disabled():
        print(f"\n[fuzz] schemathesis: {total} cases over {len(operations)} operations, "
              f"{num_5xx} 5xx, {len(failures)} not_a_server_error failures")
        for key, count in cases.items():
            print(f"[fuzz]   {key}: {count} cases, {seconds[key]:.1f} s")
    assert total >= len(operations) * 2, cases
    assert not errors, "\n\n".join(errors[:5])
    assert not failures, "\n\n".join(failures[:5])
    assert_alive_and_idle(server.url)


# ---- 2. an arbitrary JSON value in each sampling field -------------------------------------------
def _text() -> st.SearchStrategy[str]:
    # Lone surrogates ("\ud800") included: JSON can spell them.
    return st.text(st.characters(codec=None, exclude_categories=()), max_size=8)


def _json_values() -> st.SearchStrategy:
    scalars = st.one_of(
        st.none(), st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([0, 1, -1, 2, 3, 20, 21, 2**31, 2**63 - 1, 2**63, -(2**63) - 1,
                         2**64, 2**70, 10**30, 50_000, 49_151, 49_152]),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([1e-320, -1e-320, 5e-324, 1e308, -1e308, 0.0, -0.0, 0.5, 1.0, 1.5,
                         2.0, 2.0000001, 0.009, 1e-5, 0.01]),
        _text(),
    )
    # Scalars half the time (more of them are legal, so more requests are served), any
    # JSON value (nested lists and objects) the other half.
    return scalars | st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text(), inner, max_size=3),
        max_leaves=8,
    )


COMPLETION_FIELDS = ["n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                     "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "logprobs", "best_of", "echo",
                     "stream", "stream_options", "skip_special_tokens", "model", "user",
                     "prompt", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs", "prompt_logprobs"]
CHAT_FIELDS = ["n", "max_tokens", "max_completion_tokens", "min_tokens", "temperature",
               "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
               "top_logprobs", "echo", "stream", "stream_options", "model",
               "add_generation_prompt", "messages", "response_format", "tools", "tool_choice",
               "guided_json", "guided_choice"]
TARGETS = [("/v1/completions", f) for f in COMPLETION_FIELDS] + \
          [("/v1/chat/completions", f) for f in CHAT_FIELDS]


def _base(path: str) -> dict:
    if path == "/v1/completions":
        return {"prompt": "Hi there", "max_tokens": 3}
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def _check_completion(body: dict, chat: bool) -> None:
    assert body["object"] == ("chat.completion" if chat else "text_completion"), body
    assert body["choices"], body
    for c in body["choices"]:
        assert c["finish_reason"] in ("stop", "length", "tool_calls"), c
        if chat:
            assert isinstance(c["message"]["content"], str) or c["message"].get("tool_calls")
        else:
            assert isinstance(c["text"], str)


def _check_stream(text: str) -> None:
    events = list(sse_events(text.splitlines()))
    assert events and events[-1] == "[DONE]", events[-3:]
    finished = 0
    for e in events[:-1]:
        assert isinstance(e, dict) and "error" not in e, e
        finished += sum(c.get("finish_reason") is not None for c in e["choices"])
    assert finished >= 1, events


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_arbitrary_json_in_any_field_is_400_or_served(server, http):
    seen: dict[int, int] = {}

    @settings(max_examples=FIELD_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(target=st.sampled_from(TARGETS), value=_json_values(), stream=st.booleans())
    def run(target, value, stream) -> None:
        path, field = target
        body = {**_base(path), "stream": stream, field: value}
        # JSON's own encoder: lone surrogates go out as "\ud800" escapes, floats as repr.
        content = json.dumps(body, allow_nan=False)
        with http.stream("POST", path, content=content.encode(),
                         headers={"Content-Type": "application/json"}) as r:
            r.read()
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code == 400 or (r.status_code == 404 and field == "model"):
            # A well-formed model name the server does not serve is a 404 (as in OpenAI).
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] in ("invalid_request_error", "not_found_error"), err
            return
        assert r.status_code == 200, (field, value, stream, r.status_code, r.text[:500])
        if r.headers["content-type"].startswith("text/event-stream"):
            _check_stream(r.text)
        else:
            _check_completion(r.json(), path.endswith("chat/completions"))

    run()
    print(f"\n[fuzz] field values by status: {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
    assert_alive_and_idle(server.url)

