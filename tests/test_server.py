"""The OpenAI-compatible server against a real `pagedserve serve` with the embedded model."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from test_server_utils import (
    LOOP_FLAGS,
    RemoteServer,
    generate_outputs,
    metrics,
    run_generate,
    sse_events,
    wait_kv_free,
)

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
# Long enough for several full 16-token blocks, so a repeat hits the prefix cache.
LONG_PROMPT = ("Paged attention stores the key and value vectors of every token in fixed-size "
               "blocks, and a block table maps each sequence's logical blocks to physical ones. "
               "Explain why this helps:")


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request):
    """The engine loop in a thread of the server (the CPU's default), then in a process of
    its own (the GPU's)."""
    # Start the CLI reference run beside the server so both load the model at once.
    cli = run_generate("--temperature", "0", "--max-tokens", "8", PROMPT)
    srv = RemoteServer(LOOP_FLAGS[request.param])
    try:
        srv.wait_ready()
        srv.cli = cli
        yield srv
    finally:
        if cli.poll() is None:
            cli.kill()
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def post(server, path: str, body: dict | str, **kw) -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(server.url + path, content=body,
                          headers={"Content-Type": "application/json"}, timeout=120, **kw)
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def stream(server, path: str, body: dict) -> list[dict | str]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(r.iter_lines()))


# ---- 1. the openai SDK, and greedy output equal to the offline CLI ----------------------------
def test_completions_greedy_matches_cli(server, client, model):
    (offline,) = generate_outputs(server.cli)
    reference = offline["outputs"][0]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == reference["text"]
    assert out.choices[0].finish_reason == reference["finish_reason"]
    assert out.usage.completion_tokens == len(reference["token_ids"])
    assert out.usage.prompt_tokens == len(offline["prompt_token_ids"])

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["text"]
    assert chunks[-1].choices[0].finish_reason == reference["finish_reason"]


def test_chat_sync_async_stream_agree(server, client, model):
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "Say hello."}]
    sync = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                          temperature=0)
    text = sync.choices[0].message.content
    assert sync.choices[0].message.role == "assistant" and text

    async def run_async() -> tuple[str, list]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        plain = await aclient.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0)
        chunks = [c async for c in await aclient.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        await aclient.close()
        return plain.choices[0].message.content, chunks

    plain, chunks = asyncio.run(run_async())
    assert plain == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        sync.usage.completion_tokens
    # The chat template renders the same tokens /tokenize reports; the same ids through
    # /v1/completions give the same greedy text.
    ids = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert len(ids) == sync.usage.prompt_tokens
    same = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert same.choices[0].text == text


def test_chat_content_parts_and_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_completion_logprobs_echo_and_stop(server, client, model):
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     logprobs=2, echo=True)
    choice = base.choices[0]
    assert choice.text.startswith(PROMPT)
    # echo shows the prompt's tokens too, the first without a logprob (as OpenAI does).
    lp, p = choice.logprobs, base.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == p + 8
    assert "".join(lp.tokens[:p]) == PROMPT and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[p] == len(PROMPT)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    generated = choice.text[len(PROMPT):]
    events = stream(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                                "temperature": 0, "logprobs": 2, "echo": True})
    first = events[0]["choices"][0]
    assert first["text"].startswith(PROMPT) and first["logprobs"]["text_offset"][p] == len(PROMPT)
    assert first["logprobs"]["token_logprobs"][: p] == lp.token_logprobs[:p]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice.text
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events[:-1]) == p + 8
    # A stop string cuts the text before it, streamed or not.
    middle = len(generated) // 2
    stop = generated[middle : middle + 3]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == generated[: generated.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    events = stream(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                                "temperature": 0, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut.choices[0].text


def test_echo_with_max_tokens_0_scores_the_prompt(server):
    """OpenAI's (and vLLM's) echo with max_tokens 0: the prompt alone, with its logprobs (the
    first none), no completion tokens; streamed too. Were silently empty logprobs."""
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "temperature": 0}
    scored = post(server, "/v1/completions", {**body, "max_tokens": 0}).json()
    one = post(server, "/v1/completions", {**body, "max_tokens": 1}).json()["choices"][0]
    (choice,) = scored["choices"]
    n = scored["usage"]["prompt_tokens"]
    assert choice["text"] == PROMPT and scored["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"] == one["logprobs"]["token_logprobs"][:n]  # the prompt's
    events = stream(server, "/v1/completions", {**body, "max_tokens": 0})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == PROMPT


def test_echo_keeps_the_prompts_special_tokens(server):
    """A chat-formatted prompt echoes with its special tokens, sent as text or as ids (vLLM
    echoes ids as their decode, specials kept), and each prompt token's text_offset points
    at its text in the echo. Ids echoed without them; a text's offsets skipped them."""
    text = "<|im_start|>user\nThe capital<|im_end|>\n"
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    for prompt in (text, ids):
        body = {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 2,
                "temperature": 0}
        choice = post(server, "/v1/completions", body).json()["choices"][0]
        assert choice["text"].startswith(text), prompt
        tokens, offsets = (choice["logprobs"][k][:len(ids)] for k in ("tokens", "text_offset"))
        pieces = [choice["text"][o:o + len(t)] for o, t in zip(offsets, tokens, strict=True)]
        assert pieces == tokens


def test_prompt_logprobs(server, client, model):
    """vLLM's prompt_logprobs: per prompt token (after the first) its id, logprob and rank,
    plus the top k; the same logprobs echo shows. Chat carries it once, at the top level."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    ids = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                     logprobs=0, echo=True).choices[0].logprobs
    for i, entry in enumerate(plp[1:], 1):
        mine = entry[str(ids[i])]
        assert mine["rank"] >= 1 and mine["logprob"] <= 0
        assert mine["logprob"] == pytest.approx(echo.token_logprobs[i], abs=1e-4)
        top = sorted((e for e in entry.values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2]
        assert top[0]["logprob"] >= top[1]["logprob"] and top[0]["logprob"] >= mine["logprob"]
    # n choices of a prompt each carry its prompt_logprobs (encoded once, spliced into each),
    # and with echo each choice's logprobs begin with the prompt's
    other = "Other words here"
    many = post(server, "/v1/completions", {**body, "n": 3, "prompt": [PROMPT, other],
                                            "logprobs": 0, "echo": True}).json()["choices"]
    assert [c["index"] for c in many] == list(range(6))
    assert all(c["prompt_logprobs"] == plp for c in many[:3])
    assert len(many[3]["prompt_logprobs"]) == len(
        post(server, "/tokenize", {"prompt": other}).json()["tokens"])
    assert all(c["prompt_logprobs"] == many[3]["prompt_logprobs"] for c in many[3:])
    for c in many[:3]:
        assert c["text"].startswith(PROMPT)
        assert c["logprobs"]["tokens"][: len(ids)] == echo.tokens[: len(ids)]
        assert c["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(
            echo.token_logprobs[1 : len(ids)], abs=1e-4)
    chat = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    r = post(server, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert wait_kv_free(server.url) == 0


def test_multibyte_text_never_split(server):
    body = {"prompt": "请用中文介绍一下巴黎。", "max_tokens": 12, "temperature": 0}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    events = stream(server, "/v1/completions", body)
    deltas = [e["choices"][0]["text"] for e in events[:-1]]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == whole


# ---- 2. n = 4, and lists of prompts -------------------------------------------------------------
def test_n4_streaming_choices_and_usage(server):
    body = {"prompt": PROMPT, "n": 4, "max_tokens": 5, "temperature": 0.9, "seed": 7,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = stream(server, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    usage_event = events[-2]
    assert usage_event["choices"] == []
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for e in events[:-2]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"]:
            assert c["index"] not in finishes
            finishes[c["index"]] = c["finish_reason"]
    assert sorted(texts) == [0, 1, 2, 3] and finishes == dict.fromkeys(range(4), "length")
    usage = usage_event["usage"]
    prompt_len = post(server, "/tokenize", {"prompt": PROMPT}).json()["count"]
    assert usage["prompt_tokens"] == prompt_len  # counted once, not n times
    assert usage["completion_tokens"] == 4 * 5
    assert usage["total_tokens"] == prompt_len + 20
    # Seeded samples are reproducible: the same request unstreamed gives the same texts.
    del body["stream_options"]  # only with stream: true (a 400 otherwise, as in vLLM)
    plain = post(server, "/v1/completions", body).json()
    assert {c["index"]: c["text"] for c in plain["choices"]} == texts


def test_continuous_usage_stats_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage
    so far (its own prompt's tokens and its own tokens), after the same id, object, created
    and model fields as the others; the last chunk, the request's total."""
    prompts = ["One two three four", "Red"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = stream(server, "/v1/completions", body)
    assert events[-1] == "[DONE]" and len(events) > 3
    chunks, total = events[:-2], events[-2]
    assert len({(e["id"], e["object"], e["created"], e["model"]) for e in events[:-1]}) == 1
    assert [list(e) for e in events[:-1]] == [["id", "object", "created", "model", "choices",
                                               "usage"]] * (len(events) - 1)
    lens = [post(server, "/tokenize", {"prompt": p}).json()["count"] for p in prompts]
    done: dict[int, list[int]] = {}
    for e in chunks:
        (choice,), used = e["choices"], e["usage"]
        assert used["prompt_tokens"] == lens[choice["index"] // 2]
        assert used["total_tokens"] == used["prompt_tokens"] + used["completion_tokens"]
        done.setdefault(choice["index"], []).append(used["completion_tokens"])
    assert sorted(done) == [0, 1, 2, 3]
    assert all(d == sorted(d) and d[-1] == 4 for d in done.values())
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 16
    assert total["usage"]["prompt_tokens"] == sum(lens)  # each prompt once, as vLLM counts


def test_prompt_list_choices_are_consecutive(server):
    prompts = ["One two three", "Red green"]
    out = post(server, "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 3,
                                           "temperature": 0, "ignore_eos": True}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][0]["text"] == out["choices"][1]["text"]  # greedy samples agree
    lens = [post(server, "/tokenize", {"prompt": p}).json()["count"] for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(lens)
    assert out["usage"]["completion_tokens"] == 4 * 3


# ---- 3. prefix cache ----------------------------------------------------------------------------
def test_repeat_request_hits_prefix_cache(server, client, model):
    before = metrics(server.url)
    first = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2,
                                      temperature=0)
    second = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2,
                                       temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].text == first.choices[0].text
    after = metrics(server.url)
    for name in ("pagedserve_prefix_cache_queried_tokens_total",
                 "pagedserve_prefix_cache_hit_tokens_total"):
        assert after[name] > before.get(name, 0), name


# ---- 4. concurrency and disconnects -------------------------------------------------------------
def test_32_streams_8_disconnect_kv_freed(server):
    async def client_run(i: int, http: httpx.AsyncClient) -> str:
        leave = i % 4 == 0
        body = {"prompt": f"Story number {i}:", "max_tokens": 400 if leave else 6,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if leave and seen >= 2:
                        return "left"  # closes the connection mid-stream
                    if line == "data: [DONE]":
                        return "done"
        return "eof"

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(client_run(i, http) for i in range(32)))

    aborted_before = _aborted(metrics(server.url))
    results = asyncio.run(main())
    assert results.count("left") == 8 and results.count("done") == 24
    assert wait_kv_free(server.url) == 0
    after = metrics(server.url)
    assert _aborted(after) - aborted_before == 8
    assert after["pagedserve_num_requests_running"] == 0
    assert httpx.get(server.url + "/health").status_code == 200
    r = post(server, "/v1/completions", {"prompt": "Still there?", "max_tokens": 2})
    assert r.status_code == 200


def test_non_streaming_disconnect_aborts(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(120, read=1.5),
                   json={"prompt": "A very long story:", "max_tokens": 400, "ignore_eos": True})
    assert wait_kv_free(server.url) == 0


def _aborted(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items()
               if k.startswith("pagedserve_requests_finished_total{") and '"abort"' in k)


# ---- 5. errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    # the prompt's logprobs without a forward (vLLM refuses max_tokens 0 too)
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),  # was ignored
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "prompt_logprobs": 1}, 400,
     "max_tokens"),
    # nothing to generate, and no echo to score: vLLM's 400 (was an empty 200)
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", "{not json", 400, None),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "model": "no-such-model"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
])
def test_errors_have_openai_shape(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param or err["param"].startswith(param)


def test_context_length_error_and_engine_survives(server, client, model):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 100_000})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=model, max_tokens=100_000,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    # Unknown routes and methods answer in the same shape; nothing ever says 422.
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"]
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    assert post(server, "/v1/completions", {"prompt": {"a": 1}}).status_code == 400
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert wait_kv_free(server.url) == 0
