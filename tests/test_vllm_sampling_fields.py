"""vLLM's request fields that shape sampling, caching and scheduling, on a real server (the
tiny Llama, under --scheduling-policy priority): bad_words, cache_salt, return_token_ids
and priority, each against what it must change and what vLLM refuses."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server_utils import RemoteServer, openai_error
from test_vllm_fields import HI, completion, post, token_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with RemoteServer("--model", str(tiny_llama_dir), "--max-model-len", "128",
                      "--scheduling-policy", "priority") as srv:
        yield srv


def _streamed_text(server, path: str, body: dict) -> str:
    chunks = _stream_chunks(server, path, body)
    return "".join(c["choices"][0]["text"] if "text" in c["choices"][0]
                   else c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_bad_words_keep_a_word_out_streamed_or_not(server):
    """" Paris" forced first by logit_bias, unless bad_words bans "Paris" (both as it starts a
    text and after a space): then another token comes first, on either endpoint, streamed
    or not. What vLLM refuses is a 400 naming bad_words, the server's check or the
    engine's (a word past the tokens vLLM allows)."""
    paris, bare = 7042, 38634  # " Paris" and "Paris" in the embedded model's vocabulary
    forced = {"logit_bias": {str(paris): 100}, "temperature": 0, "max_tokens": 3,
              "logprobs": 0, "return_tokens_as_token_ids": True}
    assert token_ids(completion(server, prompt="x", **forced)["choices"][0])[0] == paris
    for path, body in (("/v1/completions", {"prompt": "x", **forced}),
                       ("/v1/chat/completions", {"messages": HI, **forced, "logprobs": True})):
        body = {**body, "ignore_eos": True, "bad_words": ["Paris"]}
        choice = post(server, path, **body).json()["choices"][0]
        assert token_ids(choice)[0] not in (paris, bare)
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert _streamed_text(server, path, body) == text
        for words, where in (([""], "empty string"),
                             ([f"w{i}" for i in range(129)], "after tokenization: 129"),
                             ([" x" * 600], "Too many total bad word tokens")):
            err = openai_error(post(server, path, **{**body, "bad_words": words}), 400)
            assert err["param"] == "bad_words" and where in err["message"], err


def test_cache_salt_keeps_prefix_hits_within_a_salt(server):
    """vLLM's cache_salt: a prompt's cached blocks are hit by requests with the same salt
    only (usage's cached_tokens says so); the answer is the same whatever the salt. A salt
    vLLM refuses is a 400."""
    prompt = "Salted prefix, told once and then again. " * 4  # (several 16-token blocks)

    def cached(path: str, **salt) -> tuple[int, str]:
        body = ({"prompt": prompt} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": prompt}]})
        r = post(server, path, **body, max_tokens=3, temperature=0, **salt)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return (r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                choice["text"] if "text" in choice else choice["message"]["content"])

    for path in ("/v1/completions", "/v1/chat/completions"):
        a = {"cache_salt": "tenant-a" + path.replace("/", "-")}  # (one prompt an endpoint)
        first, text = cached(path, **a)
        assert first == 0
        hits = [cached(path, **a), cached(path, cache_salt="tenant-b"), cached(path),
                cached(path), cached(path, **a)]
        assert [n > 0 for n, _ in hits] == [True, False, False, True, True], hits
        assert {t for _, t in hits} == {text}
        for salt in ("", "x" * 129, "a/b", "a@b", 5):
            err = openai_error(post(server, path, prompt="x", messages=HI, max_tokens=1,
                                    cache_salt=salt), 400)
            assert err["param"] == "cache_salt" or salt == 5


def _stream_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_streamed_or_not(server):
    """vLLM's return_token_ids: the prompt's ids (each completions choice's; chat's body)
    and each choice's output ids, the very tokens its logprobs name and usage counts. A
    stream sends the prompt's ids in a choice's first chunk (chat: its role chunk) and each
    chunk's new ids, which add up to the whole, tokens held back with their text (a stop
    string's, here) included."""
    prompts = ["Hello there", "One two three"]
    tokenized = [post(server, "/tokenize", prompt=p).json()["tokens"] for p in prompts]
    chat_ids = post(server, "/tokenize", messages=HI).json()["tokens"]
    common = {"max_tokens": 8, "temperature": 0, "return_token_ids": True,
              "return_tokens_as_token_ids": True, "ignore_eos": True}
    out = completion(server, prompt=prompts, n=2, logprobs=0, **common)
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == tokenized[choice["index"] // 2]
        assert choice["token_ids"] == token_ids(choice) and len(choice["token_ids"]) == 8
    # A long stop string never met: the text that could begin it is held back, so early
    # tokens come in deltas without text.
    stop = "a stop string longer than the text of eight tokens, never met"
    for path, body in (("/v1/completions", {"prompt": prompts[0]}),
                       ("/v1/chat/completions", {"messages": HI})):
        body = {**body, **common, "stop": [stop] if path == "/v1/completions" else None}
        whole = post(server, path, **body).json()
        choice = whole["choices"][0]
        if path == "/v1/completions":
            assert choice["prompt_token_ids"] == tokenized[0]
        else:
            assert whole["prompt_token_ids"] == chat_ids and "prompt_token_ids" not in choice
        assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] > 0
        chunks = _stream_chunks(server, path, body)
        streamed = [i for c in chunks for i in c["choices"][0].get("token_ids", [])]
        assert streamed == choice["token_ids"]
        with_prompt = [c for c in chunks if "prompt_token_ids" in c
                       or "prompt_token_ids" in c["choices"][0]]
        assert with_prompt == chunks[:1]
    plain = completion(server, prompt=prompts[0], max_tokens=2)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_priority_under_the_priority_policy(server):
    """--scheduling-policy priority: a request's priority (any 64-bit integer, lower first)
    is taken on both endpoints, from vLLM's X-Vllm-Priority header where that is an
    integer (it wins over the body's); a body's that is no integer is a 400."""
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": HI})):
        for priority in (-5, 0, 3):
            r = post(server, path, **body, max_tokens=2, priority=priority)
            assert r.status_code == 200, r.text
        openai_error(post(server, path, **body, max_tokens=2, priority="high"), 400)
        for header, status in (("2", 200), ("soon", 200), (str(2**70), 400)):
            r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "priority": 1},
                           headers={"X-Vllm-Priority": header}, timeout=60)
            assert r.status_code == status, (header, r.text)
        assert openai_error(r, 400)["param"] == "priority"  # (the header's number was read)


