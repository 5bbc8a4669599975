"""What each of a request's deltas carries (LLMEngine.step, RequestOutputKind.DELTA): a delta
as soon as a sample holds --stream-interval tokens, the first token's time on the first
delta (and the final one), the prompt's logprobs once, and one token time a step however
many samples the request has. On the tiny random-weight Llama."""

import dataclasses

import pytest
from engine_utils import greedy, make_engine, run

from pagedserve.scheduler import SamplingParams

PROMPT = [100, 200, 300, 400, 500]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


def _deltas(eng, prompt, params):
    eng.add_request(prompt, params)
    out = []
    while eng.has_unfinished_requests():
        out += eng.step()
    return out


def test_stream_interval_sends_a_delta_as_soon_as_it_holds_that_many_tokens(tiny_llama):
    eng = make_engine(tiny_llama, stream_interval=4)
    counts = [len(d.outputs[0].token_ids) for d in _deltas(eng, PROMPT, greedy(13))]
    assert counts == [1, 4, 4, 4]  # the first token at once, then every 4th


def test_a_finished_sample_is_not_held_for_its_siblings_tokens(tiny_llama):
    """stream_interval holds a running request's delta until one of its samples has that many
    new tokens; a sample that has ended is not held with it: its end (and its last tokens)
    go at once, as vLLM reports each sample of a request on its own."""
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    [whole] = run(make_engine(tiny_llama), [PROMPT], params)
    first, second = (o.token_ids for o in whole.outputs)
    stop = first[2]
    assert stop not in first[:2] + second  # the premise: the first sample alone stops, 3rd
    eng = make_engine(tiny_llama, stream_interval=4)
    deltas = _deltas(eng, PROMPT, dataclasses.replace(params, stop_token_ids=[stop]))
    ends = [i for i, d in enumerate(deltas) for o in d.outputs
            if o.index == 0 and o.finish_reason == "stop"]
    # The step it ended in: the delta after the first token's, not the one 2 steps later
    # where the other sample has 4 new tokens (the final delta lists every sample again).
    assert ends == [1, len(deltas) - 1]
    assert [o.token_ids for o in deltas[1].outputs] == [first[1:3], second[1:3]]


def test_first_token_time_is_on_the_first_and_the_final_delta_only(engine):
    deltas = _deltas(engine, PROMPT, greedy(5))
    assert len(deltas) == 5
    times = [d.first_token_time for d in deltas]
    assert times[0] is not None and times[-1] == times[0]
    assert times[1:-1] == [None] * 3


def test_prompt_logprobs_come_in_exactly_one_delta(engine):
    deltas = _deltas(engine, PROMPT, greedy(4, prompt_logprobs=1))
    assert [d.prompt_logprobs is not None for d in deltas] == [True, False, False, False]
    assert len(deltas[0].prompt_logprobs) == len(PROMPT)


def test_token_times_has_one_entry_per_step_however_many_samples(engine):
    [out] = run(engine, [PROMPT], greedy(4, n=3))
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 4 for o in out.outputs)
    assert len(out.token_times) == 4
    assert out.token_times == sorted(set(out.token_times))
