"""What a response body holds (server/responses.py, server/logprobs.py), on a real
`pagedserve serve` with the embedded SmolLM2-135M, greedy: each prompt's choice at its
index, a tool call the output never closed, completions' logprobs (the sampled token in
top_logprobs, text offsets, a grammar's forbidden tokens floored), chat logprobs' bytes, a
stream cut inside a character, and a beam search's special tokens."""

from __future__ import annotations

import httpx
import pytest
from test_server_utils import RemoteServer, sse_events

TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What time is it in Oslo?"}]


@pytest.fixture(scope="module")
def url():
    srv = RemoteServer()
    try:
        srv.wait_ready()
        yield srv.url
    finally:
        srv.stop()


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json={"temperature": 0, **body}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_prompts_choice_keeps_its_index_when_a_later_prompt_finishes_first(url):
    """Several prompts in one non-streamed completion: choice i is prompt i's, whichever of
    them finished first (the outputs are gathered in prompt order, not arrival order)."""
    prompts = ["The capital of France is Paris. The capital of Germany is",
               "Once upon a time, in a small village by the sea, there lived"]
    alone = [_post(url, "/v1/completions", {"prompt": p, "max_tokens": 16})
             ["choices"][0]["text"] for p in prompts]
    # A stop word early in the second prompt's output and nowhere in the first's: the
    # second finishes steps before the first.
    words = [w for w in alone[1].split() if len(w) >= 3 and w not in alone[0]]
    assert words and alone[1].find(words[0]) < len(alone[1]) // 2  # (greedy: always so)
    stop = words[0]
    expect = [_post(url, "/v1/completions", {"prompt": p, "max_tokens": 16, "stop": [stop]})
              ["choices"][0]["text"] for p in prompts]
    assert len(expect[1]) < len(expect[0])  # the premise: the second ends first
    out = _post(url, "/v1/completions", {"prompt": prompts, "max_tokens": 16, "stop": [stop]})
    by_index = {c["index"]: c["text"] for c in out["choices"]}
    assert by_index == {0: expect[0], 1: expect[1]}


def test_a_tool_call_the_output_never_closes_is_still_a_call(url):
    """auto tool choice, non-streamed: an output that ends inside <tool_call> (no closing
    tag: the model stopped there) is read as the call it holds, as a stream reads it."""
    forced = r'<tool_call>\n\{"name": "get_time", "arguments": \{"city": "Oslo"\}\}'
    out = _post(url, "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 60,
        "guided_regex": forced})
    choice = out["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", '{"city": "Oslo"}')], choice
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None


def test_completion_top_logprobs_of_tokens_a_grammar_forbids_are_floored(url):
    """A constrained completion's logprobs are of the distribution its grammar allows, where
    a forbidden token's logprob is -inf: JSON has none, so each is -9999.0 (vLLM's floor),
    never a 500 for a body that cannot be encoded."""
    out = _post(url, "/v1/completions", {"prompt": "Pick a digit:", "max_tokens": 2,
                                         "logprobs": 5, "guided_choice": ["1", "2"]})
    lp = out["choices"][0]["logprobs"]
    values = [v for top in lp["top_logprobs"] for v in top.values()]
    assert len(values) >= 5 and -9999.0 in values
    assert all(v >= -9999.0 for v in values + lp["token_logprobs"])
    chat = _post(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2,
                                               "logprobs": True, "top_logprobs": 5,
                                               "guided_choice": ["1", "2"]})
    tops = [t["logprob"] for e in chat["choices"][0]["logprobs"]["content"]
            for t in e["top_logprobs"]]
    assert len(tops) >= 5 and -9999.0 in tops and min(tops) >= -9999.0


def test_completion_top_logprobs_hold_the_sampled_token(url):
    """Legacy completions' top_logprobs hold the top k and the sampled token (vLLM's):
    with logprobs 0, each is the sampled token alone."""
    out = _post(url, "/v1/completions", {"prompt": "The sky is", "max_tokens": 4,
                                         "logprobs": 0})
    lp = out["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"],
                                                         strict=True)]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_text_offsets_advance_by_each_tokens_text(url, stream):
    """text_offset: where each generated token starts in the choice's text (OpenAI's), so
    each advances by the previous token's length, streamed or not."""
    body = {"temperature": 0, "prompt": "The history of the printing press",
            "max_tokens": 8, "logprobs": 1, "stream": stream}
    if not stream:
        lp = _post(url, "/v1/completions", body)["choices"][0]["logprobs"]
        tokens, offsets = lp["tokens"], lp["text_offset"]
    else:
        tokens, offsets = [], []
        for c in _streamed_choices(url, body):
            if c["logprobs"]:
                tokens += c["logprobs"]["tokens"]
                offsets += c["logprobs"]["text_offset"]
    assert len(tokens) == 8 and any(len(t) > 1 for t in tokens)
    expect = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert offsets == expect


def test_chat_logprobs_bytes_spell_a_character_split_over_tokens(url):
    """Chat logprobs' bytes are each token's own UTF-8 bytes (OpenAI's), so that a client
    joins a character split over several tokens: never the replacement character's."""
    text = "\U0001d538\ua66e"  # two characters with no token of their own
    out = _post(url, "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 12, "logprobs": True, "top_logprobs": 2,
        "guided_choice": [text]})
    entries = out["choices"][0]["logprobs"]["content"]
    assert out["choices"][0]["message"]["content"] == text
    assert len(entries) > 2  # the premise: the characters are split
    assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()


def _streamed_choices(url: str, body: dict) -> list[dict]:
    """Every choice of a streamed completion's chunks, in order."""
    with httpx.stream("POST", url + "/v1/completions", timeout=180,
                      json={"temperature": 0, **body, "stream": True}) as r:
        return [c for e in sse_events(r.iter_lines()) if isinstance(e, dict)
                for c in e["choices"]]


def test_a_stream_cut_inside_a_character_ends_as_the_whole_response_does(url):
    """A stream's text (decoded by the server as its tokens arrive) ends as the non-streamed
    text does when max_tokens cuts a character short: its bytes so far, as decoded whole."""
    text = "\U0001d538\ua66e"
    cut = None
    for k in range(1, 6):
        body = {"prompt": "Say it:", "max_tokens": k, "guided_choice": [text]}
        whole = _post(url, "/v1/completions", body)["choices"][0]["text"]
        if whole.endswith("\ufffd"):
            cut = body, whole
            break
    assert cut is not None  # the premise: some max_tokens cuts a character
    assert "".join(c["text"] for c in _streamed_choices(url, cut[0])) == cut[1]


def test_a_beam_searchs_text_shows_special_tokens_only_where_asked(url):
    """A beam's text is decoded under the request's skip_special_tokens, as a sample's is:
    past its <|im_end|> (ignore_eos), the model writes the next turn's tags."""
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    body = {"prompt": prompt, "use_beam_search": True, "n": 2, "max_tokens": 12,
            "ignore_eos": True}
    shown = _post(url, "/v1/completions", {**body, "skip_special_tokens": False})["choices"]
    hidden = _post(url, "/v1/completions", body)["choices"]
    assert any("<|im_end|>" in c["text"] for c in shown), shown
    assert [c["text"] for c in hidden] == [
        c["text"].replace("<|im_end|>", "").replace("<|im_start|>", "") for c in shown]
