"""Asynchronous scheduling (--async-scheduling, docs/design.md §8): each step is scheduled
and launched before the previous step's tokens are read back, and takes them as input ids on
the device. It must give exactly what the synchronous engine gives: the same tokens, text,
logprobs and finish reasons, for chunked prefills beside decodes, forks, preemption, stops
found only after the next step was launched (whose token is then dropped), penalties (the
token in flight joins them on the device), and grammars, which read the tokens on the host
and so settle them between the forward and the sampling. Here on
CPU, on the eager, decode-graph and piecewise paths (uncaptured); the GPU test runs it
captured (tests/test_gpu_engine.py)."""

from dataclasses import replace

import pytest
from engine_utils import greedy, make_engine, prompts_of_lengths, random_prompts, run

from pagedserve.engine import SamplingParams
from pagedserve.scheduler import PENDING_TOKEN, StructuredOutputs

PROMPTS = prompts_of_lengths([15, 49, 64, 70, 3], seed=21) + random_prompts(7, 5, 60, seed=22)


def _mixed_params(stop_token: int, stop_text: str) -> list[SamplingParams]:
    """Greedy with logprobs and lengths that end at different steps, seeded forks, a stop
    token and a stop string (both met mid-stream), min_tokens (with a stop token, and with
    stop strings), logit_bias (host-free) and logprob_token_ids."""
    params = [greedy(4 + 3 * i, logprobs=2) for i in range(4)]
    params += [greedy(16, logprob_token_ids=[5, 77, 5, 900])]  # (gathered beside top-k rows)
    params += [
        SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=14,
                       ignore_eos=True, logprobs=1),
        greedy(16, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=16, stop=[stop_text]),
        SamplingParams(temperature=0.7, seed=3, max_tokens=9, min_tokens=5,
                       stop_token_ids=[stop_token], stop=[" "], logit_bias={stop_token: 5.0}),
        greedy(1),
        greedy(11, prompt_logprobs=1),
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True),
    ]
    return params


def _summary(outputs) -> list:
    return [(o.prompt_logprobs and [lp and lp.logprob for lp in o.prompt_logprobs],
             [(s.token_ids, s.text, s.finish_reason,
               [v for lp in s.logprobs or [] for v in (lp.logprob, *(v for _, v in lp.top))],
               [[t for t, _ in lp.top] for lp in s.logprobs or []]) for s in o.outputs])
            for o in outputs]


def _run(loaded, params, prompts=PROMPTS, **config) -> tuple[list, int]:
    """Each request's summary, and how many steps took input ids from the device."""
    engine = make_engine(loaded, **config)
    if config.get("full_graphs"):  # not left off for want of kernels that take it
        assert engine.runner.pieces.whole
    execute, carried_steps = engine.runner.execute, 0

    def counted(batch, carried=None):
        nonlocal carried_steps
        carried_steps += carried is not None
        return execute(batch, carried)

    engine.runner.execute = counted
    outputs = run(engine, prompts, params)
    assert not engine.has_unfinished_requests() and engine._in_flight is None
    return _summary(outputs), carried_steps


def _same(sync: list, ahead: list) -> None:
    for (prompt_s, samples_s), (prompt_a, samples_a) in zip(sync, ahead, strict=True):
        assert prompt_a == pytest.approx(prompt_s, abs=1e-4)
        for (*same_s, lps_s, tops_s), (*same_a, lps_a, tops_a) in zip(
                samples_s, samples_a, strict=True):
            assert (same_a, tops_a) == (same_s, tops_s)  # tokens, text, reason; top ids
            assert lps_a == pytest.approx(lps_s, abs=1e-4)


