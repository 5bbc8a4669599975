"""The incremental detokenizer: streamed text equals the whole decode, never splits a
character, and stops where a stop string starts. Real tokenizers: the embedded model's
byte-level BPE, and a SentencePiece-style one (Metaspace pieces, byte fallback) built with
`tokenizers`."""

import random
from collections.abc import Sequence

import pytest
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as Backend

from pagedserve.engine.detokenizer import MAX_HELD, IncrementalDetokenizer
from pagedserve.models.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! pi is 3.14159",
    "line one\nline two\n\n\tindented",
    "café naïve résumé Ångström",
    "日本語のテキスト 中文 한국어",
    "emoji 🙂👍🏽 and flags 🇫🇷",
    "<|im_start|>user\nHi!<|im_end|>",
]


@pytest.fixture(scope="module")
def byte_level(embedded) -> Tokenizer:
    return embedded.tokenizer


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    """Llama-2-style decoding: "▁" is a space, bytes <0xNN> fuse into UTF-8, one leading
    space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁hello", "▁world", "lo", "▁", "▁a", "b", "é", "▁do", "n't", "."]:
        vocab[piece] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], add_bos=False)


def stream(tokenizer: Tokenizer, ids: list[int], stop: Sequence[str] = (), skip: bool = True,
           prompt: Sequence[int] = ()) -> tuple[list[str], bool]:
    """The visible text after each token (then the flush), and whether a stop string hit."""
    detok = IncrementalDetokenizer(tokenizer, list(stop), skip, prompt_ids=prompt)
    chunks = []
    for token_id in ids:
        text, stopped = detok.add(token_id)
        chunks.append(text)
        if stopped:
            return chunks, True
    return chunks + [detok.flush()], False


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_is_the_whole_decode(byte_level, skip):
    for text in TEXTS:
        ids = byte_level.encode(text, add_special_tokens=False)
        chunks, _ = stream(byte_level, ids, skip=skip)
        assert "".join(chunks) == byte_level.decode(ids, skip), text
        assert not any("\ufffd" in c for c in chunks), text  # no character split


def test_random_token_streams_equal_the_whole_decode(byte_level):
    """Any ids the model may sample, special tokens, lone bytes of multi-byte characters and
    long runs of bytes that form none among them: the text (with the flush at the end) is
    the whole decode. (Byte-level BPE: each invalid byte sequence decodes on its own. Byte
    fallback decodes a run of byte tokens as one, all of it replaced if any is invalid, so
    no bounded window can match it: see test_bytes_that_are_not_utf8_never_raise.)"""
    tokenizer, rng = byte_level, random.Random(0)
    low = list(range(300))  # the specials, then single bytes
    pool = low + [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.3:  # a run of one token: a special, or a byte that is no character
            ids[rng.randrange(len(ids)):] = [rng.choice(low[:20])] * rng.randrange(10, 60)
        skip = rng.random() < 0.5
        chunks, _ = stream(tokenizer, ids, skip=skip)
        assert "".join(chunks) == tokenizer.decode(ids, skip), (ids, skip)


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("run", ["special", "not utf-8"])
def test_a_run_without_text_keeps_the_window_short(name, run, request):
    """A sequence that samples a special token (skipped) or a byte that is no character, over
    and over: the stream's window, which it decodes whole for every token, stays short, and
    the bytes show as the whole decode shows them, not only at the end."""
    tokenizer = request.getfixturevalue(name)
    token = 1 if run == "special" else next(
        i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")
    assert (token in tokenizer.special_ids) == (run == "special")
    detok = IncrementalDetokenizer(tokenizer, [])
    texts = []
    for _ in range(500):
        texts.append(detok.add(token)[0])
        assert len(detok._held) < (1 if run == "special" else MAX_HELD)  # specials: never
    shown = "".join(texts)
    whole = tokenizer.decode([token] * 500)
    assert shown == whole[: len(shown)]
    assert len(shown) >= (0 if run == "special" else 500 - MAX_HELD)
    assert shown + detok.flush() == whole


def byte_token(tokenizer: Tokenizer, b: int) -> int:
    """The token of one byte: GPT-2's byte-level alphabet spells bytes 0xA1-0xFF (but 0xAD)
    as the same code points."""
    return tokenizer.backend.token_to_id(chr(b))


def test_a_character_after_a_run_of_bad_bytes_arrives_whole(byte_level):
    """Bytes that form no character, then a two-byte character (é) split over two tokens,
    the run handed out at every offset: the cut never falls inside the character."""
    bad, lead, tail = (byte_token(byte_level, b) for b in (0xA1, 0xC3, 0xA9))
    for n in range(1, 3 * MAX_HELD):
        ids = [bad] * n + [lead, tail]
        chunks, _ = stream(byte_level, ids)
        assert "".join(chunks) == byte_level.decode(ids) == "\ufffd" * n + "é", n


@pytest.mark.parametrize("skip", [True, False])
def test_a_run_of_bad_bytes_after_a_character_in_bytes(byte_level, skip):
    """The last token that showed text completed a character (é in two byte tokens): alone
    it decodes to a replacement character, so the new window after the run may not start
    from it, or that character would show twice."""
    e_acute = [byte_token(byte_level, 0xC3), byte_token(byte_level, 0xA9)]
    a = byte_level.encode("a", add_special_tokens=False)
    for n in range(MAX_HELD - 1, 3 * MAX_HELD):
        ids = e_acute + [byte_token(byte_level, 0xA1)] * n + a
        chunks, _ = stream(byte_level, ids, skip=skip)
        assert "".join(chunks) == byte_level.decode(ids, skip) == "é" + "\ufffd" * n + "a", n


def test_a_stop_string_in_the_last_bytes_still_ends_the_text(byte_level):
    """Text held back at the end (a space, then a byte that starts no character) is checked
    for stop strings too, and after a stop string the flush adds nothing."""
    x = byte_level.encode("x", add_special_tokens=False)
    space_lead = next(i for i in range(byte_level.vocab_size)
                      if byte_level.decode([i]) == " \ufffd")  # bytes b" \xe2"
    chunks, stopped = stream(byte_level, x + [space_lead], stop=["x "])  # ends: flushed
    assert not stopped and "".join(chunks) == ""
    chunks, stopped = stream(byte_level, x + [space_lead] * (MAX_HELD + 2), stop=["x "])
    assert stopped and "".join(chunks) == ""
    detok = IncrementalDetokenizer(byte_level, ["x "])
    assert [detok.add(t)[1] for t in x + [space_lead] * MAX_HELD][-1]
    assert detok.flush() == ""


def test_byte_fallback_characters_arrive_whole(sentencepiece):
    ids = sentencepiece.encode("▁hello▁world▁é▁中🙂.▁do", add_special_tokens=False)
    assert sum(3 + 0x80 <= i < 3 + 256 for i in ids) >= 7  # 中 and 🙂 went as UTF-8 bytes
    chunks, _ = stream(sentencepiece, ids)
    assert "".join(chunks) == sentencepiece.decode(ids) == "hello world é 中🙂. do"
    assert "中" in chunks and "🙂" in chunks  # each handed out whole, in one chunk


def test_an_output_reads_as_it_does_after_its_prompt(sentencepiece):
    """The stream starts after the prompt's last tokens: a SentencePiece "▁world" that opens
    the output keeps its space, which the output decoded alone loses (vLLM keeps it too), so
    that prompt + output read as their whole decode (echo, a choice or regex with a leading
    space, a stop string that starts with one)."""
    sp = sentencepiece
    prompt, out = [sp.backend.token_to_id("▁hello")], [sp.backend.token_to_id(piece)
                                                          for piece in ("▁world", ".")]
    assert "".join(stream(sp, out)[0]) == "world."
    assert "".join(stream(sp, out, prompt=prompt)[0]) == " world."
    assert stream(sp, out, stop=[" w"], prompt=prompt) == ([""], True)
    # A special token that is skipped ends the prompt: the piece before it is the context.
    assert "".join(stream(sp, out, prompt=prompt + [2])[0]) == " world."


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_random_outputs_add_to_their_prompts_whole_decode(name, request):
    tokenizer, rng = request.getfixturevalue(name), random.Random(2)
    if name == "sentencepiece":  # its pieces and specials (byte runs: see below)
        pool = [0, 1, 2, *range(3 + 256, tokenizer.vocab_size)]
    else:
        pool = list(range(300)) + [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    for _ in range(300):
        prompt = [rng.choice(pool) for _ in range(rng.randrange(0, 12))]
        out = [rng.choice(pool) for _ in range(rng.randrange(1, 20))]
        skip = rng.random() < 0.5
        before, whole = tokenizer.decode(prompt, skip), tokenizer.decode(prompt + out, skip)
        if "\ufffd" in before or not whole.startswith(before):
            continue  # a prompt that ends inside a character: the output starts afresh
        chunks, _ = stream(tokenizer, out, skip=skip, prompt=prompt)
        assert "".join(chunks) == whole[len(before):], (prompt, out, skip)


def test_bytes_that_are_not_utf8_never_raise(sentencepiece):
    """Byte tokens that form no character make `tokenizers`' stream find its window's text
    changed (it raises); the detokenizer starts a new window and goes on."""
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(sentencepiece.vocab_size) for _ in range(rng.randrange(1, 40))]
        chunks, _ = stream(sentencepiece, ids)
        assert isinstance("".join(chunks), str)


def test_stop_string_ends_the_text_before_it(byte_level):
    ids = byte_level.encode("The cat sat on the mat. The dog", add_special_tokens=False)
    chunks, stopped = stream(byte_level, ids, stop=["zzz", "on the"])
    assert stopped and "".join(chunks) == "The cat sat "
    # Text that could still open a stop string is held back until it cannot.
    chunks, stopped = stream(byte_level, ids, stop=["mat!"])
    assert not stopped and "".join(chunks) == "The cat sat on the mat. The dog"
    assert "mat" not in "".join(chunks[: ids.index(byte_level.encode(" mat")[0]) + 1])


def test_a_kept_stop_string_ends_the_text_after_it(byte_level):
    """vLLM's include_stop_str_in_output: the text runs through the stop string, no further,
    whether the string ends in a token or is found in the flush."""
    ids = byte_level.encode("The cat sat on the mat. The dog", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level, ["zzz", "on the"], keep_stop=True)
    text, stopped = "", False
    for token_id in ids:
        chunk, stopped = detok.add(token_id)
        text += chunk
        if stopped:
            break
    assert stopped and text == "The cat sat on the"
    detok = IncrementalDetokenizer(byte_level, ["dog"], keep_stop=True)
    text = "".join(detok.add(t)[0] for t in ids[:-1]) + detok.flush()
    assert text == "The cat sat on the mat. The"  # not stopped: nothing to keep


def test_a_stop_string_counts_only_once_it_is_checked(byte_level):
    """Until min_tokens (check_stop False), a stop string is text, and stays text: only one
    that ends in a checked token's text ends it, even if it starts before."""
    ids = byte_level.encode("The cat sat on the mat. The dog", add_special_tokens=False)
    sat = ids.index(byte_level.encode(" sat", add_special_tokens=False)[0])

    def text_from(first_checked: int, stop: list[str]) -> str:
        detok = IncrementalDetokenizer(byte_level, stop)
        text = ""
        for i, token_id in enumerate(ids):
            chunk, stopped = detok.add(token_id, check_stop=i >= first_checked)
            text += chunk
            if stopped:
                return text
        return text + detok.flush()

    assert text_from(0, ["at"]) == "The c"
    assert text_from(sat, ["at"]) == "The cat s"
    assert text_from(sat + 1, ["at"]) == "The cat sat on the m"
    assert text_from(sat + 1, ["sat on"]) == "The cat "  # starts before, ends in " on"
    assert text_from(len(ids), ["at"]) == "The cat sat on the mat. The dog"  # flush too


