"""The sampler at its edges: a prompt logprob's rank counts from 1, each row gets the
number of top logprobs it asked for, a tiny positive temperature is floored (not a coin
flip), and top_p keeps the smallest set that reaches it, as vLLM's."""

import torch

from pagedserve.engine.sampler import make_generator, prompt_token_logprobs, sample
from pagedserve.scheduler import SamplingParams, Sequence


def test_prompt_logprob_rank_is_one_based():
    """vLLM's rank: 1 for the most likely token, k for the k-th (the server shows it in
    prompt_logprobs)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    lps = prompt_token_logprobs(logits, [0, 1], k=1)
    assert [lp.rank for lp in lps] == [1, 3]
    assert lps[0].top[0][0] == 0 and lps[1].top[0][0] == 3


def _seq(**kw) -> Sequence:
    return Sequence("r", [1, 2, 3], SamplingParams(**kw), arrival=0.0)


def test_each_row_gets_the_number_of_top_logprobs_it_asked_for():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2)
    rows = [_seq(temperature=0, logprobs=1), _seq(temperature=0, logprobs=3)]
    _, lps = sample(logits, rows, [None, None]).to_host()
    assert [len(lp.top) for lp in lps] == [1, 3]
    assert [t for t, _ in lps[1].top] == [0, 1, 2]


def test_a_tiny_positive_temperature_is_floored_not_a_coin_flip():
    """vLLM floors a positive temperature at 0.01: at 1e-310, logits 2 and 1 are 100 apart
    (token 0 always), not two infinities capped to one value (an even draw)."""
    logits = torch.tensor([[2.0, 1.0, -1.0]])
    g = make_generator(5, 0)
    drawn = [sample(logits, [_seq(temperature=1e-310)], [g]).to_host()[0][0] for _ in range(64)]
    assert drawn == [0] * 64


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    """Two tokens of probability 0.5 each (exactly): top_p 0.5 keeps one of them (the
    tokens with less than top_p of the mass before them), as vLLM does."""
    logits = torch.tensor([[0.0, 0.0]])
    g = make_generator(3, 0)
    drawn = {sample(logits, [_seq(temperature=1.0, top_p=0.5)], [g]).to_host()[0][0]
             for _ in range(64)}
    assert len(drawn) == 1
