"""The engine's fault barrier, with faults injected into the real model runner and sampler of
a tiny random Llama: a failed step drops only its own requests (the others finish exactly
as they would have), every block comes back, and a pool left inconsistent is rebuilt from
the loaded weights (by the offline LLM too), its counters carried over. Then the same
through a live server: 500 for the failed request, 503 from /health while the engine
rebuilds, 200 after."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from engine_utils import greedy, make_engine, prompts_of_lengths, run
from test_server_engine_loop import InProcessServer, wait_health
from test_server_utils import wait_kv_free

import pagedserve.engine.llm_engine as llm_engine_module
from pagedserve.engine import LLM, LLMEngine, OutputCollector

PROMPTS = prompts_of_lengths([20, 37, 9], seed=3)
STEPS = 12
POISON = 99  # a prompt starting with this token id makes the injected fault fire


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def clean(tiny_llama) -> list[list[int]]:
    """Each prompt's greedy tokens in an engine that never failed."""
    return [tokens(run(make_engine(tiny_llama), [p], greedy(STEPS)))[0] for p in PROMPTS]


def finish(engine: LLMEngine, request_ids: list[str]) -> dict[str, list[int]]:
    """Step until idle, with no failure expected; the finished requests' tokens."""
    done: dict[str, list[int]] = {}
    collector = OutputCollector()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if (out := collector.add(delta)) is not None:
                done[out.request_id] = out.outputs[0].token_ids
    assert set(done) <= set(request_ids)
    return done


def assert_idle_and_sound(engine: LLMEngine) -> None:
    assert engine.block_manager.num_used_blocks == 0, "blocks leaked"
    engine.block_manager.check_invariants()


def fail_when_poisoned(seqs) -> None:
    if any(s.token_ids[0] == POISON for s in seqs):
        raise RuntimeError("injected fault")


def test_runner_fault_fails_only_that_steps_requests(tiny_llama, clean, monkeypatch):
    # One sequence per step: the poisoned request runs alone, the others wait their turn.
    engine = make_engine(tiny_llama, max_num_seqs=1)
    execute = engine.runner.execute

    def faulty_execute(batch, carried=None):
        fail_when_poisoned(batch.seqs)
        return execute(batch, carried)

    monkeypatch.setattr(engine.runner, "execute", faulty_execute)
    poisoned = engine.add_request([POISON, *PROMPTS[0]], greedy(STEPS))
    others = [engine.add_request(p, greedy(STEPS)) for p in PROMPTS]
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    failed, sound = engine.fail_step()
    assert failed == [poisoned] and sound
    done = finish(engine, others)
    assert [done[r] for r in others] == clean  # the survivors never noticed
    assert_idle_and_sound(engine)


def test_fault_under_async_scheduling_fails_the_step_in_flight_too(tiny_llama, clean,
                                                                    monkeypatch):
    """A step that fails while the previous one is still in flight (its tokens unread)
    drops the requests of both; a request in neither finishes as it would have."""
    engine = make_engine(tiny_llama, async_scheduling=True, max_num_seqs=2)
    execute = engine.runner.execute

    def faulty_execute(batch, carried=None):
        fail_when_poisoned(batch.seqs)
        return execute(batch, carried)

    monkeypatch.setattr(engine.runner, "execute", faulty_execute)
    running = engine.add_request(PROMPTS[0], greedy(STEPS))
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    poisoned = engine.add_request([POISON, *PROMPTS[1]], greedy(STEPS))
    waiting = engine.add_request(PROMPTS[2], greedy(STEPS))  # no seat for it yet
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    failed, sound = engine.fail_step()
    assert failed == sorted([running, poisoned]) and sound
    assert finish(engine, [waiting]) == {waiting: clean[2]}
    assert_idle_and_sound(engine)


