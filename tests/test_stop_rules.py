"""When a sample stops (docs/design.md §4): min_tokens holds EOS and stop strings back until
that many tokens are out, then lets them stop at once, as vLLM's rules; ignore_eos shows
the EOS text; text held back for a stop string that never comes is flushed at the end. On
the tiny random-weight Llama, steered by logit_bias and allowed_token_ids so that the
outcome does not depend on its weights, and on the embedded model where text matters."""

import pytest
from engine_utils import greedy, make_engine, run

from pagedserve.engine import InvalidRequest, SamplingParams

PROMPT = [100, 200, 300, 400, 500]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


def test_eos_comes_as_soon_as_min_tokens_are_out(engine):
    """EOS (the likeliest token by far here) cannot be sampled until min_tokens tokens are
    out; then it can at once."""
    eos = engine.tokenizer.eos_token_ids[0]
    [out] = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=10, min_tokens=3,
                                                 logit_bias={eos: 100}))
    o = out.outputs[0]
    assert o.finish_reason == "stop"
    assert len(o.token_ids) == 3 + 1 and o.token_ids[-1] == eos
    assert eos not in o.token_ids[:-1]


def test_eos_forced_before_min_tokens_does_not_stop(engine):
    """Nothing but EOS is allowed, so the min_tokens mask yields to it; the sample still runs
    to min_tokens before it stops."""
    eos = engine.tokenizer.eos_token_ids[0]
    [out] = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=10, min_tokens=4,
                                                 allowed_token_ids=[eos]))
    o = out.outputs[0]
    assert o.token_ids == [eos] * 4
    assert o.finish_reason == "stop"


def test_ignore_eos_shows_eos_text_mid_stream(engine):
    eos = engine.tokenizer.eos_token_ids[0]
    eos_text = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert eos_text
    [out] = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                 skip_special_tokens=False,
                                                 logit_bias={eos: 100}))
    o = out.outputs[0]
    assert o.token_ids == [eos] * 3 and o.finish_reason == "length"
    assert o.text == eos_text * 3


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(max_tokens=2, min_tokens=3).validate()
    assert e.value.param == "min_tokens"


def test_text_held_for_a_stop_string_that_never_comes_is_flushed_at_the_end(engine):
    [plain] = run(engine, [PROMPT], greedy(12))
    [held] = run(engine, [PROMPT], greedy(12, stop=["zzzz-never-appears"]))
    assert plain.outputs[0].text  # the premise: some text
    assert held.outputs[0].finish_reason == "length"
    assert held.outputs[0].text == plain.outputs[0].text


def test_a_stop_string_in_the_min_tokens_th_token_is_text(embedded):
    """vLLM's: stop strings are looked for once the output is past min_tokens; one that ends
    in the min_tokens-th token's text is text like any other."""
    engine, prompt = make_engine(embedded), "Write a short story about a robot who paints."
    [ref] = run(engine, [prompt], greedy(24, min_tokens=12))
    ids = ref.outputs[0].token_ids
    texts = [engine.tokenizer.decode(ids[:m]) for m in range(len(ids) + 1)]
    # the text the m-th token adds ("" where it does not extend the text before)
    piece = {m: texts[m][len(texts[m - 1]):] if texts[m].startswith(texts[m - 1]) else ""
             for m in range(6, 12)}
    m = next(m for m in piece if piece[m].strip() and piece[m] not in texts[m - 1])
    [out] = run(engine, [prompt], greedy(24, min_tokens=m, stop=[piece[m]]))
    assert len(out.outputs[0].token_ids) > m
    assert out.outputs[0].text.startswith(texts[m])