@pytest.fixture(scope="module")
def stops(tiny_llama) -> tuple[int, str]:
    """A token and a piece of text that greedy decoding meets mid-stream."""
    out = run(make_engine(tiny_llama), PROMPTS[6:8], greedy(16))
    tokens, text = out[0].outputs[0].token_ids, out[1].outputs[0].text
    return tokens[6], text[len(text) // 2 : len(text) // 2 + 2]


@pytest.mark.parametrize(("config", "min_carried"), [
    ({}, 10),
    ({"max_num_batched_tokens": 19}, 10),  # chunked prefills beside carried decodes
    ({"num_kv_blocks": 12}, 10),  # preempted (while a token was in flight) and recomputed
    ({"enforce_eager": False}, 10),  # decode graphs' buffers take the carried ids
    ({"enforce_eager": False, "piecewise_graphs": True, "max_num_batched_tokens": 40}, 10),
    ({"enable_prefix_caching": False, "max_num_seqs": 3}, 10),
    ({"enforce_eager": False, "piecewise_graphs": True, "full_graphs": True,  # whole graphs
      "native_kernels": False, "max_num_batched_tokens": 40}, 10),  # (the references')
], ids=["whole", "chunked", "preempted", "decode-graphs", "piecewise", "no-cache-3-seqs",
        "full-graphs"])
def test_async_equals_sync(tiny_llama, stops, config, min_carried: int) -> None:
    params = _mixed_params(*stops)
    sync, carried = _run(tiny_llama, params, **config)
    ahead, carried_ahead = _run(tiny_llama, params, async_scheduling=True, **config)
    assert carried == 0 and carried_ahead >= min_carried
    _same(sync, ahead)
    reasons = {s[2] for _, samples in ahead for s in samples}
    assert reasons == {"length", "stop"}  # both kinds of stop met mid-stream
    if "num_kv_blocks" in config:
        engine = make_engine(tiny_llama, async_scheduling=True, **config)
        run(engine, PROMPTS, params)
        assert engine.stats()["preemptions"] > 0


def test_penalties_run_ahead_with_the_token_in_flight(tiny_llama) -> None:
    """Penalties read every earlier token; the one still being sampled joins them on the
    device (sampler's ``pending``), so steps that sample penalized sequences are launched
    before the previous one's tokens are read back, and give the synchronous engine's."""
    params = [SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.8),
              SamplingParams(temperature=0.8, seed=2, max_tokens=24, ignore_eos=True,
                             presence_penalty=1.5, frequency_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=24, frequency_penalty=2.0),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=-0.5),
              greedy(20, logprobs=1)]
    sync, _ = _run(tiny_llama, params, PROMPTS[:5])
    ahead, carried = _run(tiny_llama, params, PROMPTS[:5], async_scheduling=True)
    _same(sync, ahead)
    assert carried >= 15
    unpenalized = [replace(p, repetition_penalty=1.0, presence_penalty=0.0,
                           frequency_penalty=0.0) for p in params]
    assert _run(tiny_llama, unpenalized, PROMPTS[:5])[0] != sync  # the penalties bite


def test_grammars_settle_between_the_forward_and_the_sampling(tiny_llama) -> None:
    """A grammar's matcher reads the tokens on the host: a step that samples a guided
    sequence launches its forward with the token still in flight, settles the previous
    step, then samples; the tokens match the synchronous engine's, alone and beside
    greedy and penalized rows, a grammar completed while the next step was launched
    included (its row is dropped)."""
    guided = SamplingParams(temperature=1.0, seed=4, max_tokens=20,
                            structured_outputs=StructuredOutputs(regex="(yes|no)-[0-9]{2}"))
    alone, carried = _run(tiny_llama, [guided], PROMPTS[:1], async_scheduling=True)
    assert alone == _run(tiny_llama, [guided], PROMPTS[:1])[0]
    num_tokens = len(alone[0][1][0][0])
    assert num_tokens >= 4 and alone[0][1][0][2] == "stop"  # the grammar completed
    # Every decode took its input id from the device, and one more was launched before the
    # token completing the grammar was read (its row dropped).
    assert carried == num_tokens
    longer = replace(guided, structured_outputs=StructuredOutputs(regex="(yes|no)-[0-9]{2,40}"),
                     max_tokens=24)
    params = [guided, longer, greedy(30, logprobs=1),
              greedy(30, repetition_penalty=1.5, presence_penalty=0.3)]
    sync, _ = _run(tiny_llama, params, PROMPTS[:4])
    ahead, carried = _run(tiny_llama, params, PROMPTS[:4], async_scheduling=True)
    _same(sync, ahead)
    assert carried >= 25


