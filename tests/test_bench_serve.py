"""`bench serve` against a real HTTP server on loopback (a fake OpenAI-shaped one): the
report's counts and statistics, the client processes, the flags; never a speed. A server
that misbehaves: test_bench_serve_faults.py."""

import asyncio
import contextlib
import json
import math
import socket
import threading
import time

import pytest

from pagedserve.bench import report
from pagedserve.bench.serve_client import arrival_offsets
from pagedserve.bench.workloads import serve_dataset
from pagedserve.cli import main


class FakeOpenAI:
    """A minimal OpenAI-shaped streaming server: one content chunk per token, then usage.
    A request for 13 tokens gets HTTP 500. With ``group`` set, requests are answered only
    in groups of that many (one left waiting ``GROUP_WAIT_S`` is answered alone, counted in
    ``lone``)."""

    GROUP_WAIT_S = 3.0

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.connections: set[tuple[str, int]] = set()  # the clients' (host, port)
        self.group, self.lone = 0, 0
        waiting: list[asyncio.Future] = []

        async def gate():
            future = asyncio.get_running_loop().create_future()
            waiting.append(future)
            if len(waiting) == self.group:
                for f in waiting:
                    f.set_result(None)
                waiting.clear()
            try:
                await asyncio.wait_for(asyncio.shield(future), self.GROUP_WAIT_S)
            except TimeoutError:
                waiting.remove(future)
                self.lone += 1

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "fake-model"}]})

        async def generate(request):
            body = await request.json()
            self.bodies.append(body)
            self.connections.add((request.client.host, request.client.port))
            n = body["max_tokens"]
            if n == 13:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if self.group:
                await gate()
            chat = "messages" in body
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())

            async def events():
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    for i in range(n):
                        await asyncio.sleep(0.002)
                        choice = {"index": 0, "delta": {"content": f"w{i} "}} if chat else \
                            {"index": 0, "text": f"w{i} "}
                        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    if (body.get("stream_options") or {}).get("include_usage"):
                        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                 "total_tokens": prompt_tokens + n}
                        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.in_flight -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        self.app = Starlette(routes=[
            Route("/v1/models", models),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
        ])


@contextlib.contextmanager
def serving(app):
    """``app`` served by uvicorn on a free loopback port, in a thread; its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def fake_server():
    fake = FakeOpenAI()
    with serving(fake.app) as url:
        yield fake, url


def _serve(tmp_path, url, *args: str) -> tuple[int, dict]:
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", url, "--json", str(out), *args])
    return rc, json.loads(out.read_text())


def test_serve_bench_completions_report(tmp_path, fake_server):
    fake, url = fake_server
    rc, r = _serve(tmp_path, url + "/v1", "--num-prompts", "8", "--input-len", "20",
                   "--range-ratio", "0.5", "--output-len", "5", "--ignore-eos",
                   "--max-concurrency", "3", "--request-rate", "200", "--burstiness", "0.5")
    assert rc == 0
    assert r["model"] == "fake-model"  # from GET /v1/models
    assert (r["completed"], r["failed"], r["usage_missing"]) == (8, 0, 0)
    expected = serve_dataset("random", 8, 20, 5, range_ratio=0.5, vocab_size=32000)
    assert r["total_input_tokens"] == sum(len(e.prompt) for e in expected)
    assert r["total_output_tokens"] == 40
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(e.prompt for e in expected)
    assert all(b["ignore_eos"] and b["stream"] and b["stream_options"]["include_usage"]
               for b in fake.bodies)
    assert fake.max_in_flight <= 3
    # Connections kept alive from one request to the next, as the openai SDK keeps them:
    # a new one a request would load both sides with connects and closes.
    assert len(fake.connections) <= 3
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert all(v > 0 for v in r[key].values()), key
    assert r["e2el_ms"]["median"] > r["ttft_ms"]["median"]
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    assert r["request_rate"] == 200.0


def test_serve_bench_client_processes_share_the_requests_and_the_concurrency(tmp_path,
                                                                             fake_server):
    """--num-workers 2: the same requests as one client sends, every one answered, and the
    concurrency cap held over both processes together."""
    fake, url = fake_server
    rc, r = _serve(tmp_path, url, "--num-prompts", "9", "--input-len", "12", "--output-len",
                   "4", "--ignore-eos", "--max-concurrency", "3", "--num-workers", "2")
    assert rc == 0 and r["num_workers"] == 2
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (9, 0, 36)
    expected = serve_dataset("random", 9, 12, 4, vocab_size=32000)
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(e.prompt for e in expected)
    assert fake.max_in_flight <= 3
    assert r["e2el_ms"]["median"] > r["ttft_ms"]["median"] > 0
    assert r["duration_s"] >= r["e2el_ms"]["p99"] / 1e3  # from the one shared start


def test_serve_bench_chat_and_failures(tmp_path, fake_server):
    fake, url = fake_server
    rc, r = _serve(tmp_path, url, "--endpoint", "chat", "--dataset", "shared-prefix",
                   "--num-prompts", "3", "--prefix-len", "6", "--input-len", "4",
                   "--output-len", "3", "--model", "given")
    assert rc == 0 and r["request_rate"] == "inf"
    assert (r["completed"], r["total_input_tokens"], r["total_output_tokens"]) == (3, 30, 9)
    assert all(b["model"] == "given" and "messages" in b for b in fake.bodies)

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": [5, 6, 7], "output_len": 13}\n{"prompt": "a b", "output_len": 2}\n')
    rc, r = _serve(tmp_path, url, "--dataset", str(data), "--num-prompts", "5")
    assert rc == 0
    assert (r["completed"], r["failed"], r["total_input_tokens"]) == (1, 1, 2)
    assert r["errors"] and r["errors"][0].startswith("HTTP 500")


def test_serve_bench_unreachable_server_is_one_line_error(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"])
    assert rc == 2
    assert "cannot list models" in capsys.readouterr().err


def test_bad_counts_and_an_unwritable_json_path_are_one_line_errors(tmp_path, capsys):
    rc = main(["bench", "throughput", "--probe-reps", "0"])  # refused before the model loads
    assert rc == 2 and "--probe-reps must be at least 1" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--json .*a-file/out.json"):
        report.write_json(str(blocker / "out.json"), {"x": 1})




def test_serve_bench_results_come_back_by_request_whichever_process_ends_first(tmp_path,
                                                                               fake_server):
    """Two client processes, the one sending the short request done first: each result is
    put back at its request's index, not read in the order the processes ended."""
    fake, url = fake_server
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": [7, 8], "output_len": n}) + "\n"
                            for n in (40, 1, 40)))
    rc, r = _serve(tmp_path, url, "--dataset", str(data), "--num-prompts", "3",
                   "--num-workers", "2")
    assert rc == 0 and r["num_workers"] == 2
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (3, 0, 81)