def test_logprob_token_ids_in_vllm_shapes(server):
    """vLLM's logprob_token_ids: each generated token's alternatives are the sampled token,
    then the asked ids once each in the order asked (the top k, logprobs' or top_logprobs'
    number, not shown), in each endpoint's shape, streamed or not; the prompt's echo keeps
    its top k. What vLLM refuses is a 400 naming the field, in its words."""
    a, b = 7042, 260
    common = {"temperature": 0, "max_tokens": 3, "ignore_eos": True,
              "return_tokens_as_token_ids": True, "logprob_token_ids": [a, b, a]}
    for path, body in (("/v1/completions", {"prompt": "x", "logprobs": 2}),
                       ("/v1/chat/completions", {"messages": HI, "logprobs": True,
                                                 "top_logprobs": 2})):
        body = {**body, **common}
        choice = post(server, path, **body).json()["choices"][0]
        lps = choice["logprobs"]
        if path == "/v1/completions":
            tops = [list(top.items()) for top in lps["top_logprobs"]]
            chosen = lps["token_logprobs"]
        else:
            tops = [[(t["token"], t["logprob"]) for t in e["top_logprobs"]]
                    for e in lps["content"]]
            chosen = [e["logprob"] for e in lps["content"]]
        sampled = [f"token_id:{i}" for i in token_ids(choice)]
        for top, token, value in zip(tops, sampled, chosen, strict=True):
            assert [t for t, _ in top] == list(dict.fromkeys(
                [token, f"token_id:{a}", f"token_id:{b}"]))
            assert top[0][1] == value
        # the values are the distribution's: b's alone agree
        alone = post(server, path, **{**body, "logprob_token_ids": [b]}).json()["choices"][0]
        chunks = _stream_chunks(server, path, body)
        streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]
                    and c["choices"][0].get("logprobs")]
        if path == "/v1/completions":
            assert [top[f"token_id:{b}"] for top in alone["logprobs"]["top_logprobs"]] == [
                dict(top)[f"token_id:{b}"] for top in tops]
            assert [t for s in streamed for t in s["top_logprobs"]] == lps["top_logprobs"]
        else:
            assert [e["top_logprobs"][-1]["logprob"] for e in alone["logprobs"]["content"]] \
                == [dict(top)[f"token_id:{b}"] for top in tops]
            assert [e for s in streamed for e in s["content"]] == lps["content"]
    # echo: the prompt's positions keep logprobs' top k, the generated ones the asked ids
    echoed = completion(server, prompt="a b c", echo=True, logprobs=1, **common)["choices"][0]
    tops = echoed["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(t) <= 2 for t in tops[1:-3])
    assert all(f"token_id:{b}" in t for t in tops[-3:])
    best = completion(server, prompt="x", **{**common, "temperature": 1.0}, seed=1, logprobs=0,
                      best_of=3)["choices"][0]  # (ranked by the samples' own logprobs)
    assert all(f"token_id:{b}" in t for t in best["logprobs"]["top_logprobs"])
    plain = completion(server, prompt="x", **{**common, "logprob_token_ids": []}, logprobs=1)
    assert all(len(t) == 1 for t in plain["choices"][0]["logprobs"]["top_logprobs"])
    refusals = [
        ("/v1/completions", {"prompt": "x"}, "`logprobs` must be set."),
        ("/v1/completions", {"prompt": "x", "logprobs": 0, "echo": True, "max_tokens": 0},
         "not supported when `echo=True` and `max_tokens=0`"),
        ("/v1/chat/completions", {"messages": HI, "logprobs": False},
         "`logprobs` must be set to true."),
        ("/v1/chat/completions", {"messages": HI, "logprobs": True,
                                  "logprob_token_ids": list(range(129))},
         "Requested logprob_token_ids of length 129, which is greater than max allowed: 128"),
        ("/v1/completions", {"prompt": "x", "logprobs": 1, "logprob_token_ids": [3, 10**6, -1]},
         "token_id(s) [1000000, -1] in logprob_token_ids contain out-of-vocab token ids. "
         "Vocabulary size: "),
    ]
    for path, body, words in refusals:
        err = openai_error(post(server, path, **{"logprob_token_ids": [a], **body}), 400)
        assert err["param"] == "logprob_token_ids" and words in err["message"], err
