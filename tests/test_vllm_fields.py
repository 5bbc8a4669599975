"""vLLM's request fields beyond OpenAI's, on a real server: honoured (allowed_token_ids,
truncate_prompt_tokens, return_tokens_as_token_ids, add_special_tokens, response_format on
/v1/completions; bad_words, cache_salt, return_token_ids and priority in
test_vllm_sampling_fields.py; use_beam_search in test_beam_search.py) or refused by name
with a 400 (logits_processors; a request's chat_template without
--trust-request-chat-template), never dropped without a word: a
field no one knows is logged, as vLLM logs it."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from test_server_utils import RemoteServer, openai_error

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama, with a tokenizer that puts a BOS in front of a text prompt."""
    path = tmp_path_factory.mktemp("bos-llama")
    for file in tiny_llama_dir.iterdir():
        shutil.copy(file, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    with RemoteServer("--model", str(path), "--max-model-len", "128") as srv:
        yield srv


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def completion(server, **body) -> dict:
    r = post(server, "/v1/completions", **{"max_tokens": 4, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(choice: dict) -> list[int]:
    """A choice's sampled ids, from return_tokens_as_token_ids' "token_id:N" tokens."""
    tokens = choice["logprobs"]["tokens"] if "tokens" in choice["logprobs"] else [
        t["token"] for t in choice["logprobs"]["content"]]
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_allowed_token_ids_and_tokens_as_ids(server):
    allowed = [42, 43, 44]
    for temperature in (0.0, 1.0):
        out = completion(server, prompt="Hello", allowed_token_ids=allowed, max_tokens=8,
                         temperature=temperature, seed=1, logprobs=1,
                         return_tokens_as_token_ids=True)
        assert set(token_ids(out["choices"][0])) <= set(allowed)
    chat = post(server, "/v1/chat/completions", messages=HI, allowed_token_ids=[7], max_tokens=3,
                ignore_eos=True, logprobs=True, return_tokens_as_token_ids=True).json()
    assert token_ids(chat["choices"][0]) == [7, 7, 7]
    assert chat["choices"][0]["logprobs"]["content"][0]["bytes"] == list(b"token_id:7")
    openai_error(post(server, "/v1/completions", prompt="x", allowed_token_ids=[10**9]), 400)
    # with a grammar, two masks might leave no token: refused
    err = openai_error(post(server, "/v1/completions", prompt="x", allowed_token_ids=[42],
                            guided_regex="a+"), 400)
    assert err["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_keeps_the_last_ones(server):
    ids = list(range(100, 130))
    cut = completion(server, prompt=ids, truncate_prompt_tokens=5, temperature=0)
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["text"] == completion(server, prompt=ids[-5:],
                                                   temperature=0)["choices"][0]["text"]
    long_text = "word " * 400  # past the 128-token context
    openai_error(post(server, "/v1/completions", prompt=long_text, max_tokens=1), 400)
    kept = completion(server, prompt=long_text, truncate_prompt_tokens=100, max_tokens=1)
    assert kept["usage"]["prompt_tokens"] == 100
    whole = completion(server, prompt=ids, truncate_prompt_tokens=-1)  # -1: the context's
    assert whole["usage"]["prompt_tokens"] == len(ids)
    # -1 keeps what the context holds beside max_tokens (vLLM's), a long prompt too
    room = completion(server, prompt=long_text, truncate_prompt_tokens=-1, max_tokens=4)
    assert room["usage"]["prompt_tokens"] == 124
    chat = post(server, "/v1/chat/completions", messages=HI, truncate_prompt_tokens=3,
                max_tokens=1).json()
    assert chat["usage"]["prompt_tokens"] == 3
    err = openai_error(post(server, "/v1/completions", prompt="x", truncate_prompt_tokens=129),
                       400)
    assert err["param"] == "truncate_prompt_tokens"


def test_a_cut_text_keeps_its_bos(server):
    """vLLM cuts a text prompt as transformers' left truncation does: the BOS stays, then
    the text's last tokens (a cut that dropped the BOS changes what a model sees); cut on
    the right, its first tokens."""
    text = " ".join(f"w{i}" for i in range(30))

    def prompt_ids(**body) -> list[int]:
        out = completion(server, prompt=text, max_tokens=1, echo=True, logprobs=0,
                         return_tokens_as_token_ids=True, **body)
        return token_ids(out["choices"][0])[:-1]  # the echoed prompt, not the sampled token

    bare = prompt_ids(add_special_tokens=False)
    assert prompt_ids() == [1, *bare]
    assert prompt_ids(truncate_prompt_tokens=5) == [1, *bare[-4:]]
    assert prompt_ids(truncate_prompt_tokens=5, add_special_tokens=False) == bare[-5:]
    assert prompt_ids(truncate_prompt_tokens=len(bare) + 1) == [1, *bare]  # nothing to cut
    # vLLM's truncation_side "right": the first tokens kept (the BOS among them); "left" is
    # the default; anything else is a 400.
    assert prompt_ids(truncate_prompt_tokens=5, truncation_side="right") == [1, *bare[:4]]
    assert prompt_ids(truncate_prompt_tokens=5, truncation_side="left") == [1, *bare[-4:]]
    ids = list(range(100, 130))
    assert completion(server, prompt=ids, truncate_prompt_tokens=5, temperature=0,
                      truncation_side="right")["choices"][0]["text"] == completion(
        server, prompt=ids[:5], temperature=0)["choices"][0]["text"]
    chat = [post(server, "/v1/chat/completions", messages=HI, max_tokens=1, logprobs=True,
                 return_token_ids=True, **extra).json() for extra in (
        {}, {"truncate_prompt_tokens": 3, "truncation_side": "right"})]
    assert chat[1]["prompt_token_ids"] == chat[0]["prompt_token_ids"][:3]
    err = openai_error(post(server, "/v1/completions", prompt="x", truncate_prompt_tokens=3,
                            truncation_side="middle"), 400)
    assert err["param"] == "truncation_side"


def test_add_special_tokens(server):
    """A text prompt gets the BOS unless the client rendered it itself; chat's template
    does, so it gets one only when asked (vLLM's defaults)."""
    with_bos = completion(server, prompt="Hello world")["usage"]["prompt_tokens"]
    bare = completion(server, prompt="Hello world", add_special_tokens=False)
    assert bare["usage"]["prompt_tokens"] == with_bos - 1
    chat = [post(server, "/v1/chat/completions", messages=HI, max_tokens=1, **extra).json()
            for extra in ({}, {"add_special_tokens": True})]
    assert chat[1]["usage"]["prompt_tokens"] == chat[0]["usage"]["prompt_tokens"] + 1


def test_response_format_on_completions(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = completion(server, prompt="Answer:", max_tokens=20, ignore_eos=False,
                     response_format={"type": "json_schema",
                                      "json_schema": {"name": "a", "schema": schema}})
    assert set(json.loads(out["choices"][0]["text"])) == {"ok"}
    err = openai_error(post(server, "/v1/completions", prompt="x", guided_regex="a+",
                            response_format={"type": "json_object"}), 400)
    assert "Only one structured-output constraint" in err["message"]


@pytest.mark.parametrize("field, value", [
    ("logits_processors", ["m.f"]),
    ("functions", [{"name": "f"}])])
def test_fields_this_server_cannot_honour_are_refused_by_name(server, field, value):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": HI})):
        err = openai_error(post(server, path, max_tokens=1, **body, **{field: value}), 400)
        assert err["param"] == field
        assert "not supported" in err["message"]


def _streamed_text(server, path: str, body: dict) -> str:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] if "text" in c["choices"][0]
                   else c["choices"][0]["delta"].get("content") or "" for c in chunks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_token_that_ends_a_sample_shows_no_text_streamed_or_not(server, path):
    """A stop token id, or EOS with skip_special_tokens false, ends the sample without its
    text, as vLLM's detokenizer leaves it out; include_stop_str_in_output keeps it. A stream
    (its text decoded by the server, not the engine) says the same."""
    forced = {"1000": 100}  # token 1000 (not special) first, whatever the weights
    prompt = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": HI}
    for ends, extra in (("stop_token_ids", {"stop_token_ids": [1000]}),
                        ("eos", {"logit_bias": {"2": 100}, "skip_special_tokens": False})):
        base = {**prompt, "max_tokens": 4, "ignore_eos": False, "temperature": 0,
                "logit_bias": forced, **extra}
        for keep in (False, True):
            body = {**base, "include_stop_str_in_output": keep}
            out = post(server, path, **body).json()["choices"][0]
            text = out["text"] if "text" in out else out["message"]["content"]
            assert out["finish_reason"] == "stop", (ends, keep)
            assert (text != "") == keep, (ends, keep, text)
            assert _streamed_text(server, path, body) == text, (ends, keep)


def test_stop_reason_in_choices_and_the_final_chunk(server):
    """vLLM's stop_reason: the stop token id or string that ended a "stop", else null."""
    first = completion(server, prompt="Hello", temperature=0, logprobs=0,
                       return_tokens_as_token_ids=True)
    token = token_ids(first["choices"][0])[0]
    assert first["choices"][0]["stop_reason"] is None  # length
    by_token = completion(server, prompt="Hello", temperature=0, stop_token_ids=[token])
    assert by_token["choices"][0]["stop_reason"] == token
    assert by_token["choices"][0]["text"] == ""  # a stop token's text is not shown (vLLM's)
    kept = completion(server, prompt="Hello", temperature=0, stop_token_ids=[token],
                      include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept != "" and first["choices"][0]["text"].startswith(kept)
    text = completion(server, prompt="Hello", temperature=0)["choices"][0]["text"]
    stop = text[1:3]
    by_text = completion(server, prompt="Hello", temperature=0, stop=[stop])["choices"][0]
    assert (by_text["finish_reason"], by_text["stop_reason"]) == ("stop", stop)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": "Hello", "temperature": 0, "stop": [stop], "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop


def test_a_requests_chat_template_is_refused_and_unknown_fields_are_logged(server):
    for body in ({"chat_template": "{{ messages }}"},
                 {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}):
        for path in ("/v1/chat/completions", "/tokenize"):
            err = openai_error(post(server, path, messages=HI, max_tokens=1, **body), 400)
            assert err["param"] == "chat_template"
            assert "--trust-request-chat-template is not set" in err["message"]
    # Asking nothing of a refused field is fine; a field no one knows is dropped, and logged.
    completion(server, prompt="x", use_beam_search=False, priority=0, bad_words=[],
               no_such_field=1)
    assert "fields ignored in a request: 'no_such_field'" in server.output()


def test_null_means_the_default(server):
    """OpenAI documents its optional fields "or null", and vLLM takes null for n, stream,
    echo, logprobs and parallel_tool_calls: the default, not a 400."""
    nulls = {"n": None, "stream": None, "logprobs": None, "parallel_tool_calls": None,
             "ignore_eos": None}
    r = post(server, "/v1/chat/completions", messages=HI, max_tokens=3, **nulls)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    body = completion(server, prompt="Hi there", echo=None, stream=None, n=None)
    assert len(body["choices"]) == 1 and not body["choices"][0]["text"].startswith("Hi")
    # max_tokens: completions' default (16) on completions, as vLLM and OpenAI read it;
    # up to the context length on chat, where that is the default
    short = completion(server, prompt="Hi there", max_tokens=None, ignore_eos=True)["usage"]
    assert short["completion_tokens"] == 16
    long = post(server, "/v1/chat/completions", messages=HI, max_tokens=None,
                ignore_eos=True).json()["usage"]
    assert long["prompt_tokens"] + long["completion_tokens"] == 128


def test_echo_offsets_leave_out_the_bos_a_text_does_not_hold(server):
    """Echo with logprobs of a text prompt: the BOS the tokenizer added is listed first but
    takes no room in the echoed text; ids echo with it written."""
    text = "Hi there"
    choice = completion(server, prompt=text, echo=True, logprobs=0, max_tokens=2)["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(text) and lp["text_offset"][:2] == [0, 0]
    for token, offset in list(zip(lp["tokens"], lp["text_offset"], strict=True))[1:3]:
        assert choice["text"][offset:].startswith(token), (token, offset)
    ids = post(server, "/tokenize", prompt=text).json()["tokens"]
    echoed = completion(server, prompt=ids, echo=True, max_tokens=1)["choices"][0]["text"]
    assert echoed.startswith(lp["tokens"][0]) and text in echoed


def test_a_model_without_a_chat_template_is_a_400(tmp_path_factory, tiny_llama_dir):
    """vLLM's 400, with or without tools (the tools check asked the template: a 500)."""
    path = tmp_path_factory.mktemp("no-template")
    for file in tiny_llama_dir.iterdir():
        shutil.copy(file, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tools = [{"type": "function", "function": {"name": "ping"}}]
    with RemoteServer("--model", str(path), "--max-model-len", "128") as srv:
        for extra in ({}, {"tools": tools, "tool_choice": "none"}, {"tools": tools}):
            r = post(srv, "/v1/chat/completions", messages=HI, max_tokens=2, **extra)
            assert "no chat template" in openai_error(r, 400)["message"], extra


def test_text_offsets_with_token_ids_are_those_of_the_text(server):
    """return_tokens_as_token_ids names tokens by id, but text_offset still counts the text:
    with echo the generated tokens' offsets go on from the prompt's as without the flag
    (they had advanced by each "token_id:N" string's length)."""
    body = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "echo": True,
            "logprobs": 0}
    plain = completion(server, **body)["choices"][0]["logprobs"]["text_offset"]
    by_id = completion(server, **body, return_tokens_as_token_ids=True)
    assert by_id["choices"][0]["logprobs"]["text_offset"] == plain


def test_echoed_prompt_top_logprobs_hold_logprobs_k_not_prompt_logprobs_k(server):
    """echo with logprobs 1 and prompt_logprobs 4: the echoed prompt's top_logprobs hold
    the top 1 and the token itself (as the generated tokens' do), while vLLM's
    prompt_logprobs hold the top 4 (and the token)."""
    out = completion(server, prompt="The quick brown fox jumps over", echo=True, logprobs=1,
                     prompt_logprobs=4, max_tokens=2)
    choice = out["choices"][0]
    n_prompt = out["usage"]["prompt_tokens"]
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and len(tops) == n_prompt + 2
    assert all(1 <= len(t) <= 2 for t in tops[1:]), tops[1:n_prompt]
    vllm = choice["prompt_logprobs"]
    assert vllm[0] is None and all(4 <= len(e) <= 5 for e in vllm[1:]), vllm[1:]
