"""A request's lists (stop strings, stop_token_ids, allowed_token_ids, logit_bias) cost
once a request, not once a sample a step: within the server's limits, 128 samples of an
8 MB allowed_token_ids list took a CPU server from 1.3 GB to 9 GB in 16 s."""

import pytest
import torch
from engine_utils import make_engine, prompts_of_lengths, run

from pagedserve.engine import LLM, InvalidRequest, SamplingParams, logits_processors
from pagedserve.scheduler import Sequence

N, STEPS = 8, 6


def listed(repeat: int) -> SamplingParams:
    """Every list at once, each id ``repeat`` times; min_tokens keeps the stop ids masked."""
    ids = list(range(100, 1100))
    return SamplingParams(
        n=N, temperature=1.0, seed=3, max_tokens=STEPS, min_tokens=STEPS,
        allowed_token_ids=ids * repeat, stop_token_ids=ids[::2] * repeat,
        logit_bias={i: 5.0 for i in ids[::3]}, stop=["zz", "yy"] * repeat)


def test_lists_keep_each_entry_once_and_refuse_what_is_no_id():
    p = listed(3)
    assert p.allowed_token_ids == list(range(100, 1100))
    assert p.stop_token_ids == list(range(100, 1100, 2))
    assert p.stop == ["zz", "yy"]
    for bad in ([[1]], [1.5], [-1]):  # (an unhashable list is refused, not a TypeError)
        with pytest.raises(InvalidRequest, match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad).validate(vocab_size=50)
    with pytest.raises(InvalidRequest, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 50]).validate(vocab_size=50)


def test_a_requests_lists_reach_the_device_once(tiny_llama, monkeypatch):
    """Over 6 steps of 8 samples, the host lists copied to the device hold each request list
    once (plus a few row indices a step), and the samples share one list of stop strings;
    the tokens are those of the same lists given with every entry three times."""
    copied = []
    to_device = logits_processors.on_device

    def counted(values, *args, **kwargs):
        copied.append(len(values))
        return to_device(values, *args, **kwargs)

    monkeypatch.setattr(logits_processors, "on_device", counted)
    engine = make_engine(tiny_llama)
    [prompt] = prompts_of_lengths([20], seed=2)
    params = listed(1)
    engine.add_request(prompt, params)
    engine.step()  # the prompt, then its forks
    samples = list(engine.outputs._state_of.values())
    assert len(samples) == N and all(s.detok.stop is params.stop for s in samples)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    # allowed (1,000), stop ids with EOS (500 + EOS), bias ids and values (334 each)
    lists = 1000 + 500 + len(engine.scheduler.config.eos_token_ids) + 2 * 334
    assert sum(copied) < lists + 60 * STEPS, sum(copied)

    monkeypatch.setattr(logits_processors, "on_device", to_device)
    [short] = run(make_engine(tiny_llama), [prompt], listed(1))
    [long] = run(make_engine(tiny_llama), [prompt], listed(3))
    assert [o.token_ids for o in short.outputs] == [o.token_ids for o in long.outputs]
    assert all(100 <= t < 1100 for o in short.outputs for t in o.token_ids)


def test_a_requests_prompts_validate_and_derive_its_lists_once(tiny_llama, monkeypatch):
    """Prompts that share one params object (a request's prompt list, as the server's engine
    loop adds them; LLM.generate's one params for all) validate it and derive its lists once:
    each had cleared the memo, so 1,024 prompts with a vocabulary-long stop_token_ids had
    held 1,024 copies of its set. A field set afterwards is validated and derived anew."""
    copied = []
    to_device = logits_processors.on_device
    monkeypatch.setattr(logits_processors, "on_device",
                        lambda values, *a, **k: copied.append(len(values)) or to_device(
                            values, *a, **k))
    engine = make_engine(tiny_llama)
    prompts = prompts_of_lengths([20, 9, 14, 30], seed=4)
    params = listed(1)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()
    enders = {id(s.hidden_enders) for s in engine.outputs._state_of.values()}
    assert len(engine.outputs._state_of) == 4 * N and len(enders) == 1
    while engine.has_unfinished_requests():
        engine.step()
    # allowed ids, stop ids with EOS, bias ids and values, each once (the rest: row indices)
    lists = sorted([1000, 500 + len(engine.scheduler.config.eos_token_ids), 334, 334])
    assert sorted(c for c in copied if c > 4 * N) == lists  # not once a prompt

    copied.clear()
    [one] = LLM.from_engine(engine).generate(prompts[:1], listed(1))
    outputs = LLM.from_engine(engine).generate(prompts, listed(1))  # one params for all
    assert sorted(c for c in copied if c > 4 * N) == sorted(lists * 2)
    assert [o.token_ids for o in outputs[0].outputs] == [o.token_ids for o in one.outputs]
    assert engine.block_manager.num_used_blocks == 0

    with pytest.raises(InvalidRequest, match="stop_token_ids"):  # passed, not for 50 ids
        params.validate(vocab_size=50)
    params.allowed_token_ids = [7, 8]
    params.stop_token_ids = [7]
    params.logit_bias = {}
    params.validate(vocab_size=50)
    assert params.stop_token_set == {7}
    params.top_p = 2.0
    with pytest.raises(InvalidRequest, match="top_p"):
        params.validate(vocab_size=50)


def test_a_prompts_tokens_reach_the_device_once_for_its_repetition_penalty(tiny_llama,
                                                                           monkeypatch):
    """repetition_penalty covers the prompt: its distinct tokens reach the device once a
    request, not once a sample a step (128 samples of a 32k-token prompt: 0.47 s a step)."""
    copied = []
    to_device = logits_processors.on_device
    monkeypatch.setattr(logits_processors, "on_device",
                        lambda values, *a, **k: copied.append(len(values)) or to_device(
                            values, *a, **k))
    [prompt] = prompts_of_lengths([300], seed=5)
    params = SamplingParams(n=N, temperature=1.0, seed=1, max_tokens=STEPS,
                            repetition_penalty=1.2)
    [out] = run(make_engine(tiny_llama), [prompt], params)
    assert [c for c in copied if c > N * STEPS] == [len(set(prompt))]
    assert len(out.outputs) == N and all(len(o.token_ids) == STEPS for o in out.outputs)


def test_a_reused_request_id_and_params_penalize_the_new_prompt():
    """repetition_penalty's prompt tokens belong to the request's samples, not to its
    params or its id: an offline caller may send another prompt with both again."""
    params = SamplingParams(repetition_penalty=2.0)
    for prompt in ([1, 2, 3], [7, 8, 9]):  # one request, then another with the same id
        seq = Sequence("same-id", prompt + [5], params, arrival=0.0, num_prompt_tokens=3)
        logits = torch.ones(1, 12)
        logits_processors.apply_penalties(logits, [seq], None)
        assert logits[0].tolist() == [0.5 if t in prompt + [5] else 1.0 for t in range(12)]
