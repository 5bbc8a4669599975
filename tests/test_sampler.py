"""Sampling semantics on hand-made logits."""

import math
from dataclasses import dataclass

import pytest
import torch

from pagedserve.engine import logits_processors, sampler
from pagedserve.engine.sampler import make_generator, sample
from pagedserve.scheduler import PENDING_TOKEN, SamplingParams, Sequence

EOS = (5,)
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


@dataclass
class Row:
    seq: Sequence
    generator: torch.Generator


def row(seed: int = 0, prompt=(), output=(), **kw) -> Row:
    seq = Sequence("r", list(prompt) + list(output), SamplingParams(**kw), arrival=0.0)
    seq.num_prompt_tokens = len(prompt)
    return Row(seq, make_generator(seed, 0))


def sample_rows(logits: torch.Tensor, rows: list[Row]):
    return sample(logits, [r.seq for r in rows], [r.generator for r in rows], EOS).to_host()


def draws(n: int, **kw) -> list[int]:
    r = row(**kw)
    return [sample_rows(LOGITS, [r])[0][0] for _ in range(n)]


def counts_follow(tokens: list[int], probs: torch.Tensor) -> bool:
    """Every token's count within 4 standard deviations of its binomial expectation."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs))
    expected = probs * len(tokens)
    return all(abs(c - e) < 4 * math.sqrt(e + 1) for c, e in zip(counts.tolist(),
                                                                     expected.tolist(),
                                                                     strict=True))


def test_greedy_is_argmax():
    assert draws(5, temperature=0) == [0] * 5


def test_temperature_one_follows_softmax():
    assert counts_follow(draws(4000, temperature=1.0, seed=3), torch.softmax(LOGITS[0], -1))


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draws(300, temperature=1.0, top_k=2)) == {0, 1}
    # p(0) = 0.54, p(1) = 0.20: top_p 0.6 keeps tokens 0 and 1.
    assert set(draws(300, temperature=1.0, top_p=0.6)) == {0, 1}
    # min_p 0.3 keeps tokens with p >= 0.3 * p_max = 0.16: tokens 0 and 1.
    assert set(draws(300, temperature=1.0, min_p=0.3)) == {0, 1}
    assert set(draws(50, temperature=1.0, top_k=1)) == {0}
    # A token tied with the k-th stays, as in vLLM: top_k 2 keeps tokens 0, 1 and 2 here.
    tied = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0, -3.0]]).repeat(300, 1)
    assert set(sample_rows(tied, [row(seed=i, temperature=1.0, top_k=2)
                                  for i in range(300)])[0]) == {0, 1, 2}


def test_filters_renormalize_over_the_tokens_they_keep():
    """Not just the support: top_k 3 at temperature 2 draws tokens 0-2 in proportion to
    their tempered probabilities, and nothing else."""
    kept = torch.softmax(LOGITS[0, :3] / 2.0, -1)
    got = draws(4000, temperature=2.0, top_k=3, seed=8)
    assert counts_follow(got, torch.cat([kept, torch.zeros(3)]))


def test_impossible_tokens_are_never_drawn():
    """Tokens at -inf (a grammar's or a ban's) have probability 0: the draw skips them at
    either end of the vocabulary and between the others; a row with no finite logit still
    yields a token id the model has."""
    inf = float("-inf")
    logits = torch.tensor([[inf, 1.0, inf, inf, 1.0, inf]])
    assert set(sample_rows(logits.repeat(300, 1),
                           [row(seed=i, temperature=1.0) for i in range(300)])[0]) == {1, 4}
    none = sample_rows(torch.full((2, 6), inf), [row(temperature=1.0), row(temperature=1.0,
                                                                           top_p=0.5)])[0]
    assert all(0 <= t < 6 for t in none)


def vllm_kept(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens vLLM's sampler may draw from a row, written its way: min-p on the
    probabilities, top-k on the logits (ties with the k-th kept), then top-p over the
    softmax of what is left, sorted ascending, dropping the tokens whose cumulative share
    is at most 1 - top_p (never the last)."""
    probs = logits.softmax(-1)
    logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    ascending, order = logits.softmax(-1).double().sort()
    drop = ascending.cumsum(-1) <= 1 - top_p
    drop[-1] = False
    return {int(t) for t, d, q in zip(order, drop, ascending, strict=True) if not d and q > 0}