def test_the_engine_and_a_served_stream_start_after_the_prompt(sentencepiece, tiny_llama):
    """Both places that decode an output pass the prompt's tail: the engine (a whole answer,
    or a stream with stop strings) and the server (a stream without them)."""
    import dataclasses

    from engine_utils import greedy, make_engine, run

    from pagedserve.server.request_group import RequestGroup

    sp = sentencepiece
    hello, world = sp.backend.token_to_id("▁hello"), sp.backend.token_to_id("▁world")
    params = greedy(2, allowed_token_ids=[world])
    engine = make_engine(dataclasses.replace(tiny_llama, tokenizer=sp))
    [out] = run(engine, [[hello]], params)
    assert out.outputs[0].token_ids == [world, world]
    assert out.outputs[0].text == " world world"
    group = RequestGroup(None, "g", [[hello]], params, tokenizer=sp)
    out.outputs[0].text = ""
    group.fill_text(0, out)
    assert out.outputs[0].text == " world world"


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_token_bytes_join_to_the_texts_bytes(name, request):
    """Logprobs' ``bytes`` (Tokenizer.token_bytes): each token's raw bytes as its piece spells
    them, so that a client joining them gets the text, characters split over byte tokens
    included (a SentencePiece "<0xC3>" is the byte 0xC3, not the string "<0xC3>"; "▁" a
    space); token_text is the token's text as it stands in a text."""
    tokenizer = request.getfixturevalue(name)
    for text in TEXTS[:5] + ["▁hello▁world▁é▁中🙂.▁do"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(tokenizer.token_bytes(i) for i in ids)
        whole = tokenizer.decode(ids, skip_special_tokens=False)
        # SentencePiece's decoder strips the text's first space; its bytes keep it.
        stripped = name == "sentencepiece" and tokenizer.backend.id_to_token(ids[0])[0] == "▁"
        assert joined.decode() == (" " + whole if stripped else whole), text
    assert tokenizer.token_bytes(1) == tokenizer.token_text(1).encode()  # a special, whole
    if name == "sentencepiece":
        assert tokenizer.token_bytes(tokenizer.backend.token_to_id("<0xC3>")) == b"\xc3"
        assert tokenizer.token_text(tokenizer.backend.token_to_id("▁hello")) == " hello"


def test_echoed_prompt_offsets_are_where_each_token_starts_in_its_text(sentencepiece):
    """Completions' echo with logprobs: a prompt token's text_offset is where it starts in
    the echoed prompt, not a sum of tokens read alone (a skipped BOS counted 3, a
    SentencePiece space none), so the generated tokens' offsets, which start at the
    prompt's end, go on from them. Ids echo as their decode, specials kept; a text as sent,
    where a BOS the tokenizer added is not written."""
    from pagedserve.engine.sampler import TokenLogprob
    from pagedserve.server.logprobs import LogprobFormatter

    sp = sentencepiece
    prompt = [1] + sp.encode("▁hello▁world▁é.", add_special_tokens=False)
    lps = [None] + [TokenLogprob(t, -1.0, []) for t in prompt[1:]]
    for echoed, kept in ((sp.decode(prompt, skip_special_tokens=False), True),
                         ("hello world é.", False)):
        offsets = LogprobFormatter(sp).legacy_prompt(prompt, lps, 0, echoed)["text_offset"]
        prefixes = [sp.decode(prompt[:i], skip_special_tokens=not kept)
                    for i in range(len(prompt))]
        assert offsets == [len(t) if "\ufffd" not in t else offsets[i]
                           for i, t in enumerate(prefixes)], echoed
        assert offsets == sorted(offsets)
        assert offsets[-1] == len(echoed) - 1  # the "." starts one character before the end
        assert echoed[offsets[2]:].startswith("hello")


def test_echoed_offsets_count_the_special_tokens_a_text_holds(embedded):
    """A chat-formatted text prompt: its special tokens are in the echo, and take its room."""
    from pagedserve.engine.sampler import TokenLogprob
    from pagedserve.server.logprobs import LogprobFormatter

    tok = embedded.tokenizer
    text = "<|im_start|>The capital<|im_end|>\n"
    prompt = tok.encode(text)
    lps = [None] + [TokenLogprob(t, -1.0, []) for t in prompt[1:]]
    offsets = LogprobFormatter(tok).legacy_prompt(prompt, lps, 0, text)["text_offset"]
    pieces = [tok.decode([t], skip_special_tokens=False) for t in prompt]
    assert [text[o:o + len(p)] for o, p in zip(offsets, pieces, strict=True)] == pieces


def test_only_len_of_longest_stop_minus_one_characters_are_held_back(byte_level):
    ids = byte_level.encode(" hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level, ["xyz"])
    shown = "".join(detok.add(t)[0] for t in ids)
    full = byte_level.decode(ids)
    assert shown == full[:-2]  # "xyz" could start in the last 2 characters, no earlier
    assert shown + detok.flush() == full


def test_the_earliest_of_two_stop_strings_in_one_token_wins(byte_level):
    ids = byte_level.encode(" hello", add_special_tokens=False)
    assert len(ids) == 1  # the premise: one token holds both stop strings
    detok = IncrementalDetokenizer(byte_level, ["l", "e"])
    text, stopped = detok.add(ids[0])
    assert stopped and text == " h" and detok.stop_hit == "e"


def test_of_two_stop_strings_found_at_one_place_the_first_listed_wins(byte_level):
    """vLLM's stop_reason is the first listed of those the new text holds; kept where two
    start at the same place (the earliest place still wins: the test above)."""
    [token_id] = byte_level.encode(" hello", add_special_tokens=False)
    for stop in ([" hell", " he"], [" he", " hell"]):
        detok = IncrementalDetokenizer(byte_level, stop, keep_stop=True)
        text, stopped = detok.add(token_id)
        assert stopped and detok.stop_hit == stop[0] and text == stop[0]


def test_a_stop_string_before_min_tokens_is_not_cut_at_the_flush(byte_level):
    """check_stop False (not past min_tokens): a stop string in the text held back is text;
    the flush at the end (a sample of max_tokens == min_tokens) must not cut it."""
    ids = byte_level.encode(" say ab", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level, ["ab", "zzzzzzzzzz"])
    shown = "".join(detok.add(t, check_stop=False)[0] for t in ids)
    assert "ab" not in shown  # the premise: "ab" is in the held-back tail
    assert shown + detok.flush() == " say ab"
