"""vLLM's repetition_detection: a sample whose output ends in a pattern of tokens repeated
min_count times ends early, finish_reason "repetition" with stop_reason
"repetition_detected" (vLLM 0.32's names and rules). The model is scripted
(tests/scripted_model.py): after token 300 its greedy output cycles 301 302 303 forever."""

from __future__ import annotations

import random

import httpx
import pytest
import torch
from engine_utils import make_engine, run
from scripted_model import save_scripted_llama
from test_server_utils import RemoteServer

from pagedserve.models.loader import load_model_files
from pagedserve.scheduler import InvalidRequest, RepetitionDetection, SamplingParams, repetition

START, CYCLE = 300, (301, 302, 303)
SCRIPT = {START: CYCLE[0], CYCLE[0]: CYCLE[1], CYCLE[1]: CYCLE[2], CYCLE[2]: CYCLE[0]}


def _repeats(output: list[int], rd: RepetitionDetection) -> bool:
    """The rule read plainly: the output ends in p tokens written min_count times."""
    c = rd.min_count
    return any(len(output) >= p * c and output[-p:] * c == output[-p * c:]
               for p in range(max(1, rd.min_pattern_size), rd.max_pattern_size + 1))


@pytest.mark.parametrize("budget", [repetition.RUN_BUDGET_PER_SIZE, 0])
def test_the_check_is_the_rule_read_plainly(budget, monkeypatch):
    """With the budget at 0 the runs are read in one pass (the Z-function) at the first
    size whose run holds a token: both readings give the rule's answer."""
    monkeypatch.setattr(repetition, "RUN_BUDGET_PER_SIZE", budget)
    rng = random.Random(0)
    for _ in range(4000):
        rd = RepetitionDetection(max_pattern_size=rng.randint(1, 6),
                                 min_count=rng.randint(2, 4))
        if rng.random() < 0.5:
            rd = RepetitionDetection(rd.max_pattern_size, rng.randint(0, rd.max_pattern_size),
                                     rd.min_count)
        prompt = [rng.randint(0, 2) for _ in range(rng.randint(0, 4))]
        unit = [rng.randint(0, 2) for _ in range(rng.randint(1, 4))]
        output = [rng.randint(0, 2) for _ in range(rng.randint(0, 6))] + unit * rng.randint(
            0, 4) + [rng.randint(0, 2) for _ in range(rng.randint(0, 1))]
        assert rd.found(prompt + output, len(prompt)) == _repeats(output, rd), (rd, output)
    # the prompt never counts: a pattern has to be in the output min_count times
    assert not RepetitionDetection(2, 0, 2).found([7, 8, 7, 8, 7], 3)
    assert RepetitionDetection(2, 0, 2).found([7, 8, 7, 8, 7], 1)
    assert not RepetitionDetection(0, 0, 0).found([7, 7, 7, 7], 0)  # off


def test_its_values_are_checked_as_vllm_checks_them():
    for bad in ({"max_pattern_size": -1}, {"max_pattern_size": 2, "min_pattern_size": 3,
                                           "min_count": 2},
                {"max_pattern_size": 2, "min_count": 1}, {"max_pattern_size": 2},
                {"max_pattern_size": 2.5, "min_count": 2}, {"max_pattern_size": True,
                                                            "min_count": 2}):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(repetition_detection=bad)
        assert e.value.param == "repetition_detection", bad
    with pytest.raises(InvalidRequest):
        SamplingParams(repetition_detection=3)
    assert SamplingParams(repetition_detection={}).repetition_detection == RepetitionDetection()
    given = SamplingParams(repetition_detection=RepetitionDetection(3, 1, 2))
    assert given.repetition_detection.max_pattern_size == 3


class _Counted(int):
    """A token that counts the comparisons made of it."""

    made = 0

    def __eq__(self, other: object) -> bool:
        _Counted.made += 1
        return int(self) == int(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = int.__hash__


def test_a_check_costs_at_most_linear_in_the_output():
    """Long near-repeats (a grammar can force them): read size by size, each size's run
    goes back thousands of tokens, 0.8 s a step at m=4000; past the budget one linear pass
    answers. The comparisons stay within a few times the output's length."""
    m = 2000
    output = [7] * (2 * m - 1) + [5] + [7] * (2 * m - 1)
    tokens = [_Counted(t) for t in output]
    rd = RepetitionDetection(max_pattern_size=len(output), min_pattern_size=m, min_count=2)
    _Counted.made = 0
    assert rd.found(tokens, 0) == _repeats(output, rd)
    assert _Counted.made < 6 * len(output), _Counted.made


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory, tiny_llama) -> str:
    path = tmp_path_factory.mktemp("scripted-loop")
    save_scripted_llama(path, tiny_llama.tokenizer, SCRIPT)
    return str(path)