def test_top_p_takes_its_share_of_what_top_k_and_min_p_keep():
    """As vLLM (and HF's warpers in turn): top-p counts the mass of the tokens the other
    filters keep, renormalized, not of the whole vocabulary. Here p(0) = 0.54 and p(1) = 0.20:
    of the two tokens top_k 2 or min_p 0.3 keep, token 0 alone holds 0.73, past top_p 0.7."""
    assert set(draws(200, temperature=1.0, top_k=2, top_p=0.7)) == {0}
    assert set(draws(200, temperature=1.0, min_p=0.3, top_p=0.7)) == {0}
    assert set(draws(300, temperature=1.0, top_k=2, top_p=0.75)) == {0, 1}
    gen = torch.Generator().manual_seed(4)
    vocab, n = 3 * sampler.CANDIDATES[0], 48
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.5, 8, n).unsqueeze(1)
    kinds = [dict(top_k=5, top_p=0.6), dict(min_p=0.2, top_p=0.5),
             dict(top_k=40, min_p=0.05, top_p=0.8), dict(min_p=0.002, top_p=0.3)]
    for seed in range(12):
        params = [kinds[i % len(kinds)] for i in range(n)]
        got = sample_rows(logits, [row(seed=seed * n + i, temperature=1.0, **params[i])
                                   for i in range(n)])[0]
        for i, (token, p) in enumerate(zip(got, params, strict=True)):
            assert token in vllm_kept(logits[i], p.get("top_k", 0), p["top_p"],
                                      p.get("min_p", 0.0)), (i, p)


@pytest.mark.parametrize("tiers", [None, (32, 256)])
def test_top_candidates_draw_what_a_full_sort_draws(tiers, monkeypatch):
    """On a CPU, a filtered row whose kept tokens are among its CANDIDATES[0] most likely is
    drawn from those alone, else from its CANDIDATES[1] (tiers: such a tier within this
    vocabulary); one whose kept tokens reach past them sorts the whole vocabulary. Either
    way each row draws the very token a full sort gives it."""
    if tiers is not None:
        monkeypatch.setattr(sampler, "CANDIDATES", tiers)
    gen = torch.Generator().manual_seed(1)
    vocab, n = 1024, 40
    # From flat rows (top_p keeps hundreds of tokens) to peaked ones (it keeps a few).
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.5, 12, n).unsqueeze(1)
    kinds = [dict(top_p=0.9), dict(top_p=0.5, min_p=0.01), dict(top_k=300),
             dict(top_k=20, top_p=0.99), dict(min_p=0.001)]
    rows = [dict(seed=i, temperature=1.0, **kinds[i % len(kinds)]) for i in range(n)]
    got = sample_rows(logits, [row(**r) for r in rows])[0]
    # Both paths are taken: some rows keep fewer tokens than CANDIDATES, some more.
    top_p = torch.tensor([r.get("top_p", 1.0) for r in rows])
    sorted_probs = logits.softmax(-1).sort(dim=-1, descending=True).values
    kept = (sorted_probs.cumsum(-1) - sorted_probs < top_p.unsqueeze(1)).sum(1)
    assert kept.min() < 20 and kept.max() > sampler.CANDIDATES[0]
    if tiers is not None:  # and the second tier's rows too
        assert ((kept > tiers[0]) & (kept <= tiers[1])).any() and kept.max() > tiers[1]
    monkeypatch.setattr(sampler, "CANDIDATES", (vocab,))  # every row sorts
    assert got == sample_rows(logits, [row(**r) for r in rows])[0]


def test_top_p_within_the_candidates_of_a_top_k_past_them(monkeypatch):
    """top_k keeps more than CANDIDATES tokens, and top_p fewer of them: top-p's share is of
    the top-k tokens' mass, which only the whole row holds. The draws equal a full sort's."""
    gen = torch.Generator().manual_seed(2)
    vocab, n = 4 * sampler.CANDIDATES[0], 64
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(1.5, 4, n).unsqueeze(1)
    rows = [dict(seed=i, temperature=1.0, top_k=sampler.CANDIDATES[0] + 60, top_p=0.3)
            for i in range(n)]
    got = sample_rows(logits, [row(**r) for r in rows])[0]
    monkeypatch.setattr(sampler, "CANDIDATES", (vocab,))
    assert got == sample_rows(logits, [row(**r) for r in rows])[0]


