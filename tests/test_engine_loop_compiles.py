"""The engine loop adds a request whose constraint has not compiled yet (an engine in a
process of its own compiles each one once more) only once it has: the compile runs on the
compile threads, and the other requests are added and stepped meanwhile."""

from __future__ import annotations

import gc
import json
import logging
import threading

import pytest
from engine_utils import compile_threads_held, greedy, make_engine

from pagedserve.engine import SamplingParams, StructuredOutputs
from pagedserve.server.engine_loop import EngineLoop, ThreadInbox
from pagedserve.server.engine_messages import (
    Abort,
    Add,
    Added,
    Delivered,
    Loaded,
    Snapshot,
    Stop,
)

PROMPT = [5, 6, 7, 8, 9]


def _slow(properties: int) -> StructuredOutputs:
    """A schema that takes a good fraction of a second to compile (its properties required:
    hundreds of optional ones would be more than llguidance's parser follows)."""
    names = [f"p{i}" for i in range(properties)]
    return StructuredOutputs(json=json.dumps({
        "type": "object", "properties": {n: {"type": "integer"} for n in names},
        "required": names, "additionalProperties": False}))


class Loop:
    def __init__(self, engine):
        self.engine, self.inbox, self.events = engine, ThreadInbox(), []
        self._cond = threading.Condition()
        self.loop = EngineLoop(lambda: engine, self.inbox, self._emit)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()
        self.wait_for(lambda: any(isinstance(e, Loaded) for e in self.events))

    def _emit(self, events) -> None:
        with self._cond:
            self.events += events
            self._cond.notify_all()

    def wait_for(self, done) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: done(), timeout=120), self.events

    def added(self) -> list[str]:
        return [e.group_id for e in self.events if isinstance(e, Added) and e.error is None]

    def refused(self) -> list[Added]:
        return [e for e in self.events if isinstance(e, Added) and e.error is not None]

    def finished(self) -> set[str]:
        return {group for e in self.events if isinstance(e, Delivered)
                for group, _, out in e.items if out.finished}

    def stop(self) -> None:
        self.inbox.put(Stop())
        self.thread.join(timeout=60)


def test_a_slow_compile_holds_up_no_other_request(tiny_llama):
    loop = Loop(make_engine(tiny_llama))
    try:
        slow = SamplingParams(max_tokens=4, structured_outputs=_slow(3000))
        with compile_threads_held():  # the constraint's compile waits its turn
            loop.inbox.put(Add("slow", ["s"], [PROMPT], slow))
            loop.inbox.put(Add("plain", ["p"], [PROMPT], greedy(4)))
            loop.wait_for(lambda: "plain" in loop.finished())
            assert loop.added() == ["plain"]
        loop.wait_for(lambda: "slow" in loop.finished())
        assert loop.added() == ["plain", "slow"]
        # Compiled now, in the engine's cache: not compiled again. Its request waits only
        # for a matcher of its own (built on a compile thread), the other one not at all.
        compiles = loop.engine.grammars.compiles
        loop.inbox.put(Add("slow-again", ["s2"], [PROMPT], slow))
        loop.inbox.put(Add("plain-again", ["p2"], [PROMPT], greedy(4)))
        loop.wait_for(lambda: {"slow-again", "plain-again"} <= loop.finished())
        assert sorted(loop.added()[2:]) == ["plain-again", "slow-again"]
        assert loop.engine.grammars.compiles == compiles
    finally:
        loop.stop()
    assert loop.engine.block_manager.num_used_blocks == 0


def test_a_compile_that_cannot_start_fails_its_request_not_the_engine(tiny_llama, monkeypatch):
    """No compile thread could be started (a host out of threads): the constrained request
    is refused, and the engine goes on (it had died, failing every client)."""
    from pagedserve.structured import workers

    submit = workers.submit

    def refused(*args):
        raise RuntimeError("no thread could be started for grammar compiles")

    monkeypatch.setattr(workers, "submit", refused)
    loop = Loop(make_engine(tiny_llama))
    try:
        constrained = SamplingParams(max_tokens=4, structured_outputs=_slow(3))
        loop.inbox.put(Add("constrained", ["c"], [PROMPT], constrained))
        loop.inbox.put(Add("plain", ["p"], [PROMPT], greedy(4)))
        loop.wait_for(lambda: "plain" in loop.finished())
        [refusal] = loop.refused()
        assert refusal.group_id == "constrained" and "no thread" in str(refusal.error)
        monkeypatch.setattr(workers, "submit", submit)
        loop.inbox.put(Add("again", ["a"], [PROMPT], constrained))
        loop.wait_for(lambda: "again" in loop.finished())
    finally:
        loop.stop()
    assert loop.engine.block_manager.num_used_blocks == 0