def _ended(engine, max_tokens: int = 40, **kw) -> list[tuple[str, object, list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return [(o.finish_reason, o.stop_reason, o.token_ids)
            for o in run(engine, [[START]], params)[0].outputs]


def test_a_looping_sample_ends_once_its_pattern_has_come_min_count_times(looping_model):
    engine = make_engine(load_model_files(looping_model, torch.float32))
    loop = [*CYCLE] * 5
    threes = {"max_pattern_size": 3, "min_count": 3}
    assert _ended(engine, 40) == [("length", None, (loop * 3)[:40])]  # the model loops
    assert _ended(engine, repetition_detection=threes) == [
        ("repetition", "repetition_detected", loop[:9])]
    # a period of 3 read with pattern sizes up to 6: the smallest that repeats twice
    assert _ended(engine, repetition_detection={"max_pattern_size": 6, "min_count": 2}) == [
        ("repetition", "repetition_detected", loop[:6])]
    assert _ended(engine, 12, repetition_detection={"max_pattern_size": 2, "min_count": 2}
                  ) == [("length", None, loop[:12])]  # no pattern of 1 or 2 tokens repeats
    assert _ended(engine, 20, repetition_detection={"max_pattern_size": 6,
                                                     "min_pattern_size": 4, "min_count": 2}
                  ) == [("repetition", "repetition_detected", loop[:12])]  # 6 tokens, twice
    # not before min_tokens (read at each later token), and after the length (vLLM's order)
    assert _ended(engine, min_tokens=11, repetition_detection=threes) == [
        ("repetition", "repetition_detected", loop[:11])]
    assert _ended(engine, 9, repetition_detection=threes) == [("length", None, loop[:9])]
    # a stop string ended by the same token comes first too (the whole 9 tokens' text)
    text = engine.tokenizer.decode(loop[:9])
    assert _ended(engine, stop=[text], repetition_detection=threes) == [
        ("stop", text, loop[:9])]
    # every sample of a request, forked from one prefill, ends the same way
    assert _ended(engine, n=2, repetition_detection=threes) == [
        ("repetition", "repetition_detected", loop[:9])] * 2
    assert engine.block_manager.num_used_blocks == 0


def test_a_token_computed_ahead_does_not_change_where_it_ends(looping_model):
    """Under asynchronous scheduling the next step is scheduled before a step's token is
    read: the sample ends at the same token, the token computed past it dropped."""
    loaded = load_model_files(looping_model, torch.float32)
    threes = {"max_pattern_size": 3, "min_count": 3}
    ahead = make_engine(loaded, async_scheduling=True)
    assert _ended(ahead, repetition_detection=threes, n=2) == _ended(
        make_engine(loaded), repetition_detection=threes, n=2)


@pytest.mark.slow
def test_over_http_as_vllm_answers(looping_model):
    with RemoteServer("--model", looping_model, "--max-model-len", "256") as server:
        url = server.url
        # the series is there, at 0, before any request (as every finish reason's)
        assert 'pagedserve_requests_finished_total{finished_reason="repetition"' in "".join(
            line for line in httpx.get(url + "/metrics").text.splitlines()
            if line.endswith(" 0.0"))

        def complete(**body) -> httpx.Response:
            return httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": [START], "temperature": 0, "max_tokens": 30, **body})

        r = complete(repetition_detection={"max_pattern_size": 3, "min_count": 3})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("repetition",
                                                                   "repetition_detected")
        assert r.json()["usage"]["completion_tokens"] == 9
        plain = complete().json()["choices"][0]
        assert (plain["finish_reason"], plain["stop_reason"]) == ("length", None)
        # streamed: the last chunk with a choice says why
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": [START], "temperature": 0, "max_tokens": 30, "stream": True,
                "repetition_detection": {"max_pattern_size": 3, "min_count": 2}}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert '"finish_reason":"repetition"' in lines[-1].replace(" ", "")
        # chat: the prompt's last token is none of the script's, so the model writes token 0
        # over and over (zero logits), a pattern of one token
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "max_tokens": 30, "repetition_detection": {"max_pattern_size": 1, "min_count": 4}})
        assert r.json()["choices"][0]["finish_reason"] == "repetition", r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        for bad in ({"max_pattern_size": 3, "min_count": 1}, {"max_pattern_size": "x"}, 5):
            r = complete(repetition_detection=bad)
            assert r.status_code == 400, (bad, r.text)
            assert "repetition_detection" in str(r.json()["error"]["param"]), r.text
        metrics = httpx.get(url + "/metrics").text
        line = next(m for m in metrics.splitlines() if 'finished_reason="repetition"' in m
                    and m.startswith("pagedserve_requests_finished_total"))
        assert line.endswith(" 3.0"), line