def test_seeded_draws_hardly_move_when_the_logits_move_in_their_last_bits():
    """A GPU's kernels round differently at another batch size, so a sample forked beside
    others and the same request alone see logits that differ in their last bits. Over a
    flat vocabulary (a random model's: top_p keeps ~27k of 32k tokens) a draw in sorted
    order then moves wherever two tokens of nearly equal probability swap places; a draw
    in vocabulary order moves only where its uniform number falls at a token's edge. At
    1e-5 relative noise, over 4 seeds of this test: 51-69 of 1,024 rows in sorted order,
    4-12 in vocabulary order."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1024, 32768, generator=gen) * 0.6
    noisy = logits * (1 + 1e-5 * torch.randn(logits.shape, generator=gen))
    rows = [row(seed=i, temperature=0.8, top_p=0.95) for i in range(len(logits))]
    before = sample_rows(logits, rows)[0]
    rows = [row(seed=i, temperature=0.8, top_p=0.95) for i in range(len(logits))]
    moved = sum(a != b for a, b in zip(before, sample_rows(noisy, rows)[0], strict=True))
    assert moved <= 20


def test_a_top_p_of_one_drops_nothing():
    """A row that filters by top_k or min_p only keeps top_p at 1: float32 probabilities
    may sum past 1 by a few 1e-7, and on peaked rows the tail's mass before each token
    then reaches 1 (1.9 million of these 64 x 49,152 tokens would go)."""
    gen = torch.Generator().manual_seed(0)
    probs = (torch.randn(64, 49152, generator=gen) * 5).softmax(-1)
    limits = (torch.full((64,), 49152), torch.ones(64, dtype=torch.float64), torch.zeros(64))
    assert not sampler._dropped(probs.sort(dim=-1, descending=True).values, *limits)[0].any()


def test_unseeded_samples_share_the_device_stream_and_still_vary():
    assert make_generator(None, 0) is None
    got = sample_rows(LOGITS.repeat(400, 1), [row(seed=None, temperature=1.0)] * 400)[0]
    assert counts_follow(got, torch.softmax(LOGITS[0], -1))


def test_seeded_streams_repeat_and_differ():
    assert draws(30, temperature=1.0, seed=9) == draws(30, temperature=1.0, seed=9)
    assert draws(30, temperature=1.0, seed=9) != draws(30, temperature=1.0, seed=10)


def test_sample_stream_does_not_depend_on_the_batch():
    """A seeded row draws the same token alone as beside greedy, unseeded, filtered and
    plain rows, whichever of the sampler's paths they take."""
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.6),
             dict(temperature=1.0, min_p=0.2, top_k=4)]
    others = [row(temperature=0), row(seed=None, temperature=1.0),
              row(seed=99, temperature=1.5, top_k=2), row(seed=98, temperature=1.0)]
    for kind in kinds:
        for i in range(20):
            alone = sample_rows(LOGITS, [row(seed=i, **kind)])[0]
            batched = sample_rows(LOGITS.repeat(5, 1), [*others[:2], row(seed=i, **kind),
                                                        *others[2:]])[0]
            assert alone == batched[2:3]


def test_repetition_penalty_pushes_seen_tokens_down():
    assert draws(1, temperature=0, prompt=[0], repetition_penalty=3.0) == [1]
    assert draws(1, temperature=0, prompt=[0], repetition_penalty=1.5) == [0]


def test_presence_and_frequency_penalties_use_output_tokens_only():
    assert draws(1, temperature=0, prompt=[0], presence_penalty=2.0) == [0]
    assert draws(1, temperature=0, output=[0], presence_penalty=1.5) == [1]
    assert draws(1, temperature=0, output=[0, 0], frequency_penalty=0.6) == [1]


