"""The server's engine loop with a scripted stand-in engine (no model): loading state, an
idle loop that sleeps, a failed step that fails only its own requests, and an engine that
dies (its rebuild fails) while HTTP keeps answering, with the engine loop in a thread and in
a process of its own. The app runs under a real uvicorn in a thread."""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import pickle
import re
import threading
import time

import httpx
import pytest
import uvicorn
from test_server_utils import free_port, sse_events
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from pagedserve.engine import CompletionOutput, RequestOutput, SamplingParams
from pagedserve.models.generation_config import SamplingDefaults
from pagedserve.server import responses
from pagedserve.server.app import ServerConfig, build_app
from pagedserve.server.request_group import RequestGroup


class FakeTokenizer:
    """One token per character; id 0 is EOS."""

    # What the server's detokenizer decodes with: token i is chr(i), joined without spaces.
    backend = HFTokenizer(models.WordLevel({chr(i): i for i in range(1000)}, unk_token="\0"))
    backend.decoder = decoders.Fuse()
    eos_token_ids = [0]
    max_chars_per_token = 1
    bos_token_id = None
    add_bos = False
    vocab_size = 1000
    special_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 999 + 1 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i)

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool,
                    max_chars: int | None = None) -> list[int]:
        text = "".join(f"{m['role']}:{m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)


class FakeEngine:
    """Emits a delta of one "x" per step per request; a prompt starting with "!" makes
    step() raise (every request is in every step), and "!!" also makes the rebuild fail."""

    model_name = "fake"
    grammars = None
    reasoning = None  # (no --reasoning-parser)
    max_model_len = 256
    vocab_size = 1000

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.sampling_defaults = SamplingDefaults()
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.calls = 0  # has_unfinished_requests() calls: the loop's wake-ups

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str) -> str:
        params.validate()
        self.requests[request_id] = (prompt, params, [])
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        self.calls += 1
        return bool(self.requests)

    def stats(self) -> dict[str, int]:
        running = len(self.requests)
        return {"num_requests_running": running, "num_requests_waiting": 0,
                "kv_blocks_used": running, "num_kv_blocks": 8, "kv_blocks_shared": 0}

    def fail_step(self) -> tuple[list[str], bool]:
        failed = sorted(self.requests)
        poisoned = any(p[:2] == [ord("!") + 1] * 2 for p, _, _ in self.requests.values())
        self.requests.clear()
        return failed, not poisoned

    def reset(self) -> list[str]:
        raise RuntimeError("simulated rebuild failure")

    def close(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        time.sleep(0.02)
        if any(p[:1] == [ord("!") + 1] for p, _, _ in self.requests.values()):
            raise RuntimeError("simulated kernel failure")
        outs = []
        for rid, (prompt, params, tokens) in list(self.requests.items()):
            tokens.append(ord("x"))
            done = len(tokens) >= (params.max_tokens or 10**9)
            outs.append(RequestOutput(
                rid, None, prompt,
                [CompletionOutput(i, "x" if params.detokenize else "", [ord("x")],
                                  "length" if done else None)
                 for i in range(params.n)],
                finished=done, arrival_time=time.monotonic()))
            if done:
                del self.requests[rid]
        return outs


class GatedFactory:
    """A FakeEngine once ``gate`` is set. Pickles (with a spawn context's Event), so that an
    engine process can be handed it."""

    def __init__(self, gate) -> None:
        self.gate = gate

    def __call__(self) -> FakeEngine:
        self.gate.wait(30)
        return FakeEngine()


class InProcessServer:
    def __init__(self, factory, engine_process: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(ServerConfig(engine_process=engine_process), factory)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def gated():
    """A server whose engine loads only once the test sets the returned event."""
    gate = threading.Event()
    engines: list[FakeEngine] = []

    def factory() -> FakeEngine:
        gate.wait(30)
        engines.append(FakeEngine())
        return engines[-1]

    srv = InProcessServer(factory)
    srv.gate, srv.engines = gate, engines
    yield srv
    gate.set()
    srv.stop()


@pytest.fixture(params=["thread", "process"])
def gated_either(request):
    """A gated server with its engine loop in a thread, or in a process of its own."""
    if request.param == "process":
        gate = multiprocessing.get_context("spawn").Event()
    else:
        gate = threading.Event()
    srv = InProcessServer(GatedFactory(gate), engine_process=request.param == "process")
    srv.gate = gate
    yield srv
    gate.set()
    srv.stop()


def wait_health(url: str, status: int) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").status_code != status:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def loaded(srv: InProcessServer) -> str:
    """Let a gated server's engine load; its URL once /health says it is ready."""
    srv.gate.set()
    wait_health(srv.url, 200)
    return srv.url


def test_loading_then_ready_and_idle_loop_sleeps(gated):
    url = gated.url
    assert httpx.get(url + "/health").status_code == 503
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["message"]
    assert httpx.get(url + "/metrics").status_code == 200
    gated.gate.set()
    wait_health(url, 200)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.json()["choices"][0]["text"] == "xxx"
    engine = gated.engines[0]
    calls = engine.calls
    time.sleep(0.5)
    assert engine.calls - calls <= 2  # asleep on the condition, not spinning


def test_failed_step_fails_its_requests_and_the_engine_goes_on(gated_either):
    url = loaded(gated_either)
    body = {"prompt": "hello", "max_tokens": 256, "stream": True}  # (5 s of steps)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert "choices" in next(sse_events(lines))
        # A request that makes the step fail; the stream is in the same step.
        failed = httpx.post(url + "/v1/completions", json={"prompt": "!boom"}, timeout=30)
        rest = list(sse_events(lines))
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == "step_failed" and error["type"] == "server_error"
    assert "simulated" not in error["message"]  # internals stay in the log
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "step_failed"
    assert set(rest[-2]["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health").status_code == 200
    again = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == "xx"


def test_a_stream_that_fails_to_decode_fails_alone(gated_either, monkeypatch):
    """A stream's text is decoded on the server's side (RequestGroup.fill_text): if that
    raises, the stream ends with a step_failed error and its request is aborted in the
    engine, while another stream in the same events goes on."""
    real = RequestGroup.fill_text

    def fill_text(group: RequestGroup, index: int, output: RequestOutput) -> None:
        if group.prompts[index][0] == FakeTokenizer().encode("?")[0]:
            raise RuntimeError("simulated decoding failure")
        real(group, index, output)

    monkeypatch.setattr(RequestGroup, "fill_text", fill_text)
    url = loaded(gated_either)
    body = {"prompt": "hello", "max_tokens": 256, "stream": True}  # (5 s of steps)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(sse_events(lines))["choices"][0]["text"] == "x"
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={**body, "prompt": "?bad"}) as bad:
            events = list(sse_events(bad.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "step_failed"
        assert all(e["choices"][0]["text"] == "x" for e in itertools.islice(
            sse_events(lines), 5))  # the other stream goes on
    assert httpx.get(url + "/health").status_code == 200
    deadline = time.monotonic() + 10  # both aborted in the engine: nothing left running
    while not re.search(r"^pagedserve_num_requests_running\{.*\} 0\.0$",
                        httpx.get(url + "/metrics").text, re.MULTILINE):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_stream_whose_chunks_fail_ends_with_an_error_event(gated_either, monkeypatch):
    """A bug while building a stream's chunks (not a failed request) ends the stream with a
    server_error event and [DONE], as vLLM does, not a body cut off mid-chunk; the request
    is aborted in the engine and the server goes on."""
    failing, real = True, responses.merge_deltas

    def merge_deltas(batch):
        if failing:
            raise RuntimeError("simulated bug")
        return real(batch)

    monkeypatch.setattr(responses, "merge_deltas", merge_deltas)
    url = loaded(gated_either)
    body = {"prompt": "hello", "max_tokens": 256, "stream": True}  # (5 s of steps)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert "simulated" not in events[-2]["error"]["message"]  # internals stay in the log
    failing = False
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={**body, "max_tokens": 3}) as r:
        events = list(sse_events(r.iter_lines()))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "xxx"
    deadline = time.monotonic() + 10  # the failed stream's request aborted: nothing running
    while not re.search(r"^pagedserve_num_requests_running\{.*\} 0\.0$",
                        httpx.get(url + "/metrics").text, re.MULTILINE):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_engine_death_fails_inflight_and_http_keeps_answering(gated_either):
    url = loaded(gated_either)
    dead = httpx.post(url + "/v1/completions", json={"prompt": "!!boom"}, timeout=30)
    assert dead.status_code == 500 and dead.json()["error"]["code"] == "engine_dead"
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    again = httpx.post(url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})
    assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.get(url + "/version").status_code == 200


def test_a_server_stopped_while_loading_exits_at_once(gated_either):
    """Shutting down does not wait for a load in progress; a loading engine process is
    killed."""
    engine = gated_either.app.state.ctx.engine
    assert httpx.get(gated_either.url + "/health").status_code == 503
    start = time.monotonic()
    gated_either.stop()
    assert time.monotonic() - start < 10 and engine.state == "stopped"
    if engine.engine_process:
        engine._worker.join(10)
        assert not engine._worker.is_alive()


class BrokenStatsEngine(FakeEngine):
    """A FakeEngine whose stats() raises (outside the fault barrier) once a prompt starting
    with "?" is in."""

    def stats(self) -> dict[str, int]:
        if any(p[:1] == [ord("?") + 1] for p, _, _ in self.requests.values()):
            raise RuntimeError("simulated bug outside the fault barrier")
        return super().stats()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_bug_outside_the_fault_barrier_kills_the_engine_not_the_requests(mode):
    """Requests in flight fail and /health says dead; nothing hangs."""
    srv = InProcessServer(BrokenStatsEngine, engine_process=mode == "process")
    try:
        wait_health(srv.url, 200)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "?boom"}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "dead" and "simulated bug" in health["error"]
        again = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert again.status_code == 503
    finally:
        srv.stop()


def test_delivered_pickles_every_field_of_its_outputs():
    """Delivered pickles as plain tuples (engine_messages._output_row), not as the dataclasses:
    every field, set to a value unlike its default, survives the trip, and a field added to
    RequestOutput or CompletionOutput fails here until the row carries it too. A running
    request's delta of one sample without logprobs goes as a short row: its sample (index,
    text, token ids) and cached count survive; its request id (the server's group has it)
    and timings (read from the first delta and the final one, which go whole) do not. With
    logprobs it goes whole."""
    from dataclasses import fields

    from pagedserve.engine.sampler import TokenLogprob
    from pagedserve.server.engine_messages import Delivered

    logprob = TokenLogprob(7, -0.5, [(7, -0.5), (8, -1.5)], rank=1)
    sample = {"index": 1, "text": "hi", "token_ids": [7, 9], "finish_reason": "stop",
              "logprobs": [logprob], "stop_reason": "\n\n"}
    output = {"request_id": "cmpl-1-0", "prompt": "a prompt", "prompt_token_ids": [3, 4],
              "outputs": [CompletionOutput(**sample)], "finished": True,
              "num_cached_tokens": 16, "arrival_time": 1.5, "first_scheduled_time": 2.5,
              "first_token_time": 3.5, "finished_time": 4.5, "token_times": [3.5, 4.5],
              "prompt_logprobs": [None, logprob]}
    assert set(sample) == {f.name for f in fields(CompletionOutput)}
    assert set(output) == {f.name for f in fields(RequestOutput)}
    event = Delivered([("group-1", 2, RequestOutput(**output))])
    assert pickle.loads(pickle.dumps(event)) == event
    running = RequestOutput(**{**output, "prompt": None, "prompt_token_ids": [],
                               "finished": False, "prompt_logprobs": None,
                               "first_token_time": None, "token_times": [],
                               "outputs": [CompletionOutput(**{**sample, "finish_reason": None,
                                                               "logprobs": None,
                                                               "stop_reason": None})]})
    [(group_id, index, back)] = pickle.loads(pickle.dumps(Delivered([("g", 3, running)]))).items
    assert (group_id, index, back.outputs, back.num_cached_tokens) == ("g", 3, running.outputs, 16)
    assert back.request_id == "" and not back.finished  # left out, as are the timings:
    assert back.arrival_time == 0.0 and back.first_token_time is None
    # A request's first delta carries its first token's time (the TTFT metric): whole.
    first = dataclasses.replace(running, first_token_time=3.5)
    assert pickle.loads(pickle.dumps(Delivered([("g", 0, first)]))).items == [("g", 0, first)]
    with_logprobs = dataclasses.replace(running, outputs=[
        CompletionOutput(**{**sample, "finish_reason": None})])
    event = Delivered([("g", 0, with_logprobs)])
    assert pickle.loads(pickle.dumps(event)) == event


def test_a_request_aborted_before_its_fork_counts_every_sample():
    """requests_finished counts by sample (vLLM's child requests): an n=3 request aborted
    before its prompt was forked lists one sample, or none; the rest count as aborts too."""
    from pagedserve.server.engine_messages import Snapshot
    from pagedserve.server.metrics import ServerMetrics

    metrics = ServerMetrics(Snapshot, lambda: "m")
    metrics.on_loaded()
    metrics.on_finished(RequestOutput("r", None, [], [], True), 3)
    metrics.on_finished(RequestOutput("s", None, [], [
        CompletionOutput(0, "x", [5], "length"), CompletionOutput(1, "", [], None)], True), 3)
    counts = {reason: metrics.registry.get_sample_value(
        "pagedserve_requests_finished_total", {"model_name": "m", "finished_reason": reason})
        for reason in ("stop", "length", "abort")}
    assert counts == {"stop": 0.0, "length": 1.0, "abort": 5.0}