def test_serve_bench_client_processes_use_the_whole_concurrency(tmp_path, fake_server):
    """--max-concurrency 3 over 2 client processes (2 + 1 slots): 3 requests in flight
    until the last ones, not a process with one slot left sending its backlog one at a time
    while the other idles. The server answers only groups of 3 at once: a request answered
    alone was sent with the budget unused."""
    fake, url = fake_server
    fake.group = 3
    rc, r = _serve(tmp_path, url, "--num-prompts", "6", "--input-len", "4", "--output-len",
                   "2", "--ignore-eos", "--max-concurrency", "3", "--num-workers", "2")
    assert rc == 0 and (r["completed"], r["failed"]) == (6, 0)
    assert fake.lone == 0
    assert fake.max_in_flight == 3


def test_serve_bench_counts_the_prompts_a_short_dataset_sent(tmp_path, fake_server, capsys):
    fake, url = fake_server
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": [5, 6, 7], "output_len": 2}\n{"prompt": "a b"}\n')
    rc, r = _serve(tmp_path, url, "--dataset", str(data), "--num-prompts", "5",
                   "--output-len", "3")
    assert rc == 0 and len(fake.bodies) == 2
    assert (r["num_prompts"], r["completed"], r["total_output_tokens"]) == (2, 2, 5)
    assert "has 2 prompts, fewer than --num-prompts 5: sending 2" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--request-rate", "nan"], "--request-rate must be positive"),
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--burstiness", "nan"], "--burstiness must be positive"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--timeout", "-3"], "--timeout must be positive"),
    (["--num-workers", "0"], "--num-workers must be at least 1"),
    (["--vocab-size", "0"], "--vocab-size must be at least 1"),
    (["--dataset", "shared-prefix", "--prefix-len", "-5"], "--prefix-len must not be negative"),
    (["--json", "{blocker}/out.json"], "--json {blocker}/out.json: "),
])
def test_serve_bench_bad_flags_are_one_line_errors_before_any_request(
        tmp_path, fake_server, capsys, flags, message):
    fake, url = fake_server
    blocker = tmp_path / "a-file"  # a file where --json needs a directory
    blocker.write_text("")
    flags = [f.format(blocker=blocker) for f in flags]
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--output-len", "2",
               *flags])
    err = capsys.readouterr().err
    assert rc == 2 and f"pagedserve: error: {message.format(blocker=blocker)}" in err
    assert "Traceback" not in err
    assert fake.bodies == []  # refused before the run, not after it


def test_infinite_burstiness_is_evenly_spaced_arrivals():
    """The gamma distribution's limit as its shape grows: every gap 1/rate."""
    assert arrival_offsets(5, 4.0, burstiness=math.inf) == [0.0, 0.25, 0.5, 0.75, 1.0]
    for bad in (math.nan, 0.0, -1.0):
        with pytest.raises(ValueError):
            arrival_offsets(3, 1.0, burstiness=bad)
    with pytest.raises(ValueError):
        arrival_offsets(3, math.nan)


@pytest.mark.parametrize(("flags", "message"), [
    (["--hf-max-prompts", "-1"], "--hf-max-prompts must not be negative"),
    (["--workload", "shared-prefix", "--prefix-len", "-5"], "--prefix-len must not be negative"),
    (["--json", "{blocker}/out.json"], "--json {blocker}/out.json: "),
])
def test_throughput_bad_flags_are_refused_before_the_model_loads(tmp_path, capsys, flags,
                                                                 message):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    flags = [f.format(blocker=blocker) for f in flags]
    rc = main(["bench", "throughput", "--model", str(tmp_path / "no-model"), *flags])
    assert rc == 2
    assert f"pagedserve: error: {message.format(blocker=blocker)}" in capsys.readouterr().err
