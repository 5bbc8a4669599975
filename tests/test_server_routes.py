"""The routes beside generation, on a real `pagedserve serve` (the engine loop in a thread,
then in a process of its own): /tokenize, /detokenize, /v1/models, /version, and /metrics,
its families' names, types and labels, and counts that follow vLLM's (each sample a
finished request, a stream's first token observed as it arrives)."""

from __future__ import annotations

from unittest.mock import ANY

import httpx
import openai
import pytest
from test_server_utils import (
    LOOP_FLAGS,
    RemoteServer,
    metrics,
    openai_error,
    sse_events,
    wait_kv_free,
)

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


# The process server also puts X-Request-Id on its responses (vLLM's flag); the thread's
# does not.
ID_HEADERS = {"thread": [], "process": ["--enable-request-id-headers"]}


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request):
    with RemoteServer(LOOP_FLAGS[request.param], *ID_HEADERS[request.param]) as srv:
        srv.id_headers = bool(ID_HEADERS[request.param])
        yield srv


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_metrics_count_each_sample_and_a_streams_first_token_at_once(server):
    """Each of n samples counts as a finished request (vLLM's child requests), and a
    stream's time to first token is observed when that token arrives, not at its end."""
    length = 'pagedserve_requests_finished_total{finished_reason="length"'
    ttft = "pagedserve_time_to_first_token_seconds_count"
    before = metrics(server.url)
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 3,
                                         "ignore_eos": True})
    assert r.status_code == 200
    after = metrics(server.url)
    assert _sample(after, length) - _sample(before, length) == 3
    assert after[ttft] - before[ttft] == 1  # one prefill: one first token for the request
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as s:
        # Held while the stream is open: a dropped generator, once collected, closes the
        # connection, and the server aborts the request.
        events = sse_events(s.iter_lines())
        assert next(events)["choices"][0]["text"]
        during = metrics(server.url)  # the stream is left unread meanwhile
        assert during["pagedserve_num_requests_running"] == 1
        assert during[ttft] - after[ttft] == 1
        events.close()
    assert wait_kv_free(server.url) == 0  # the stream was left: aborted
    assert metrics(server.url)[ttft] - after[ttft] == 1  # not counted again at its end