def _penalized_textbook(logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
    """The penalties by their textbook formulas, a row at a time."""
    want = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            for t in set(r.token_ids):
                v = want[i, t]
                want[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long),
                                minlength=logits.shape[1]).float()
        if p.presence_penalty or p.frequency_penalty:
            want[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return want


def test_penalties_in_a_batch_equal_each_row_alone():
    """The batched penalties give every row the very logits the textbook formulas give it
    alone: repetition over prompt and output (positive logits divided, negative ones
    multiplied), frequency and presence over the output, rows without either untouched;
    the same after each step's new tokens are counted onto the last step's counts."""
    gen = torch.Generator().manual_seed(3)
    vocab = 40
    logits = torch.randn(7, vocab, generator=gen) * 3
    specs = [dict(repetition_penalty=1.3), dict(), dict(presence_penalty=0.5,
             frequency_penalty=0.3), dict(repetition_penalty=0.8, frequency_penalty=-0.4),
             dict(presence_penalty=1.0), dict(repetition_penalty=2.0, presence_penalty=-0.5),
             dict(frequency_penalty=1.0)]
    rows = []
    for i, spec in enumerate(specs):
        prompt = torch.randint(vocab, (5 + i,), generator=gen).tolist()
        output = torch.randint(vocab // 4, (3 * i,), generator=gen).tolist()  # repeats
        rows.append(row(prompt=prompt, output=output, temperature=1.0, **spec).seq)
    for step in range(4):
        got = logits.clone()
        logits_processors.apply_penalties(got, rows, None)
        assert torch.equal(got, _penalized_textbook(logits, rows)), step
        for i, r in enumerate(rows):  # a step's tokens: some seen before, some new
            r.token_ids += torch.randint(vocab // 2, (i % 3,), generator=gen).tolist()


def test_penalties_take_a_last_token_still_in_flight_from_the_device():
    """Under asynchronous scheduling a row's last token may be PENDING_TOKEN on the host,
    its id on the device only: the penalties give exactly the logits they give with the id
    on the host, whether it repeats one of the row's tokens or is new to it."""
    gen = torch.Generator().manual_seed(5)
    vocab = 40
    logits = torch.randn(8, vocab, generator=gen) * 3
    specs = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.3),
             dict(repetition_penalty=0.8, frequency_penalty=-0.4), dict(presence_penalty=1.0),
             dict(repetition_penalty=2.0, presence_penalty=-0.5), dict(frequency_penalty=1.0),
             dict(), dict(repetition_penalty=1.7, frequency_penalty=0.7)]
    known, waiting, last = [], [], []
    for i, spec in enumerate(specs):
        prompt = torch.randint(vocab, (4 + i,), generator=gen).tolist()
        output = torch.randint(vocab // 4, (2 + 2 * i,), generator=gen).tolist()
        # Even rows' last token repeats an earlier output token; odd rows' is new to them.
        last.append(output[0] if i % 2 == 0 else vocab - 1 - i)
        known.append(row(prompt=prompt, output=output + [last[-1]], **spec).seq)
        waiting.append(row(prompt=prompt, output=output + [PENDING_TOKEN], **spec).seq)
    waiting[3].token_ids[-1] = known[3].token_ids[-1]  # this row's last token is settled
    pending = torch.tensor([-1 if i == 3 else t for i, t in enumerate(last)])
    want, got = logits.clone(), logits.clone()
    logits_processors.apply_penalties(want, known, None)
    logits_processors.apply_penalties(got, waiting, pending)
    assert torch.equal(got, want)
    assert not torch.equal(want, logits)


def test_counts_stay_right_as_a_row_outgrows_its_first_arrays():
    """OutputCounts starts with room for 16 distinct tokens and doubles: a row whose
    distinct output tokens pass 16, 32 and 64 (one new token a step, some repeated)
    still gets the textbook penalties every step, its old tokens' counts kept."""
    gen = torch.Generator().manual_seed(11)
    vocab = 200
    logits = torch.randn(3, vocab, generator=gen) * 3
    specs = [dict(presence_penalty=0.5, frequency_penalty=0.25),
             dict(repetition_penalty=1.3), dict(repetition_penalty=0.8, frequency_penalty=1.0)]
    rows = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=1.0, **spec), 0.0)
            for i, spec in enumerate(specs)]
    for step in range(90):
        got = logits.clone()
        logits_processors.apply_penalties(got, rows, None)
        assert torch.equal(got, _penalized_textbook(logits, rows)), step
        for i, r in enumerate(rows):  # a new token each step, and every third an old one
            r.token_ids.append(10 + step + i)
            if step % 3 == 0:
                r.token_ids.append(10 + step // 2)


def test_counts_stay_whole_past_float16s_range():
    """A token output 3,000 times is penalized 3,000 times its frequency_penalty (the
    counts are whole numbers, exact in float32 below 2**24; float16 stops at 2,048)."""
    params = SamplingParams(temperature=1.0, frequency_penalty=1.0)
    r = Sequence("r", [0, 1], params, 0.0)
    r.token_ids += [5] * 3000
    logits = torch.zeros(1, 8)
    logits_processors.apply_penalties(logits, [r], None)
    assert logits[0, 5].item() == -3000.0
    r.token_ids += [5] * 1000 + [PENDING_TOKEN]  # and counted on from there
    logits = torch.zeros(1, 8)
    logits_processors.apply_penalties(logits, [r], torch.tensor([5]))
    assert logits[0, 5].item() == -4001.0


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])  # EOS (5) dominates
    r = row(temperature=0, min_tokens=2, output=[1], stop_token_ids=[3])
    assert sample_rows(logits, [r])[0] != [5]
    r = row(temperature=0, min_tokens=2, output=[1, 2])
    assert sample_rows(logits, [r])[0] == [5]
    # under ignore_eos too, as vLLM masks it (min_tokens: no EOS before them, in any case)
    r = row(temperature=0, min_tokens=2, output=[1], ignore_eos=True)
    assert sample_rows(logits, [r])[0] != [5]


