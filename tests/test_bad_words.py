"""vLLM's bad_words: each word's last token is masked out wherever the output so far ends
with the word's other tokens, the word read as it would start the text and as it would
follow a space. Checked against transformers' own bad_words_ids on the same weights, and
across forks and preemption; the server's side is in test_vllm_fields.py, asynchronous
scheduling's in test_async_scheduling.py."""

import pytest
from engine_utils import make_engine, run

from pagedserve.engine import SamplingParams
from pagedserve.engine.logits_processors import bad_words_token_ids
from pagedserve.scheduler import MAX_BAD_WORDS, InvalidRequest

# Prompts, and words each of which the greedy output shows once the words before it are
# banned (the test asserts it): one-token words, and words of two tokens whose first token
# the output keeps.
CASES = [(" The capital of France is", ["Paris", "the capital"]),
         ("Once upon a time,", ["the", "I was"])]


def _contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens)))


@pytest.mark.parametrize(("prompt", "words"), CASES)
def test_bad_words_equal_transformers_bad_words_ids(embedded, hf_from_gguf, prompt, words):
    import torch

    tokenizer = embedded.tokenizer
    engine = make_engine(embedded)
    token_ids = tokenizer.encode(prompt)
    for k, word in enumerate(words):  # each word bites: the output shows it unbanned
        before = run(engine, [token_ids], SamplingParams(temperature=0, max_tokens=12,
                                                         bad_words=words[:k]))
        tokens = before[0].outputs[0].token_ids
        assert any(_contains(tokens, w) for w in bad_words_token_ids([word], tokenizer)), word
    banned = bad_words_token_ids(words, tokenizer)
    got = run(engine, [token_ids], SamplingParams(temperature=0, max_tokens=12,
                                                  bad_words=words))[0].outputs[0].token_ids
    assert not any(_contains(got, w) for w in banned)
    # Where a word's first tokens end the prompt, transformers bans its last at once; vLLM
    # looks at the output only. These prompts end with no such tokens, so the two agree.
    assert not any(len(w) > 1 and tuple(token_ids[1 - len(w):]) == w[:-1] for w in banned)
    ids = torch.tensor([token_ids])
    ref = hf_from_gguf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                do_sample=False, bad_words_ids=[list(w) for w in banned],
                                pad_token_id=tokenizer.eos_token_ids[0])
    assert got == ref[0, len(token_ids):].tolist()


def test_a_word_is_read_at_the_start_and_after_a_space(embedded):
    """vLLM's reading: the word as it stands, and after a space where that is another first
    token of the same number of tokens (else only the first form is banned)."""
    tokenizer = embedded.tokenizer
    alone, spaced = (tuple(tokenizer.encode(t, add_special_tokens=False))
                     for t in ("Paris", " Paris"))
    assert len(alone) == len(spaced) == 1 and alone != spaced
    assert bad_words_token_ids(["Paris"], tokenizer) == (alone, spaced)
    assert bad_words_token_ids(["  Paris"], tokenizer) == (alone, spaced)  # (lstripped)
    nova = [tuple(tokenizer.encode(t, add_special_tokens=False))
            for t in ("Nova Haven", " Nova Haven")]
    assert len(nova[0]) != len(nova[1])
    assert bad_words_token_ids(["Nova Haven"], tokenizer) == (nova[0],)


def test_forks_and_preempted_samples_keep_the_words_out(embedded):
    """Each of a request's samples bans the words (they are shared, not consumed), and a
    sample preempted and recomputed draws what it drew uninterrupted."""
    tokenizer = embedded.tokenizer
    prompts = [tokenizer.encode("Write about the sea."), tokenizer.encode("The sky is")]
    free = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    seen = [t for o in run(make_engine(embedded), prompts, free) for s in o.outputs
            for t in s.token_ids]
    # The token the samples draw most that its own text bans.
    common = next(t for t in sorted(set(seen), key=seen.count, reverse=True)
                  if (t,) in bad_words_token_ids([tokenizer.decode([t])], tokenizer))
    assert seen.count(common) >= 3
    word = tokenizer.decode([common])
    banned = bad_words_token_ids([word], tokenizer)
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True,
                            bad_words=[word])
    roomy = run(make_engine(embedded), prompts, params)
    tight_engine = make_engine(embedded, num_kv_blocks=7)
    tight = run(tight_engine, prompts, params)
    assert tight_engine.stats()["preemptions"] > 0
    for a, b in zip(roomy, tight, strict=True):
        assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs]
        assert not any(_contains(s.token_ids, w) for s in a.outputs for w in banned)


def test_bad_words_are_refused_where_vllm_refuses_them(embedded):
    for words, where in (([""], "bad_words cannot contain an empty string"),
                         ([f"w{i}" for i in range(MAX_BAD_WORDS + 1)],
                          "Too many bad words after tokenization: 129"),
                         ([3], "list of strings")):
        with pytest.raises(InvalidRequest, match=where) as e:
            SamplingParams(bad_words=words)
        assert e.value.param == "bad_words"
    engine = make_engine(embedded)
    for words, where in ((["   "], "at least one token"),  # (nothing left once lstripped)
                         ([" x" * 600], "Too many total bad word tokens"),
                         (["x" * 10_000_000], "more than 1024 tokens"),  # (never encoded)
                         ([f" w{i}" for i in range(70)],  # (two forms each)
                          "Too many bad words after tokenization: 129. The max number is 128")):
        with pytest.raises(InvalidRequest, match=where) as e:
            engine.add_request([1, 2, 3], SamplingParams(bad_words=words))
        assert e.value.param == "bad_words"
    assert not engine.has_unfinished_requests()
    # Repeats count once, and one word is a list of one (as stop takes a string).
    assert SamplingParams(bad_words=["a", "a"]).bad_words == ["a"]
    assert SamplingParams(bad_words="a").bad_words == ["a"]


def test_a_grammar_or_allowed_tokens_win_where_the_words_leave_nothing(embedded):
    """Where a row's grammar or allowed_token_ids allow only banned tokens, the bad words
    give way for that token (as min_tokens gives way): the sample keeps to its constraint
    instead of drawing a token nothing allows."""
    from pagedserve.scheduler import StructuredOutputs

    engine = make_engine(embedded)
    prompt = embedded.tokenizer.encode("The capital of France is")
    words = ["Paris", "Lyon"]
    for temperature in (0.0, 1.0):
        choice = SamplingParams(temperature=temperature, seed=1, max_tokens=8, bad_words=words,
                                structured_outputs=StructuredOutputs(choice=words))
        out = run(engine, [prompt], choice)[0].outputs[0]
        assert out.text in words and out.finish_reason == "stop", out
    allowed = bad_words_token_ids(["Paris"], embedded.tokenizer)
    limited = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, bad_words=["Paris"],
                             allowed_token_ids=[w[0] for w in allowed])
    assert set(run(engine, [prompt], limited)[0].outputs[0].token_ids) <= {w[0] for w in allowed}
    # min_tokens gives way first: with EOS beside the banned word, the word comes until
    # min_tokens allows EOS (never an EOS that does not end the sample).
    eos = embedded.tokenizer.eos_token_ids[0]
    early = SamplingParams(temperature=0, max_tokens=3, bad_words=["Paris"], min_tokens=2,
                           allowed_token_ids=[allowed[1][0], eos])
    out = run(engine, [prompt], early)[0].outputs[0]
    assert out.token_ids == [allowed[1][0], allowed[1][0], eos] and out.finish_reason == "stop"
