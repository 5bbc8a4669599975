"""`pagedserve serve --api-server-count 2`: two HTTP server processes on one port, one engine
process. Both servers take connections and answer as the offline engine does (greedy text,
streamed); /metrics, whichever server answers it, counts every server's requests; bad
requests and disconnects leave every server well and no KV block held; SIGTERM ends every
process with status 0; a server that dies takes the rest down with status 1; each server
takes its share of --max-connections, and --max-queue counts every server's requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from engine_utils import greedy, make_engine, run
from test_server_utils import (
    RemoteServer,
    assert_alive_and_idle,
    assert_gone,
    child_pids,
    metrics,
    openai_error,
    sigterm_mid_stream,
    sse_events,
    tcp_sockets,
    tiny_server,
)

from pagedserve.server.launch import share_limits

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Paged attention keeps the cache in blocks because"]
STREAMS = 24


@pytest.fixture(scope="module")
def server():
    """Shared by the tests below in file order; the last one stops it."""
    srv = RemoteServer("--api-server-count", "2").wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


def api_servers(srv: RemoteServer) -> list[int]:
    """The children listening on the port (the engine process does not)."""
    return [pid for pid in child_pids(srv.proc.pid) if tcp_sockets(pid, srv.port, "0A")]


def stream(url: str, prompt: str, connected: threading.Barrier, texts: list[str]) -> None:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=240) as r:
        lines = r.iter_lines()
        text = next(sse_events(lines))["choices"][0]["text"]
        connected.wait()  # every stream's connection is open at once
        for event in sse_events(lines):
            if event != "[DONE]":
                text += event["choices"][0]["text"]
    texts.append(text)


def test_every_series_is_there_before_the_first_request(server):
    """At 0 from the load on (as vLLM's are), so that increase() sees the first request;
    in multiprocess mode a series nobody had touched was missing, HELP and TYPE too."""
    m = metrics(server.url)
    for reason in ("stop", "length", "abort"):
        key = f'pagedserve_requests_finished_total{{finished_reason="{reason}"'
        assert [v for k, v in m.items() if k.startswith(key)] == [0.0], reason
    for name in ("pagedserve_prompt_tokens_total", "pagedserve_request_queue_time_seconds_count",
                 "pagedserve_time_to_first_token_seconds_count",
                 "pagedserve_inter_token_latency_seconds_count",
                 "pagedserve_e2e_request_latency_seconds_count"):
        assert m.get(name) == 0.0, name


def test_both_servers_answer_as_the_offline_engine(server, embedded):
    assert len(child_pids(server.proc.pid)) == 3  # the engine process and two servers
    servers = api_servers(server)
    assert len(servers) == 2
    want = run(make_engine(embedded), [embedded.tokenizer.encode(p) for p in PROMPTS],
               greedy(12))
    connected = threading.Barrier(STREAMS + 1)
    texts: list[list[str]] = [[] for _ in PROMPTS]
    threads = [threading.Thread(target=stream, args=(server.url, PROMPTS[i % 2], connected,
                                                     texts[i % 2])) for i in range(STREAMS)]
    for t in threads:
        t.start()
    connected.wait(240)
    counts = {pid: tcp_sockets(pid, server.port, "01") for pid in servers}
    for t in threads:
        t.join(240)
    for prompt_texts, offline in zip(texts, want, strict=True):
        assert prompt_texts == [offline.outputs[0].text] * (STREAMS // 2)
    assert sum(counts.values()) == STREAMS and all(counts.values()), counts
    m = metrics(server.url)  # one server answers for both
    assert m["pagedserve_requests_finished_total"] == STREAMS
    assert m["pagedserve_generation_tokens_total"] == STREAMS * 12
    assert_alive_and_idle(server.url)


def test_bad_requests_and_disconnects_leave_every_server_well(server):
    for _ in range(6):  # over fresh connections: both servers refuse some
        too_long = {"prompt": "word " * 10_000, "max_tokens": 4}
        err = openai_error(httpx.post(server.url + "/v1/completions", json=too_long,
                                      timeout=60), 400)
        assert err["code"] == "context_length_exceeded"
        body = {"prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert "choices" in next(sse_events(r.iter_lines()))  # then hang up
    assert_alive_and_idle(server.url)
    for _ in range(6):
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_sigterm_finishes_streams_then_ends_every_process(server):
    pids = child_pids(server.proc.pid)
    assert sigterm_mid_stream(server, PROMPTS[1]) == 0
    assert_gone(pids)


def test_a_server_that_dies_takes_the_rest_down():
    srv = RemoteServer("--api-server-count", "2").wait_ready()
    try:
        pids = child_pids(srv.proc.pid)
        os.kill(api_servers(srv)[0], signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        assert_gone(pids)
    finally:
        srv.stop()


def test_max_queue_counts_every_servers_requests(tiny_llama_dir):
    """Two streams held open fill --max-queue 2 wherever they landed: every server refuses
    a third request (429), then takes one once they are gone."""
    srv = tiny_server(tiny_llama_dir, "--api-server-count", "2", "--max-queue", "2",
                      "--max-model-len", "2048")
    body = {"prompt": "a b c", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=60) as first, httpx.Client(timeout=60) as second, \
                first.stream("POST", srv.url + "/v1/completions", json=body) as a, \
                second.stream("POST", srv.url + "/v1/completions", json=body) as b:
            streams = [a.iter_lines(), b.iter_lines()]  # held: a dropped one hangs up
            assert all("choices" in next(sse_events(lines)) for lines in streams)
            time.sleep(0.5)  # a few steps: every server has the engine's count
            for _ in range(8):  # fresh connections, spread over both servers
                r = httpx.post(srv.url + "/v1/completions",
                               json={"prompt": "a", "max_tokens": 1}, timeout=60)
                assert r.status_code == 429, r.text
        assert_alive_and_idle(srv.url)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 200, r.text
        # A burst, each stream on a connection of its own: no server may admit up to the
        # limit before the others' admissions reach it (a lagging count let in twice as many).
        assert sorted(burst_statuses(srv.url, body, 8)) == [200] * 2 + [429] * 6
    finally:
        srv.stop()


def burst_statuses(url: str, body: dict, count: int) -> list[int]:
    """The statuses of ``count`` streams sent at once: connected first (the kernel spreads
    the connections over the servers), then every request written in one go; each held open
    until all have answered."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    socks = [socket.create_connection((host, int(port)), timeout=60) for _ in range(count)]
    try:
        for sock in socks:
            sock.sendall(request + payload)
        return [int(sock.makefile("rb").readline().split()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def test_a_port_in_use_is_refused_as_with_one_server():
    """SO_REUSEPORT would let the servers share the port with whatever holds it already."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--port",
                              str(port), "--api-server-count", "2"],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "cannot listen on 127.0.0.1" in run.stderr, run.stderr


def test_each_server_takes_its_share_of_the_connections():
    from pagedserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--api-server-count", "3", "--max-queue", "10",
                                      "--max-connections", "4096"])
    one = share_limits(args)
    assert one.max_connections == 1366  # rounded up
    assert (one.max_queue, one.max_n) == (10, args.max_n) and args.max_connections == 4096


def test_max_queue_counts_every_prompt_of_a_request_across_servers(tiny_llama_dir):
    """--max-queue 3 over two servers: a stream of two prompts held open counts 2, so a
    request of two more prompts, whichever server takes it, is refused (429); one of one
    prompt fits."""
    srv = tiny_server(tiny_llama_dir, "--api-server-count", "2", "--max-queue", "3",
                      "--max-model-len", "2048")
    body = {"prompt": ["a b c", "d e f"], "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", srv.url + "/v1/completions", json=body) as held:
            lines = held.iter_lines()  # held: a dropped one hangs up
            assert "choices" in next(sse_events(lines))
            for _ in range(6):  # fresh connections, spread over both servers
                r = httpx.post(srv.url + "/v1/completions",
                               json={"prompt": ["a", "b"], "max_tokens": 1}, timeout=60)
                assert r.status_code == 429, r.text
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1},
                           timeout=60)
            assert r.status_code == 200, r.text
        assert_alive_and_idle(srv.url)
    finally:
        srv.stop()


def test_refused_requests_give_every_prompts_slot_back_across_servers(tiny_llama_dir):
    """--max-queue 2 over two servers: two-prompt requests the engine refuses (400) give
    back both slots of the shared count, so a two-prompt request still fits after them."""
    srv = tiny_server(tiny_llama_dir, "--api-server-count", "2", "--max-queue", "2")
    try:
        for _ in range(4):  # fresh connections, spread over both servers
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": ["a", "b"], "guided_regex": "(unclosed"})
            assert r.status_code == 400, r.text
        for _ in range(4):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": ["a", "b"], "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
