"""Reliability: the connection- and body-level bounds of a real server started with small
limits (--max-request-bytes, --timeout-read, --timeout-keep-alive, --max-connections), on
raw sockets where the HTTP client would hide what the server does."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time

import httpx
import pytest
from test_server_utils import (
    assert_alive_and_idle,
    openai_error,
    rss_mb,
    sse_events,
    tiny_server,
    wait_kv_free,
)

pytestmark = pytest.mark.slow

MAX_BYTES = 2_000_000
TIMEOUT_READ = 2.0
KEEP_ALIVE = 1.0
MAX_CONNECTIONS = 50
SLACK = 1.5  # scheduling slack on a small shared machine


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = tiny_server(tiny_llama_dir, "--max-request-bytes", str(MAX_BYTES),
                      "--timeout-read", str(TIMEOUT_READ),
                      "--timeout-keep-alive", str(KEEP_ALIVE),
                      "--max-connections", str(MAX_CONNECTIONS))
    try:
        yield srv
    finally:
        srv.stop()


def connect(server, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_until_closed(s: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``limit`` s pass), and when it closed
    (seconds from the call; inf if it did not)."""
    start, data = time.monotonic(), b""
    s.settimeout(0.1)
    while time.monotonic() - start < limit:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, time.monotonic() - start
        if not chunk:
            return data, time.monotonic() - start
        data += chunk
    return data, float("inf")


def status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


def post_head(path: str, length: int | str | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else \
        "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{size}{extra}\r\n").encode()


# ---- request bodies: size and time ------------------------------------------------------------
def test_declared_body_over_the_limit_is_413_unread(server):
    with connect(server) as s:
        s.sendall(post_head("/v1/completions", MAX_BYTES + 1))  # and no body at all
        raw, closed = read_until_closed(s, 10)
    status, body = status_and_body(raw)
    assert status == 413, raw[:300]
    assert body["error"]["code"] == "request_too_large"
    assert closed < 10


def test_chunked_body_over_the_limit_is_413(server):
    chunk = b"x" * 65536
    with connect(server) as s:
        s.sendall(post_head("/v1/completions", None))
        sent = 0
        while sent <= MAX_BYTES:
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        raw, _ = read_until_closed(s, 10)
    status, body = status_and_body(raw)
    assert status == 413, raw[:300]
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(server):
    """--max-request-bytes is the most a body may hold, declared or chunked: exactly that
    many bytes are read (a prompt past the context here: a 400), one more is a 413."""
    head, tail = b'{"max_tokens": 1, "prompt": "', b'"}'
    for size, want in ((MAX_BYTES, 400), (MAX_BYTES + 1, 413)):
        data = head + b"a" * (size - len(head) - len(tail)) + tail
        for chunked in (False, True):
            with connect(server) as s:
                s.sendall(post_head("/v1/completions", None if chunked else size,
                                    "Connection: close\r\n"))
                # (a 413 may come, and the socket close, while the rest is still sent)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    if chunked:
                        for part in (data[:size // 2], data[size // 2:]):
                            s.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                        s.sendall(b"0\r\n\r\n")
                    else:
                        s.sendall(data)
                raw, _ = read_until_closed(s, 30)
            assert status_and_body(raw)[0] == want, (size, chunked, raw[:300])


def test_lengths_padded_with_zeros_or_of_many_digits(server):
    """Leading zeros are valid HTTP: the body is read, not a 500 (Python's int() refuses a
    string past 4,300 digits). A length past 64 bits is framing the parser refuses (400)."""
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    for length, want in (("0" * 5000 + str(len(body)), 200), ("9" * 5000, 400),
                         ("1" + "0" * 24, 400)):
        with connect(server) as s:
            s.sendall(post_head("/v1/completions", length, "Connection: close\r\n") + body)
            raw, _ = read_until_closed(s, 30)
        assert status_and_body(raw)[0] == want, raw[:300]


@pytest.mark.parametrize("head", [
    "Content-Length: abc\r\n", "Content-Length: -5\r\n",
    "Transfer-Encoding: chunked\r\n",  # then a chunk size that is not hex
])
def test_unparsable_framing_is_400_in_openai_shape(server, head):
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               f"\r\n{head}\r\n").encode()
    body = b"zz\r\nabc\r\n0\r\n\r\n" if "chunked" in head else b"{}"
    with connect(server) as s:
        s.sendall(request + body)
        raw, closed = read_until_closed(s, 10)
    status, error = status_and_body(raw)
    assert status == 400 and closed < 10, raw[:300]
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["code"] == "invalid_http_request"


def test_body_over_the_limit_with_httpx_is_413(server):
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       content=b'{"prompt": "' + b"a" * MAX_BYTES + b'"}')
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        return  # the server answered and closed while the client still wrote
    openai_error(r, 413)