def _sample(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_metrics_names_and_labels(server):
    text = httpx.get(server.url + "/metrics").text
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
    ours = {n: k for n, k in types.items() if n.startswith("pagedserve_")}
    counters = {n.removesuffix("_total") for n, k in ours.items() if k == "counter"}
    assert counters >= {
        "pagedserve_prompt_tokens", "pagedserve_generation_tokens",
        "pagedserve_prefill_tokens_computed", "pagedserve_prefix_cache_queried_tokens",
        "pagedserve_prefix_cache_hit_tokens", "pagedserve_num_preemptions",
        "pagedserve_requests_finished", "pagedserve_engine_steps"}
    assert {n for n, k in ours.items() if k == "gauge"} >= {
        "pagedserve_num_requests_running", "pagedserve_num_requests_waiting",
        "pagedserve_kv_blocks_used", "pagedserve_num_kv_blocks",
        "pagedserve_kv_blocks_shared", "pagedserve_kv_cache_usage_ratio"}
    assert {n for n, k in ours.items() if k == "histogram"} >= {
        "pagedserve_time_to_first_token_seconds", "pagedserve_inter_token_latency_seconds",
        "pagedserve_e2e_request_latency_seconds", "pagedserve_request_queue_time_seconds"}
    samples = [line for line in text.splitlines() if line.startswith("pagedserve_")]
    assert all('model_name="' in line for line in samples)
    assert any(line.startswith("pagedserve_generation_tokens_total{") for line in samples)
    assert 'finished_reason="length"' in text
    m = metrics(server.url)
    assert m["pagedserve_num_kv_blocks"] == 512
    assert m["pagedserve_time_to_first_token_seconds_count"] > 0
    assert post(server, "/tokenize", {"prompt": "a"}).json()["max_model_len"] > 0


def test_tokenize_detokenize_models_version(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    tok = post(server, "/tokenize", {"model": model, "prompt": "hello world"}).json()
    assert set(tok) == {"tokens", "count", "max_model_len"} and tok["count"] == len(tok["tokens"])
    back = post(server, "/detokenize", {"model": model, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": "hello world"}
    strs = post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["hello", "Ġworld"]  # the vocabulary's entries, as vLLM's
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tok["count"]
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == model
    card = httpx.get(f"{server.url}/v1/models/{model}").json()
    assert card == {**models["data"][0], "created": ANY}
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such/model")
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.post(server.url + "/ping").json() == {"status": "ok"}  # vLLM's SageMaker probe


def test_sagemaker_invocations_route_by_body(server):
    """vLLM's /invocations: messages make a chat completion, a prompt a completion."""
    chat = post(server, "/invocations", {"messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = post(server, "/invocations", {"prompt": PROMPT, "max_tokens": 2})
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    for bad in ({}, {"prompt": PROMPT, "max_tokens": "two"}, [1, 2]):
        assert set(openai_error(post(server, "/invocations", bad), 400)) >= {"message"}
    # CORS by default, as vLLM's and llama.cpp's servers: any page may call the API.
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "https://any.example"})
    assert r.headers["access-control-allow-origin"] == "*"


def test_a_clients_request_id_names_its_response_and_comes_back_when_asked(server):
    """As vLLM: a response's id is built on the X-Request-Id header, else the body's
    request_id; with --enable-request-id-headers every response carries X-Request-Id, the
    client's own or a new one, streams and errors too."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat,
                   headers={"X-Request-Id": "trace-7"}, timeout=120)
    assert r.json()["id"] == "chatcmpl-trace-7"
    assert r.headers.get("x-request-id") == ("trace-7" if server.id_headers else None)
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True,
                                         "request_id": "mine"})
    assert {e["id"] for e in sse_events(r.text.splitlines()) if e != "[DONE]"} == {"cmpl-mine"}
    fresh = r.headers.get("x-request-id")
    assert (len(fresh) == 32) if server.id_headers else fresh is None
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert r.json()["id"].startswith("cmpl-") and len(r.json()["id"]) == 5 + 32
    if server.id_headers:  # the id chosen for the header is the response's own
        assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    assert r.json()["id"] != post(server, "/v1/completions",
                                  {"prompt": PROMPT, "max_tokens": 1}).json()["id"]
    # Ids are echoed in every chunk of a stream: no longer than 512 characters.
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                   headers={"X-Request-Id": "x" * 513}, timeout=120)
    assert openai_error(r, 400)["param"] == "request_id"
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                         "request_id": "x" * 513})
    error = openai_error(r, 400)
    assert error["param"] == "request_id" and "at most 512 characters" in error["message"]
    r = httpx.get(server.url + "/v1/models/no-such", headers={"X-Request-Id": "gone"})
    assert r.status_code == 404
    assert r.headers.get("x-request-id") == ("gone" if server.id_headers else None)
    assert wait_kv_free(server.url) == 0


def test_detokenize_takes_every_id_the_model_can_emit(tmp_path, embedded):
    """A model whose vocabulary is padded past its tokenizer's (as Qwen's are) can emit the
    padding ids: /detokenize takes them (no text), as generation does; past the model's
    vocabulary an id is still a 400."""
    from engine_utils import save_tiny_hf
    from test_server_utils import tiny_server
    from transformers import LlamaConfig, LlamaForCausalLM

    size = embedded.tokenizer.vocab_size
    config = LlamaConfig(vocab_size=size + 64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=2)
    save_tiny_hf(tmp_path, LlamaForCausalLM, config, embedded.tokenizer)
    with tiny_server(tmp_path) as srv:
        out = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                            "allowed_token_ids": [size + 5]}).json()
        assert out["choices"][0]["text"] == ""
        r = post(srv, "/detokenize", {"tokens": [size - 1, size + 5, size + 63]})
        assert r.status_code == 200 and r.json()["prompt"] == post(
            srv, "/detokenize", {"tokens": [size - 1]}).json()["prompt"]
        assert openai_error(post(srv, "/detokenize", {"tokens": [size + 64]}), 400)[
            "param"] == "tokens"


def test_a_500_carries_the_request_id_too():
    """Starlette answers an unexpected exception outside every middleware: the handler puts
    X-Request-Id on the 500 itself (the app in process, a route that fails added)."""
    import asyncio

    from pagedserve.server.app import build_app
    from pagedserve.server.config import ServerConfig

    app = build_app(ServerConfig(enable_request_id_headers=True), factory=lambda: None)

    @app.get("/fails")
    async def fails() -> None:
        raise RuntimeError("a bug")

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.get("/fails", headers={"X-Request-Id": "trace-500"})

    r = asyncio.run(call())
    assert openai_error(r, 500)["message"].startswith("Internal server error")
    assert r.headers["x-request-id"] == "trace-500"