def test_a_compile_that_fails_on_its_thread_is_not_compiled_again_on_the_loop(tiny_llama,
                                                                              monkeypatch):
    """A compile that fails with an error of the server's own (a MemoryError: not kept as a
    refusal) fails its request at once; adding it had compiled it again on the engine loop,
    every other request's steps waiting for that compile."""
    from pagedserve.structured.grammar import GrammarCompiler

    builds = []

    def out_of_memory(self, constraint):
        builds.append(threading.current_thread().name)
        raise MemoryError("a grammar too large")

    monkeypatch.setattr(GrammarCompiler, "_build", out_of_memory)
    loop = Loop(make_engine(tiny_llama))
    try:
        constrained = SamplingParams(max_tokens=4, structured_outputs=_slow(3))
        loop.inbox.put(Add("constrained", ["c"], [PROMPT], constrained))
        loop.wait_for(loop.refused)
        [failed] = loop.refused()
        assert failed.group_id == "constrained" and "MemoryError" in str(failed.error)
        loop.inbox.put(Add("plain", ["p"], [PROMPT], greedy(4)))
        loop.wait_for(lambda: "plain" in loop.finished())
    finally:
        loop.stop()
    assert len(builds) == 1 and builds[0].startswith("pagedserve-grammar"), builds
    assert loop.engine.block_manager.num_used_blocks == 0


def test_an_idle_loop_sleeps_while_a_compile_waits_and_wakes_when_it_ends(tiny_llama):
    """Nothing to step and a compile pending: the loop sleeps on its inbox (one snapshot an
    iteration, none meanwhile), and the compile's end wakes it to add the request."""
    import time

    loop = Loop(make_engine(tiny_llama))
    try:
        with compile_threads_held():
            loop.inbox.put(Add("slow", ["s"], [PROMPT], SamplingParams(
                max_tokens=4, structured_outputs=_slow(2700))))
            time.sleep(0.1)  # the add is taken, its compile queued
            before = sum(isinstance(e, Snapshot) for e in loop.events)
            time.sleep(0.5)
            assert sum(isinstance(e, Snapshot) for e in loop.events) == before
            assert loop.added() == []
        loop.wait_for(lambda: "slow" in loop.finished())
    finally:
        loop.stop()


def test_a_wake_ends_the_engine_processs_blocked_take():
    """The engine process's inbox (its servers' pipes) wakes from another thread too, and a
    command still arrives after."""
    import multiprocessing
    import time

    from pagedserve.server.engine_process import PipeInbox

    read, write = multiprocessing.Pipe(duplex=False)
    inbox = PipeInbox([read])
    threading.Timer(0.2, inbox.wake).start()
    started = time.monotonic()
    assert inbox.take(block=True) == []
    assert 0.1 < time.monotonic() - started < 10
    write.send(Abort(["x"]))
    assert inbox.take(block=True) == [Abort(["x"])]


def test_a_request_aborted_or_stopped_while_compiling_ends(tiny_llama):
    engine = make_engine(tiny_llama)
    loop = Loop(engine)
    with compile_threads_held():
        loop.inbox.put(Add("gone", ["g"], [PROMPT],
                           SamplingParams(max_tokens=64, ignore_eos=True,
                                          structured_outputs=_slow(2500))))
        loop.inbox.put(Abort(["g"]))
        loop.wait_for(lambda: any(isinstance(e, Added) and e.group_id == "gone"
                                  for e in loop.events))
    said = next(e for e in loop.events if isinstance(e, Added) and e.group_id == "gone")
    assert "aborted while its constraint compiled" in str(said.error)
    assert not engine.has_unfinished_requests() and not loop.loop.compiling
    assert engine.block_manager.num_used_blocks == 0
    assert not loop.loop.aborted_while_compiling
    # Stopped with a compile waiting: the loop ends (the server fails what it still waits
    # for), and nothing is added after.
    with compile_threads_held():
        loop.inbox.put(Add("waiting", ["w"], [PROMPT],
                           SamplingParams(max_tokens=4, structured_outputs=_slow(2600))))
        loop.stop()
    assert not loop.thread.is_alive()
    assert "waiting" not in loop.added()


