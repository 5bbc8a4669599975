"""vLLM's logprob_token_ids: at every generated position the sampled token's logprob and the
asked ids', in place of the top k, each the value of the full distribution (checked against
HF's teacher-forced forward), beside rows of a batch that ask the top k or nothing."""

import math

import pytest
import torch
from engine_utils import hf_logprobs, make_engine, run

from pagedserve.engine.sampler import make_generator, sample
from pagedserve.scheduler import InvalidRequest, SamplingParams, Sequence

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def _rows(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"r{i}", [1], p, arrival=0.0) for i, p in enumerate(params)]


def test_the_asked_ids_follow_the_sampled_token_once_each_beside_top_k_rows():
    # each row its own logits (row i: LOGITS rolled by i), so that a row read from another
    # row's distribution shows; a short list before a long one (the gather's width)
    logits = torch.cat([LOGITS.roll(i, 1) for i in range(4)])
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=3, logprob_token_ids=[5]),
              SamplingParams(temperature=0, logprobs=2),
              SamplingParams(temperature=0, logprob_token_ids=[4, 1, 4, 3])]
    seqs = _rows(*params)
    generators = [make_generator(p.seed, 0) for p in params]
    tokens, lps = sample(logits, seqs, generators).to_host()
    assert lps[0] is None
    assert [t for t, _ in lps[1].top] == ([tokens[1], 5] if tokens[1] != 5 else [5])
    assert [t for t, _ in lps[2].top] == [2, 3]  # the top k, unchanged by its neighbours
    # the sampled token (3) first, then each asked id once, in the order asked
    assert [t for t, _ in lps[3].top] == [3, 4, 1]
    for i in (1, 2, 3):
        ref = torch.log_softmax(logits[i], -1)
        assert all(math.isclose(v, float(ref[t]), rel_tol=1e-6) for t, v in lps[i].top)


def test_asked_logprobs_equal_transformers_full_distribution(embedded, hf_from_gguf):
    """The embedded model, greedy: each asked id's logprob (and the sampled token's) is HF's
    teacher-forced log-softmax at that position; a top-k request in the same batch keeps
    its own shape."""
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 19556, 28, 957, 1475]]
    asked = [7042, 30, 17, 28, 49151]  # (49151: the last id of the vocabulary)
    engine = make_engine(embedded)
    outs = run(engine, prompts, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logprob_token_ids=asked),
                                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logprobs=3)])
    got = outs[0].outputs[0]
    ref = hf_logprobs(hf_from_gguf, prompts[0], got.token_ids).cpu()
    assert got.token_ids == ref.argmax(-1).tolist()
    for step, lp in enumerate(got.logprobs):
        assert [t for t, _ in lp.top] == list(dict.fromkeys([lp.token_id, *asked]))
        for token_id, value in lp.top:
            assert abs(value - float(ref[step, token_id])) < 1e-3, (step, token_id)
    assert all(len(lp.top) == 3 for lp in outs[1].outputs[0].logprobs)
    assert engine.block_manager.num_used_blocks == 0


def test_an_empty_list_asks_nothing():
    assert SamplingParams(logprob_token_ids=[]).num_logprobs is None
    assert SamplingParams(logprob_token_ids=[3, 3]).num_logprobs == 2  # (vLLM's count)
    assert SamplingParams(logprobs=4).num_logprobs == 4


@pytest.mark.parametrize(("kw", "words"), [
    ({"logprob_token_ids": list(range(129))}, "length 129, which is greater than max allowed"),
    ({"logprob_token_ids": ["5"]}, "must be a list of token ids"),
    ({"logprob_token_ids": [1, 2], "logprobs": 3}, "logprobs must equal len(logprob_token_ids)"),
    ({"logprob_token_ids": [1, 2, 3], "logprobs": 2}, "logprobs=2, len(logprob_token_ids)=3"),
])
def test_what_vllm_refuses_is_refused_where_it_is_written(kw, words):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kw)
    assert words in str(err.value) and err.value.param == "logprob_token_ids"
    SamplingParams(logprob_token_ids=list(range(128)))  # the most


def test_an_id_outside_the_vocabulary_is_refused_when_the_request_is_added(embedded):
    """As vLLM, where the vocabulary is known (its message names it): not at construction."""
    engine = make_engine(embedded)
    vocab = engine.vocab_size
    for ids, bad in (([0, vocab], f"[{vocab}]"), ([-1, 3, -2], "[-1, -2]")):
        params = SamplingParams(logprob_token_ids=ids)
        with pytest.raises(InvalidRequest) as err:
            engine.add_request([1, 2, 3], params)
        assert str(err.value) == (f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab "
                                  f"token ids. Vocabulary size: {vocab}")
    assert not engine.has_unfinished_requests()
