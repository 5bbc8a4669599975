"""--reasoning-parser on a real server: a thinking model's chat answer comes as vLLM shapes
it, its thinking in the message's (or the delta's) "reasoning", the rest in "content", and
usage counting the thinking's tokens. The model is scripted (tests/scripted_model.py): a
real Llama checkpoint whose greedy answer is "<think>Let me see.</think> Hi there!"."""

from __future__ import annotations

import json

import httpx
import pytest
from scripted_model import save_scripted_llama, script_of, with_added_tokens
from test_server_utils import RemoteServer

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hi"}]
GREEDY = {"messages": HI, "temperature": 0, "max_tokens": 20}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tiny_llama) -> str:
    tokenizer = with_added_tokens(tiny_llama.tokenizer, ["<think>", "</think>"])
    path = tmp_path_factory.mktemp("scripted-thinker-server")
    prompt = tokenizer.encode_chat(HI)
    save_scripted_llama(path, tokenizer, script_of(
        tokenizer, prompt[-1], "<think>Let me see.</think> Hi there!",
        tokenizer.eos_token_ids[0]))
    return str(path)


@pytest.fixture(scope="module")
def server(thinker):
    with RemoteServer("--model", thinker, "--max-model-len", "512",
                      "--reasoning-parser", "qwen3") as srv:
        yield srv


def _chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={**GREEDY, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _deltas(server, **body) -> tuple[list[dict], dict]:
    body = {**GREEDY, **body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]], chunks[-1]["usage"]


def test_the_thinking_is_the_reasoning_streamed_or_not(server):
    whole = _chat(server)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": " Hi there!",
                                              "reasoning": "Let me see."}
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    deltas, usage = _deltas(server)
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) <= {"reasoning", "content"} and d for d in deltas[1:-1])
    assert "".join(d.get("reasoning", "") for d in deltas) == "Let me see."
    assert "".join(d.get("content", "") for d in deltas) == " Hi there!"
    # the thinking first (deltas that piled up while the client was away come joined)
    kinds = [key for d in deltas[1:] for key in d]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and len(set(kinds)) == 2
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}
    two = _chat(server, n=2)  # every choice's thinking counts
    assert two["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}


def test_no_thinking_asked_or_shown(server):
    """enable_thinking false (qwen3's template variable): the answer is all content, tags
    and all, as vLLM's qwen3 parser reads it; include_reasoning false: the thinking is left
    out of the answer, streamed or not."""
    off = _chat(server, chat_template_kwargs={"enable_thinking": False})["choices"][0]
    assert off["message"]["content"] == "<think>Let me see.</think> Hi there!"
    assert off["message"]["reasoning"] is None
    hidden = _chat(server, include_reasoning=False)["choices"][0]["message"]
    assert hidden["reasoning"] is None and hidden["content"] == " Hi there!"
    deltas, _ = _deltas(server, include_reasoning=False)
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == " Hi there!"
    # nor do its tokens, through logprobs or ids (vLLM's)
    shown = {"logprobs": True, "return_token_ids": True}
    assert _chat(server, **shown)["choices"][0]["logprobs"] is not None
    choice = _chat(server, **shown, include_reasoning=False)["choices"][0]
    assert choice["logprobs"] is None and "token_ids" not in choice


def test_a_response_format_constrains_the_answer_after_the_thinking(server):
    """The thinking is unconstrained and the JSON starts after it; with include_reasoning
    false the JSON starts at once (vLLM's reasoning_ended)."""
    fmt = {"response_format": {"type": "json_object"}, "max_tokens": 12}
    message = _chat(server, **fmt)["choices"][0]["message"]
    assert message["reasoning"] == "Let me see." and message["content"].startswith("{")
    at_once = _chat(server, **fmt, include_reasoning=False)["choices"][0]["message"]
    assert at_once["reasoning"] is None and at_once["content"].startswith("{")
    deltas, _ = _deltas(server, **fmt)
    assert "".join(d.get("reasoning", "") for d in deltas) == "Let me see."
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    # a prompt that opened the thinking, with its budget spent: a JSON constrained from its
    # first token gets no </think> forced into it (it made the answer an error)
    opened = {"messages": [*HI, {"role": "assistant", "content": "<think>Let"}],
              "add_generation_prompt": False, "continue_final_message": True}
    spent = _chat(server, **fmt, **opened, include_reasoning=False, thinking_token_budget=1)
    assert spent["choices"][0]["message"]["content"].startswith("{")
    assert spent["choices"][0]["finish_reason"] == "length"


def test_a_thinking_token_budget_cuts_the_thinking_on_both_endpoints(server, tiny_llama_dir):
    """vLLM's thinking_token_budget: the thinking ends after that many tokens, then the
    answer; a bad value, or a server without a reasoning parser, is a 400 naming it."""
    message = _chat(server, thinking_token_budget=2)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": " Hi there!", "reasoning": "Let me"}
    prompt = httpx.post(server.url + "/tokenize", json={"messages": HI}).json()["tokens"]
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": prompt, "temperature": 0, "max_tokens": 20, "thinking_token_budget": 1})
    assert r.json()["choices"][0]["text"] == "<think>Let</think> Hi there!"
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={**GREEDY, "thinking_token_budget": -5}).json()["error"]
    assert bad["param"] == "thinking_token_budget" and "-1 for unlimited" in bad["message"]
    with RemoteServer("--model", str(tiny_llama_dir), "--max-model-len", "128") as plain:
        r = httpx.post(plain.url + "/v1/chat/completions", json={
            **GREEDY, "max_tokens": 2, "thinking_token_budget": 8})
        assert r.status_code == 400 and "no reasoning parser" in r.json()["error"]["message"]


def test_a_required_tool_call_follows_the_thinking(server):
    """tool_choice required: the thinking runs free, then the calls' schema takes the answer
    (the scripted model's own tokens are not JSON: the grammar writes the one call the
    schema leaves); the calls are read from the content after the thinking."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
    choice = _chat(server, tools=tools, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=40)["choices"][0]
    message = choice["message"]
    assert message["reasoning"] == "Let me see." and not message["content"]
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "f", "arguments": "{}"}]
    assert choice["finish_reason"] == "tool_calls"


def test_a_servers_default_template_kwargs_sit_under_the_requests(thinker):
    """--default-chat-template-kwargs (vLLM's flag): every request's template gets them,
    under its own chat_template_kwargs; names the server sets itself are refused at start."""
    model = thinker
    with RemoteServer("--model", model, "--max-model-len", "512", "--reasoning-parser",
                      "qwen3", "--default-chat-template-kwargs",
                      '{"enable_thinking": false}', "--stream-interval", "3") as off:
        message = _chat(off)["choices"][0]["message"]
        assert message["reasoning"] is None and message["content"].startswith("<think>")
        asked = _chat(off, chat_template_kwargs={"enable_thinking": True})["choices"][0]
        assert asked["message"]["reasoning"] == "Let me see."
        # three tokens a delta (or more, joined; the first alone): one holds the thinking's
        # end and the answer's start, both kept
        deltas, _ = _deltas(off, chat_template_kwargs={"enable_thinking": True})
        assert any("reasoning" in d and "content" in d for d in deltas), deltas
        assert "".join(d.get("content", "") for d in deltas) == " Hi there!"
    bad = RemoteServer("--model", model, "--default-chat-template-kwargs", '{"messages": []}')
    assert bad.proc.wait(timeout=60) != 0 and "may not set ['messages']" in bad.output()
