"""Prompt logprobs (SamplingParams.prompt_logprobs; the API's `prompt_logprobs` and `echo`
with `logprobs`): each prompt token's logprob under the tokens before it, computed in
prefill. Equal to HF's full forward, and the same whether the prompt is prefilled whole,
in chunks, after a preemption, or when its prefix is already cached (a request that wants
prompt logprobs recomputes its prompt instead of taking a cache hit)."""

import pytest
import torch
from engine_utils import greedy, hf_logprobs, make_engine, prompts_of_lengths, run

from pagedserve.engine import SamplingParams

PROMPTS = prompts_of_lengths([15, 49, 70], seed=21)
K = 3


def _prompt_logprobs(outputs) -> list[list[tuple[int, float, list[int]]]]:
    got = []
    for out in outputs:
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        got.append([(lp.token_id, lp.logprob, [t for t, _ in lp.top])
                    for lp in out.prompt_logprobs[1:]])
    return got


@pytest.fixture(scope="module")
def whole(tiny_llama):
    return _prompt_logprobs(run(make_engine(tiny_llama), PROMPTS, greedy(3, prompt_logprobs=K)))


def test_prompt_logprobs_equal_transformers(tiny_llama_dir, whole) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, rows in zip(PROMPTS, whole, strict=True):
        want = hf_logprobs(hf, prompt[:1], prompt[1:])  # row i predicts prompt[i + 1]
        assert [token for token, _, _ in rows] == prompt[1:]
        got = torch.tensor([logprob for _, logprob, _ in rows])
        chosen = want.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)
        assert [top for _, _, top in rows] == want.topk(K).indices.tolist()


@pytest.mark.parametrize("config", [
    {"max_num_batched_tokens": 7},  # chunks cut across blocks
    # preempted while decoding and recomputed, some mid-prompt: nothing recorded twice
    {"num_kv_blocks": 10, "max_num_batched_tokens": 16},
], ids=["chunked", "preempted"])
def test_prompt_logprobs_are_path_independent(tiny_llama, whole, config) -> None:
    engine = make_engine(tiny_llama, **config)
    got = _prompt_logprobs(run(engine, PROMPTS, greedy(24, prompt_logprobs=K)))
    if "num_kv_blocks" in config:
        assert engine.stats()["preemptions"] > 0
    for rows, want in zip(got, whole, strict=True):
        assert [r[0] for r in rows] == [w[0] for w in want]
        assert [r[1] for r in rows] == pytest.approx([w[1] for w in want], abs=1e-5)


def test_cached_prefix_is_recomputed_for_prompt_logprobs(tiny_llama, whole) -> None:
    engine = make_engine(tiny_llama)
    run(engine, PROMPTS, greedy(3))  # caches the prompts' blocks
    before = engine.stats()["prefix_cache_hit_tokens"]
    got = _prompt_logprobs(run(engine, PROMPTS, greedy(3, prompt_logprobs=K)))
    assert engine.stats()["prefix_cache_hit_tokens"] == before  # no hit taken
    assert [r[1] for rows in got for r in rows] == pytest.approx(
        [w[1] for rows in whole for w in rows], abs=1e-5)
    # A request without prompt logprobs still hits the cache.
    run(engine, PROMPTS, greedy(3))
    assert engine.stats()["prefix_cache_hit_tokens"] > before


def test_prompt_logprobs_once_per_request_with_forks(tiny_llama, whole) -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=2, max_tokens=4, ignore_eos=True,
                            prompt_logprobs=0)
    [out] = run(make_engine(tiny_llama), PROMPTS[1:2], params)
    assert len(out.outputs) == 3
    [rows] = _prompt_logprobs([out])
    assert [r[1] for r in rows] == pytest.approx([w[1] for w in whole[1]], abs=1e-5)
    assert all(top == [] for _, _, top in rows)  # k = 0: the prompt token alone


def test_a_one_token_prompt_has_its_none(tiny_llama) -> None:
    """Nothing predicts a one-token prompt's token, yet its prompt logprobs are [None], as
    every prompt's begin: echo with logprobs shows the token (it was left out)."""
    outs = run(make_engine(tiny_llama), [[42], PROMPTS[0]], greedy(1, prompt_logprobs=1))
    assert outs[0].prompt_logprobs == [None]
    _prompt_logprobs(outs[1:])  # the other prompt of the batch: a None, then one a token


def test_prompt_logprobs_validated(tiny_llama) -> None:
    from pagedserve.scheduler import InvalidRequest

    engine = make_engine(tiny_llama)
    for bad in (-1, 21):
        with pytest.raises(InvalidRequest, match="prompt_logprobs"):
            engine.add_request(PROMPTS[0], greedy(1, prompt_logprobs=bad))
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_once_when_a_sample_waits_for_a_seat(tiny_llama):
    """n wider than max_num_seqs: the samples without a seat prefill again later; only the
    first sample records the prompt's logprobs, and the others may hit the prefix cache."""
    prompt = list(range(1000, 1040))  # 2.5 blocks of 16
    params = SamplingParams(n=3, temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    engine = make_engine(tiny_llama, max_num_seqs=1)
    [out] = run(engine, [prompt], params)
    assert len(out.outputs) == 3
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert engine.stats()["prefix_cache_hit_tokens"] > 0  # the waiting samples hit the prompt