def test_body_sent_slower_than_timeout_read_is_408_or_closed(server):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    start = time.monotonic()
    with connect(server) as s:
        s.sendall(post_head("/v1/completions", len(body)))
        raw = b""
        for i in range(len(body)):  # one byte every 0.4 s: the whole body would take ~10 s
            try:
                s.sendall(body[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            r, _, _ = select.select([s], [], [], 0.4)
            if r:
                break
        more, _ = read_until_closed(s, TIMEOUT_READ + SLACK)
        raw += more
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_READ + 2 * SLACK, elapsed
    if raw:
        status, err = status_and_body(raw)
        assert status == 408, raw[:300]
        assert set(err["error"]) == {"message", "type", "param", "code"}


# ---- headers: idle and half-sent connections ---------------------------------------------------
@pytest.mark.parametrize("sent", [b"", b"GET /hea", b"GET /health HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "half-request-line", "half-headers"])
def test_connection_without_complete_headers_is_closed(server, sent):
    with connect(server) as s:
        s.sendall(sent)
        raw, closed = read_until_closed(s, TIMEOUT_READ + 3 * SLACK)
    assert closed <= TIMEOUT_READ + SLACK, closed
    assert b"200" not in raw


def test_headers_trickled_byte_by_byte_are_cut_off(server):
    # Each byte arrives well within the timeout, but the headers never complete: the
    # deadline runs from the connect, not from the last byte (a slow-loris).
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100
    start, closed_at = time.monotonic(), None
    with connect(server) as s:
        for i in range(len(head)):
            try:
                s.sendall(head[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - start
                break
            r, _, _ = select.select([s], [], [], 0.2)
            if r:
                raw, _ = read_until_closed(s, 1.0)
                closed_at = time.monotonic() - start
                assert b"200" not in raw
                break
    assert closed_at is not None, "the server kept a trickling connection open"
    assert closed_at <= TIMEOUT_READ + SLACK, closed_at


def test_headers_past_the_bound_get_431_at_once(server):
    """The parser buffers headers without a bound of its own: a client streaming one
    endless header is answered 431 and cut off at once (what it sent meanwhile is what the
    sockets' buffers took), not after the timeout, while headers under the bound are
    served."""
    from pagedserve.server.limits import MAX_HEADER_BYTES

    with connect(server) as s:
        pad = b"a" * (MAX_HEADER_BYTES // 2)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad + b"\r\n\r\n")
        raw, _ = read_until_closed(s, 1.0)
        assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    start, sent = time.monotonic(), 0
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            while sent < 64 << 20:
                s.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw, closed = read_until_closed(s, TIMEOUT_READ + 3 * SLACK)
    assert sent < 16 << 20, f"the server took {sent} bytes of one header"
    assert time.monotonic() - start < TIMEOUT_READ, "cut off by the timeout, not the size"
    if raw:  # the 431 may be lost to the reset of a connection still sending
        status, err = status_and_body(raw)
        assert status == 431, raw[:300]
        assert err["error"]["code"] == "request_headers_too_large"
    assert_alive_and_idle(server.url)


def test_idle_keep_alive_connection_is_closed(server):
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline, raw = time.monotonic() + 10, b""
        while b'"ok"' not in raw and time.monotonic() < deadline:
            raw += s.recv(4096)
        assert raw.startswith(b"HTTP/1.1 200"), raw
        rest, closed = read_until_closed(s, KEEP_ALIVE + 3 * SLACK)
    assert rest == b""
    assert closed <= KEEP_ALIVE + SLACK, closed


# ---- a connection cap --------------------------------------------------------------------------
def test_connections_past_the_cap_get_503_and_are_closed(server):
    # Within the cap, /health on a fresh connection still answers beside idle sockets.
    held = [connect(server) for _ in range(MAX_CONNECTIONS - 5)]
    try:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)

    extra = 8
    socks = [connect(server) for _ in range(MAX_CONNECTIONS + extra)]
    try:
        time.sleep(0.5)
        readable, _, _ = select.select(socks, [], [], 0.5)
        refused = []
        for s in readable:
            raw, closed = read_until_closed(s, 2.0)
            if raw:
                refused.append((raw, closed))
        # The last ones over the cap are answered at once (before any header timeout).
        assert len(refused) >= extra, [r[:60] for r, _ in refused]
        for raw, closed in refused:
            status, body = status_and_body(raw)
            assert status == 503, raw[:300]
            assert body["error"]["code"] == "too_many_connections"
            assert closed < 2.0
    finally:
        for s in socks:
            s.close()
    time.sleep(0.3)
    # Once they are closed, requests are served again.
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- a large-but-allowed body beside a running stream -----------------------------------------
def test_large_body_keeps_health_fast_and_memory_bounded(server, capsys):
    pid = server.proc.pid
    stop = threading.Event()
    health_times: list[float] = []
    health_bad: list[str] = []
    rss_peak = [0.0]
    stream_result: dict = {}

    def poll_health() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    code = c.get("/health").status_code
                    if code != 200:
                        health_bad.append(str(code))
                except httpx.HTTPError as e:
                    health_bad.append(repr(e))
                health_times.append(time.monotonic() - t)
                time.sleep(0.05)

    def sample_rss() -> None:
        while not stop.is_set():
            rss_peak[0] = max(rss_peak[0], rss_mb(pid))
            time.sleep(0.02)

    def run_stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=120) as r:
            stream_result["status"] = r.status_code
            stream_result["events"] = list(sse_events(r.iter_lines()))

    # Warm the paths up, so the baseline includes what any first request allocates.
    for content in (b'{"prompt": "' + b"a" * 10_000 + b'"}',
                    b'{"prompt": [' + b"5," * 10_000 + b'5]}'):
        httpx.post(server.url + "/v1/completions", content=content, timeout=60,
                   headers={"Content-Type": "application/json"})
    time.sleep(0.5)
    rss_before = rss_mb(pid)
    threads = [threading.Thread(target=f) for f in (poll_health, sample_rss, run_stream)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        text = b'{"prompt": "' + b"a" * (MAX_BYTES - 100_000) + b'", "max_tokens": 2}'
        ids = b'{"prompt": [' + b"5," * ((MAX_BYTES - 100_000) // 2) + b'5], "max_tokens": 2}'
        assert len(text) < MAX_BYTES and len(ids) < MAX_BYTES
        for content in (text, ids):
            r = httpx.post(server.url + "/v1/completions", content=content, timeout=60,
                           headers={"Content-Type": "application/json"})
            err = openai_error(r, 400)
            assert err["code"] == "context_length_exceeded", err
        threads[2].join(120)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    time.sleep(1.0)
    rss_after = rss_mb(pid)
    with capsys.disabled():
        print(f"\n[limits] server RSS MiB: before {rss_before:.1f}, peak {rss_peak[0]:.1f}, "
              f"after {rss_after:.1f}; /health answers {len(health_times)}, slowest "
              f"{max(health_times):.3f} s")
    assert not health_bad, health_bad[:5]
    assert len(health_times) >= 5
    assert max(health_times) < 1.0, sorted(health_times)[-5:]
    assert stream_result.get("status") == 200
    events = stream_result["events"]
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events if isinstance(e, dict))
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"]
                if c["finish_reason"]]
    assert finishes == ["length"]
    assert rss_after - rss_before < 150, (rss_before, rss_peak[0], rss_after)


def test_many_prompts_are_capped_and_their_abort_is_one_pass(server):
    """More prompts than --max-prompts (1024) is a 400 before any is queued. A client that
    leaves a request of 1,000 prompts aborts them in one pass (one each took seconds at
    10,000, minutes at 100,000): the blocks are free and the next request is served."""
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": [[5]] * 1025, "max_tokens": 1})
    assert openai_error(r, 400)["param"] == "prompt"
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": [[5]] * 1024, "max_tokens": 1})  # exactly the cap
    assert r.status_code == 200 and len(r.json()["choices"]) == 1024, r.text[:300]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"prompt": [[5, 6, 7]] * 1000, "max_tokens": 50, "ignore_eos": True})
    assert wait_kv_free(server.url, 30) == 0
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200


def test_zz_alive_and_idle_after_everything(server):
    assert_alive_and_idle(server.url)