def test_sampler_fault_after_a_fork_frees_the_children(tiny_llama, clean, monkeypatch):
    """The sampler runs after prefill-then-fork: the forked samples of a request in the
    failed step (which share its blocks) must go with it."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=64)
    sample = llm_engine_module.sample
    calls = []

    def faulty_sample(logits, rows, *args):
        calls.append(len(rows))
        if len(calls) == 2:  # the step where the poisoned prompt completes and forks
            raise RuntimeError("injected fault")
        return sample(logits, rows, *args)

    monkeypatch.setattr(llm_engine_module, "sample", faulty_sample)
    first = engine.add_request(PROMPTS[1], greedy(STEPS))
    engine.step()  # a 64-token budget prefills its 37 tokens whole (first sample call)
    forked = engine.add_request([POISON, *PROMPTS[2]], greedy(STEPS, n=3))
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()  # first's decode and forked's prefill share this step
    failed, sound = engine.fail_step()
    assert sorted(failed) == sorted([first, forked]) and sound
    assert not engine.has_unfinished_requests()
    assert_idle_and_sound(engine)
    # The engine goes on as if nothing had happened.
    assert tokens(run(engine, PROMPTS, greedy(STEPS))) == clean


def test_inconsistent_pool_is_rebuilt_from_the_loaded_weights(tiny_llama, clean, monkeypatch):
    engine = make_engine(tiny_llama)
    model, runner = engine.model, engine.runner

    def corrupting_execute(batch, carried=None):
        leak_a_block(engine)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "execute", corrupting_execute)
    request_ids = [engine.add_request(p, greedy(STEPS)) for p in PROMPTS[:2]]
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    failed, sound = engine.fail_step()
    assert not sound and sorted(failed) == sorted(request_ids)
    waiting = engine.add_request(PROMPTS[2], greedy(STEPS))  # not in the step: reset drops it
    assert engine.reset() == [waiting]
    assert engine.model is model and engine.runner is not runner  # same weights, new KV cache
    assert_idle_and_sound(engine)
    assert tokens(run(engine, PROMPTS, greedy(STEPS))) == clean


def leak_a_block(engine: LLMEngine) -> None:
    """A bug that takes a reference to a free block and never gives it back."""
    engine.block_manager._acquire(next(iter(engine.block_manager._free)))


# ---- through the server -----------------------------------------------------------------------
def inject_faults(engine: LLMEngine) -> None:
    """Its runner fails on a poisoned prompt, and first leaks a block when the prompt starts
    with POISON twice."""
    execute = engine.runner.execute

    def faulty_execute(batch, carried=None):
        if any(s.token_ids[:2] == [POISON, POISON] for s in batch.seqs):
            leak_a_block(engine)
        fail_when_poisoned(batch.seqs)
        return execute(batch, carried)

    engine.runner.execute = faulty_execute


@pytest.fixture
def faulty_server(tiny_llama):
    """A live server over a real engine with injected faults; its rebuilds are slowed down
    so that /health can be seen saying 503 meanwhile."""
    rebuilding = threading.Event()

    def factory() -> LLMEngine:
        engine = make_engine(tiny_llama)
        inject_faults(engine)
        reset = engine.reset

        def slow_reset() -> list[str]:
            rebuilding.set()
            time.sleep(1.0)
            dropped = reset()
            inject_faults(engine)  # the new runner is as faulty
            return dropped

        engine.reset = slow_reset
        return engine

    srv = InProcessServer(factory)
    srv.rebuilding = rebuilding
    wait_health(srv.url, 200)
    yield srv
    srv.stop()


def completion(url: str, prompt: list[int], **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True, **body})


def test_server_fails_the_request_then_rebuilds_and_serves(faulty_server, tiny_llama, clean):
    url = faulty_server.url
    expected = [tiny_llama.tokenizer.decode(t) for t in clean]
    r = completion(url, [POISON, *PROMPTS[0]])
    assert r.status_code == 500 and r.json()["error"]["code"] == "step_failed"
    assert "injected" not in r.json()["error"]["message"]  # internals stay in the log
    assert httpx.get(url + "/health").status_code == 200  # no rebuild was needed
    assert completion(url, PROMPTS[0]).json()["choices"][0]["text"] == expected[0]

    # A failure that leaves the pool inconsistent: /health says 503 during the rebuild.
    statuses: list[int] = []
    worker = threading.Thread(target=lambda: statuses.append(
        completion(url, [POISON, POISON, *PROMPTS[1]]).status_code))
    worker.start()
    assert faulty_server.rebuilding.wait(30)
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "rebuilding"
    busy = completion(url, PROMPTS[1])
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "engine_rebuilding"
    worker.join(30)
    assert statuses == [500]
    wait_health(url, 200)
    assert [completion(url, p).json()["choices"][0]["text"] for p in PROMPTS] == expected
    assert wait_kv_free(url) == 0


def test_offline_generate_rebuilds_a_pool_a_failed_step_left_unsound(tiny_llama, monkeypatch):
    """LLM.generate: a step that fails and leaves the block pool inconsistent (a leaked
    block) is dropped and the pool rebuilt, so the next call starts from a sound pool."""
    engine = make_engine(tiny_llama)
    llm = LLM.from_engine(engine)
    clean = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(8))]
    execute = engine.runner.execute
    fired = []

    def corrupting_execute(batch, carried=None):
        if not fired:
            fired.append(1)
            leak_a_block(engine)
            raise RuntimeError("injected fault")
        return execute(batch, carried)

    monkeypatch.setattr(engine.runner, "execute", corrupting_execute)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(PROMPTS, greedy(8))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0, "the leaked block is still held"
    engine.block_manager.check_invariants()
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(8))] == clean


def test_reset_keeps_the_counters_monotonic(tiny_llama):
    """reset() rebuilds the pool and scheduler but carries the counters over (they are
    Prometheus counters: a drop reads as a restart)."""
    engine = make_engine(tiny_llama)
    run(engine, PROMPTS, greedy(6))
    before = engine.stats()
    engine.reset()
    after = engine.stats()
    for key in ("prefill_tokens_computed", "steps", "output_tokens", "preemptions",
                "prefix_cache_queried_tokens", "peak_kv_blocks_used"):
        assert after[key] == before[key], key
    assert before["steps"] > 0 and before["output_tokens"] == 18