def test_a_client_gone_during_its_compile_leaves_it_unrun(tiny_llama):
    """Over HTTP: a client that times out while its constraint's compile waits for a
    thread cancels it, and it never runs."""
    import time

    import httpx
    import pytest
    from test_server_engine_loop import InProcessServer, wait_health

    engine = make_engine(tiny_llama)
    srv = InProcessServer(lambda: engine)
    grammars = engine.grammars
    async_logs = _Records()
    logging.getLogger("asyncio").addHandler(async_logs)
    try:
        wait_health(srv.url, 200)
        with compile_threads_held():
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", timeout=0.5, json={
                    "prompt": PROMPT, "max_tokens": 1, "guided_json": json.loads(_slow(50).json)})
            deadline = time.monotonic() + 60  # until the server has seen the client go
            while time.monotonic() < deadline and not (grammars._compiling and all(
                    w is not None and w.cancelled() for job in list(grammars._compiling.values())
                    for w in job.waiters)):
                time.sleep(0.01)
        while grammars._compiling and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not grammars._compiling and grammars.compiles == 0
        adding = srv.app.state.ctx.engine._adding
        while adding and time.monotonic() < deadline:  # the add's refusal reached the server
            time.sleep(0.01)
        gc.collect()
        # An ordinary disconnect logs nothing: the refused add's answer had no reader, and
        # asyncio logged it as an exception never retrieved, with its traceback.
        assert not adding and not async_logs.records, [r.getMessage() for r in async_logs.records]
    finally:
        logging.getLogger("asyncio").removeHandler(async_logs)
        srv.stop()
    assert engine.block_manager.num_used_blocks == 0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_engine_in_a_process_of_its_own_compiles_the_constraints():
    """The server compiles no constraint (with the engine in a process of its own, a compile
    there too had doubled the wait): the engine loop does, before it adds the request. A
    good constraint is followed, and a bad one is still the request's 400, its field named."""
    import functools
    import time

    import httpx
    from test_server_engine_loop import InProcessServer

    from pagedserve.engine import EngineConfig, LLMEngine

    factory = functools.partial(LLMEngine, EngineConfig(num_kv_blocks=64, dtype="float32",
                                                        num_threads=1))
    srv = InProcessServer(factory, engine_process=True)
    try:
        deadline = time.monotonic() + 240  # a process to spawn, the embedded model to load
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": "Pick one:", "max_tokens": 4, "temperature": 0,
            "guided_choice": ["yes", "no"]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": "x", "max_tokens": 4, "guided_regex": "(unclosed"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_submitted_requests_take_matchers_built_ahead(tiny_llama, monkeypatch):
    """submit() builds a matcher for each request it announces, on a compile thread: their
    adds build none where they run (a build holds the interpreter ~0.3-20 ms). The matchers
    of adds that never came (refused, aborted) wait for the next ones, so many at most."""
    from pagedserve.structured import GrammarCompiler, grammar, workers

    compiler = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size)
    regex = StructuredOutputs(regex="(yes|no)-[0-9]{2}")
    compiler.submit(regex, 3).result(timeout=60)
    built_when_added = []
    run = workers.run
    monkeypatch.setattr(workers, "run", lambda fn, *a: built_when_added.append(fn) or run(fn, *a))
    for _ in range(3):
        compiler.guide(regex)
    assert built_when_added == []
    compiler.guide(regex)  # none left: built when asked for
    assert len(built_when_added) == 1
    for _ in range(3 * grammar._READY):
        compiler.submit(regex).result(timeout=60)
    assert len(compiler._cache[regex.key].ready) == grammar._READY
    assert compiler.compiles == 1

    def refused(*args):
        raise RuntimeError("no thread could be started for grammar compiles")

    monkeypatch.setattr(workers, "submit", refused)  # the waiter hears it, not a log
    with pytest.raises(RuntimeError, match="no thread could be started"):
        compiler.submit(regex).result(timeout=60)
