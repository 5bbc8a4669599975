"""`pagedserve serve --frontend-multiprocessing`: the engine loop in a process of its own.
A real server on the embedded model answers as the in-thread one does (greedy text equal to
the offline engine's, streamed or not, n > 1, logprobs, structured outputs checked on the
HTTP side), also with --stream-interval 4 (fewer chunks, the same text and tokens); an
engine process that is killed fails the requests in flight, /health says dead and HTTP
keeps answering; SIGTERM ends both processes, and so does a second Ctrl-C."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from engine_utils import greedy, make_engine, run
from test_server_utils import (
    LOOP_FLAGS,
    RemoteServer,
    assert_gone,
    child_pids,
    openai_error,
    sigterm_mid_stream,
    sse_events,
    wait_kv_free,
)

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Paged attention keeps the cache in blocks because"]


@pytest.fixture(scope="module")
def server():
    """Shared by the tests below in file order; the last one stops it."""
    srv = RemoteServer(LOOP_FLAGS["process"], "--stream-interval", "4").wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


def test_outputs_equal_the_offline_engine(server, embedded):
    [pid] = child_pids(server.proc.pid)  # the engine runs in a process of its own
    want = run(make_engine(embedded), [embedded.tokenizer.encode(p) for p in PROMPTS],
               greedy(12))
    for prompt, offline in zip(PROMPTS, want, strict=True):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "n": 2, "logprobs": 1,
                "ignore_eos": True}
        plain = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert [c["text"] for c in plain["choices"]] == [offline.outputs[0].text] * 2
        assert plain["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={**body, "stream": True}, timeout=120) as r:
            events = list(sse_events(r.iter_lines()))
        texts = ["", ""]
        tokens = [0, 0]
        for event in events[:-1]:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
                tokens[choice["index"]] += len(choice["logprobs"]["tokens"])
        assert texts == [offline.outputs[0].text] * 2 and tokens == [12, 12]
        # --stream-interval 4: a choice's chunks carry 1, 4, 4 and 3 tokens, not 12 of 1.
        assert len(events[:-1]) <= 8, len(events)
    assert wait_kv_free(server.url) == 0
    assert child_pids(server.proc.pid) == [pid]


def test_structured_outputs_are_checked_before_they_queue(server):
    chat = {"messages": [{"role": "user", "content": "A JSON object, please."}],
            "max_tokens": 24, "temperature": 0}
    bad = {**chat, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}
    err = openai_error(httpx.post(server.url + "/v1/chat/completions", json=bad, timeout=60),
                       400)
    assert err["param"] == "response_format"
    good = {**chat, "response_format": {"type": "json_object"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=good, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")


def test_sigterm_finishes_streams_then_ends_both_processes(server):
    pids = child_pids(server.proc.pid)
    assert len(pids) == 1
    assert sigterm_mid_stream(server, PROMPTS[1]) == 0
    assert_gone(pids)


def test_a_stream_past_the_graceful_timeout_ends_in_an_error_event():
    """A stream still running when --timeout-graceful-shutdown ends is failed just before
    it: its client reads an error event and [DONE], not a cut it could take for an end."""
    with RemoteServer(LOOP_FLAGS["process"], "--timeout-graceful-shutdown", "2") as server:
        body = {"prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert "choices" in next(sse_events(lines))
            server.proc.send_signal(signal.SIGTERM)
            rest = list(sse_events(lines))
        assert rest[-1] == "[DONE]" and "shut down" in rest[-2]["error"]["message"], rest[-2:]
        assert server.proc.wait(60) == 0


def test_a_second_ctrl_c_ends_both_processes_at_once():
    """The second SIGINT forces the server out, skipping its shutdown: the engine process,
    which leaves signals to the server, must end anyway (the exit waited on it forever)."""
    with RemoteServer(LOOP_FLAGS["process"]) as server:
        pids = child_pids(server.proc.pid)
        body = {"prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert "choices" in next(sse_events(r.iter_lines()))
            server.proc.send_signal(signal.SIGINT)
            while True:  # draining: it no longer accepts connections
                try:
                    httpx.get(server.url + "/health", timeout=5)
                except httpx.TransportError:
                    break
            server.proc.send_signal(signal.SIGINT)
            assert server.proc.wait(30) != 0
        assert_gone(pids)


def test_a_killed_engine_process_fails_requests_and_http_keeps_answering():
    server = RemoteServer(LOOP_FLAGS["process"]).wait_ready()
    try:
        killed_engine_process(server)
    finally:
        server.stop()


def killed_engine_process(server: RemoteServer) -> None:
    [pid] = child_pids(server.proc.pid)
    body = {"prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert "choices" in next(sse_events(lines))
        os.kill(pid, signal.SIGKILL)
        rest = list(sse_events(lines))
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "engine_dead"
    assert "exit code -9" in rest[-2]["error"]["message"]
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "dead"
    again = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert openai_error(again, 503)["code"] == "engine_dead"
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    assert server.proc.poll() is None
