"""A real server started with --api-key, a small --max-queue and one CORS origin: 401, 429 +
Retry-After, recovery afterwards, a browser's preflight, and a graceful SIGTERM (in-flight
stream finishes, exit status 0)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from test_server_utils import RemoteServer, sse_events, tiny_server, wait_kv_free

pytestmark = pytest.mark.slow

KEY, SECOND_KEY = "sk-test-0123456789", "sk-test-second"
AUTH = {"Authorization": f"Bearer {KEY}"}
UI = "https://ui.example"


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--api-key", KEY, SECOND_KEY, "--max-queue", "2",
                       "--served-model-name", "smol",
                       "--allowed-origins", f'["{UI}"]')
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def completion(server, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=headers,
                      json={"prompt": "Hello", "max_tokens": 2, **body}, timeout=120)


def assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_listed_origins_page_may_call_the_api(server):
    """CORS as vLLM sets it up: a browser's preflight needs no key (it cannot carry one),
    the listed origin may send the Authorization header, and even a 401 is readable."""
    preflight = {"Origin": UI, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == UI
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(server.url + "/v1/chat/completions",
                      headers={**preflight, "Origin": "https://elsewhere.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = completion(server, {"Origin": UI})
    assert_error(r, 401)
    assert r.headers["access-control-allow-origin"] == UI
    r = completion(server, {**AUTH, "Origin": UI})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    assert "access-control-allow-origin" not in completion(server, AUTH).headers


def test_api_key_required(server):
    assert_error(completion(server), 401)
    assert_error(completion(server, {"Authorization": "Bearer wrong"}), 401)
    assert_error(completion(server, {"Authorization": KEY}), 401)  # no Bearer scheme
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) \
            .completions.create(model="smol", prompt="x", max_tokens=1)
    # Probes and scrapers stay open, as in vLLM; the tokenizer routes do work, so they don't.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "x"}), 401)
    assert_error(httpx.post(server.url + "/detokenize", json={"tokens": [1]}), 401)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"},
                      headers=AUTH).status_code == 200
    # Any one of several keys (vLLM's --api-key K1 K2)
    assert completion(server, {"Authorization": f"Bearer {SECOND_KEY}"}).status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smol"]
    out = client.completions.create(model="smol", prompt="Hello", max_tokens=2)
    assert out.model == "smol" and out.usage.completion_tokens >= 1
    assert_error(completion(server, AUTH, model="SmolLM2-135M-Instruct"), 404)


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_retryable_429(server):
    # 429 would have clients (the openai SDK) retry a request that can never fit.
    r = completion(server, AUTH, prompt=["a", "b", "c"])
    err = assert_error(r, 400)
    assert err["param"] == "prompt" and "--max-queue" in err["message"]
    assert "Retry-After" not in r.headers


def test_queue_full_gives_429_then_recovers(server):
    opened = threading.Barrier(3, timeout=120)
    release = threading.Event()
    outcomes: list[str] = []

    def hold() -> None:
        body = {"prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            outcomes.append(str(r.status_code))
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            opened.wait()
            release.wait(120)  # leaving the block disconnects mid-stream

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    opened.wait()  # both requests are generating
    try:
        r = completion(server, AUTH)
        err = assert_error(r, 429)
        assert err["type"] == "rate_limit_error"
        assert int(r.headers["Retry-After"]) >= 1
        streamed = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                              json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert_error(streamed, 429)
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert outcomes == ["200", "200"]
    assert wait_kv_free(server.url) == 0
    # The disconnects freed the queue: requests are admitted again.
    deadline = time.monotonic() + 20
    while (r := completion(server, AUTH)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200, r.text


def test_sigterm_finishes_inflight_stream_and_exits_0(server):
    """Runs last in this module: it stops the server."""
    body = {"prompt": "Count with me", "max_tokens": 12, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(sse_events(lines))
        server.proc.send_signal(signal.SIGTERM)
        rest = list(sse_events(lines))
    assert rest[-1] == "[DONE]"
    events = [first, *rest[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in event for event in events)  # (the text may say "terrorist")
    assert server.proc.wait(60) == 0, server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)


@pytest.fixture(scope="module")
def tiny_queue(tiny_llama_dir):
    """The tiny Llama with --max-queue 2 and no key."""
    srv = tiny_server(tiny_llama_dir, "--max-queue", "2")
    try:
        yield srv
    finally:
        srv.stop()


def test_refused_requests_of_two_prompts_leave_the_queue_empty(tiny_queue):
    """A two-prompt request whose constraint the engine refuses (400) takes both of its
    --max-queue slots and gives both back: after several, two prompts still fit."""
    for _ in range(3):
        r = httpx.post(tiny_queue.url + "/v1/completions", timeout=60,
                       json={"prompt": ["a", "b"], "guided_regex": "(unclosed"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    r = httpx.post(tiny_queue.url + "/v1/completions", timeout=60,
                   json={"prompt": ["a", "b"], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_failed_requests_of_two_prompts_leave_the_queue_empty(tiny_queue):
    """A two-prompt request that fails while it runs (its constraint's matcher gives up
    after the first token: a 400) gives back the slots of every prompt it had unfinished:
    after several, two prompts still fit."""
    body = {"prompt": ["b", "b"], "max_tokens": 8, "temperature": 0,
            "guided_regex": "(b|c)a{500000}"}
    for _ in range(3):
        r = httpx.post(tiny_queue.url + "/v1/completions", timeout=60, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    r = httpx.post(tiny_queue.url + "/v1/completions", timeout=60,
                   json={"prompt": ["a", "b"], "max_tokens": 2})
    assert r.status_code == 200, r.text