def test_logprobs_report_the_raw_distribution():
    tokens, lps = sample_rows(LOGITS, [row(temperature=0, logprobs=3, repetition_penalty=2.0)])
    ref = torch.log_softmax(LOGITS[0], -1)
    assert lps[0].token_id == tokens[0]
    assert math.isclose(lps[0].logprob, float(ref[tokens[0]]), rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [0, 1, 2]
    assert [round(v, 5) for _, v in lps[0].top] == [round(float(v), 5) for v in ref[:3]]


def test_logit_bias_forces_and_bans_tokens_and_leaves_logprobs_raw():
    # +100 on token 4 beats token 0's lead of 3; -100 on token 0 hands greedy to token 1.
    assert draws(3, temperature=0, logit_bias={4: 100.0}) == [4] * 3
    assert draws(3, temperature=0, logit_bias={0: -100.0}) == [1] * 3
    assert set(draws(200, temperature=1.0, seed=2, logit_bias={0: -100.0, 1: -100.0})) \
        .isdisjoint({0, 1})
    # Each row of a batch gets its own biases.
    batch = [row(temperature=0, logit_bias={4: 100.0}), row(temperature=0),
             row(temperature=0, logit_bias={0: -100.0, 3: 0.5}), row(temperature=0)]
    assert sample_rows(LOGITS.repeat(4, 1), batch)[0] == [4, 0, 1, 0]
    tokens, lps = sample_rows(LOGITS, [row(temperature=0, logprobs=1, logit_bias={4: 100.0})])
    assert tokens == [4]
    assert math.isclose(lps[0].logprob, float(torch.log_softmax(LOGITS[0], -1)[4]),
                        rel_tol=1e-6)


def test_a_penalty_takes_the_biased_logit():
    """vLLM's order: the bias first, then the penalties over the biased logit. Token 1 (logit
    1, in the prompt) with bias 3 and repetition penalty 2 is (1 + 3) / 2 = 2, tied with token
    0 (greedy takes the first); bias added after the penalty would give it 1 / 2 + 3 = 3.5."""
    assert draws(2, temperature=0, prompt=[1], repetition_penalty=2.0,
                 logit_bias={1: 3.0}) == [0, 0]
    assert draws(2, temperature=0, prompt=[1], repetition_penalty=2.0,
                 logit_bias={1: 3.5}) == [1, 1]


def test_bf16_logits_sample_as_their_float32_widening():
    """The model hands the sampler bf16 logits; greedy reads them as they are, the rest
    widens them first. Either way each row must come out as from the float32 logits, ties
    included (the first maximum wins)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 500, generator=gen).bfloat16()
    logits[1, 7] = logits[1, 300] = logits[1].max() + 1  # a tie: token 7 must win
    kinds = [dict(temperature=0), dict(temperature=0), dict(temperature=0, logprobs=2),
             dict(temperature=0.8, seed=5)]
    got = sample_rows(logits, [row(**k) for k in kinds])
    want = sample_rows(logits.float(), [row(**k) for k in kinds])
    assert got[0] == want[0] and got[0][1] == 7
    assert got[1][2] == want[1][2] and got[1][2] is not None
    greedy_only = sample_rows(logits, [row(temperature=0)] * 4)[0]
    assert greedy_only == logits.float().argmax(dim=-1).tolist()


def test_prompt_logprobs_in_slices_of_rows_are_those_of_all_rows_at_once(monkeypatch):
    """Prompt logprobs widen PROMPT_LOGPROB_ROWS rows at a time (bounded float32
    temporaries): each row's logprob, rank and top k are those of the rows taken together."""
    logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(0)).bfloat16()
    targets = [i * 3 % 50 for i in range(10)]
    whole = sampler.prompt_token_logprobs(logits, targets, 4)
    monkeypatch.setattr(sampler, "PROMPT_LOGPROB_ROWS", 3)
    assert sampler.prompt_token_logprobs(logits, targets, 4) == whole
    assert sampler.prompt_token_logprobs(logits, targets, 0) == [
        sampler.TokenLogprob(lp.token_id, lp.logprob, [], lp.rank) for lp in whole]