def test_bad_words_of_several_tokens_settle_before_sampling(tiny_llama) -> None:
    """A bad word of several tokens is matched against a sample's last tokens on the host,
    so its steps settle the token in flight before sampling (as a grammar's do); one-token
    words need no history and run ahead. Both give the synchronous engine's tokens."""
    tokenizer = tiny_llama.tokenizer
    plain = greedy(20)
    tokens = _run(tiny_llama, [plain], PROMPTS[:1])[0][0][1][0][0]
    # A word of two tokens the greedy output shows, as the tokenizer reads its text back.
    word = next(w for i in range(len(tokens) - 1)
                if len(w := tuple(tokenizer.encode(text := tokenizer.decode(tokens[i:i + 2]),
                                                   add_special_tokens=False))) == 2
                and w == tuple(tokens[i:i + 2]) and not text[0].isspace())
    banned = [replace(plain, bad_words=[tokenizer.decode(list(word))]),
              replace(plain, bad_words=[tokenizer.decode(tokens[:1])])]
    params = [*banned, greedy(20, logprobs=1), SamplingParams(
        n=2, temperature=1.0, seed=9, max_tokens=20, ignore_eos=True,
        bad_words=[tokenizer.decode(list(word))])]
    sync, _ = _run(tiny_llama, params, PROMPTS[:4])
    ahead, carried = _run(tiny_llama, params, PROMPTS[:4], async_scheduling=True)
    _same(sync, ahead)
    assert carried >= 15
    assert sync[0][1][0][0] != tokens and sync[1][1][0][0][0] != tokens[0]  # the words bite


def test_abort_while_a_step_is_in_flight(tiny_llama) -> None:
    """An abort between steps finishes the request at once; the token its sequence gets
    from the step in flight is dropped, and every block comes back."""
    engine = make_engine(tiny_llama, async_scheduling=True)
    keep = engine.add_request(PROMPTS[0], greedy(12))
    drop = engine.add_request(PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=1,
                                                         max_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request(drop)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs[drop][-1].finished and {
        s.finish_reason for s in outputs[drop][-1].outputs} == {"abort"}
    assert sum(len(s.token_ids) for o in outputs[drop] for s in o.outputs) <= 2 * 4
    assert outputs[keep][-1].finished and engine.block_manager.num_used_blocks == 0
    assert engine._in_flight is None


def test_placeholder_never_reaches_the_model(tiny_llama) -> None:
    """The scheduled step's decodes whose last token is still being sampled are exactly
    the rows it takes from the device, and no PENDING_TOKEN is left in a finished
    sequence (the prefix cache hashes only settled tokens)."""
    engine = make_engine(tiny_llama, async_scheduling=True)
    execute = engine.runner.execute
    seen = []

    def checked(batch, carried=None):
        pending = [i for i, s in enumerate(batch.seqs)
                   if PENDING_TOKEN in s.token_ids[s.num_cached_tokens:]]
        seen.append(len(pending))
        assert pending == (carried.dst if carried is not None else [])
        return execute(batch, carried)

    engine.runner.execute = checked
    outputs = run(engine, PROMPTS[:6], greedy(8))
    assert max(seen) == 6
    assert all(PENDING_TOKEN not in s.token_ids for o in outputs for s in o.outputs)
    # Every cached block's content is real tokens.
    assert all(min(c.token_ids) >= 0 for c in engine.block_manager._content.values())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generated_blocks_are_hit_by_a_later_prompt(tiny_llama, async_scheduling) -> None:
    """A block completed by a token that was still being sampled when its slot was
    allocated is hashed once the token is known (at commit), so a later prompt that
    repeats the generated text hits it like any other."""
    engine = make_engine(tiny_llama, async_scheduling=async_scheduling)
    first = run(engine, PROMPTS[:1], greedy(40))[0]
    repeated = PROMPTS[0] + first.outputs[0].token_ids  # 55 tokens: 3 full blocks
    before = engine.stats()["prefix_cache_hit_tokens"]
    run(engine, [repeated], greedy(2))
    assert engine.stats()["prefix_cache_hit_tokens"] - before == 48
