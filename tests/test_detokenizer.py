"""The incremental detokenizer: streamed text equals the whole decode, never splits a
character, and stops where a stop string starts. Real tokenizers: the embedded model's
byte-level BPE, and a SentencePiece-style one (Metaspace pieces, byte fallback) built with
`tokenizers`."""

import random
from collections.abc import Sequence

import pytest
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as Backend

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.models.loader import load_model_files
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
def embedded() -> Tokenizer:
    return load_model_files(None).tokenizer


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


def stream(tokenizer: Tokenizer, ids: list[int], stop: Sequence[str] = (), skip: bool = True
           ) -> tuple[list[str], bool]:
    """The visible text after each token (then the flush), and whether a stop string hit."""
    detok = IncrementalDetokenizer(tokenizer, list(stop), skip)
    chunks = []
    for token_id in ids:
        text, stopped = detok.add(token_id)
        chunks.append(text)
        if stopped:
            return chunks, True
    return chunks + [detok.flush()], False


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_is_the_whole_decode(embedded, skip):
    for text in TEXTS:
        ids = embedded.encode(text, add_special_tokens=False)
        chunks, _ = stream(embedded, ids, skip=skip)
        assert "".join(chunks) == embedded.decode(ids, skip), text
        assert not any("\ufffd" in c for c in chunks), text  # no character split


def test_random_token_streams_equal_the_whole_decode(embedded):
    """Any ids the model may sample, special tokens and lone bytes of multi-byte characters
    among them: the text is the whole decode, less a character still incomplete at the end."""
    rng = random.Random(0)
    pool = list(range(300)) + [rng.randrange(embedded.vocab_size) for _ in range(300)]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        skip = rng.random() < 0.5
        chunks, _ = stream(embedded, ids, skip=skip)
        whole = embedded.decode(ids, skip)
        assert whole.startswith("".join(chunks)), ids
        assert len("".join(chunks)) >= len(whole.rstrip("\ufffd")), ids


def test_byte_fallback_characters_arrive_whole(sentencepiece):
    ids = sentencepiece.encode("▁hello▁world▁é▁中🙂.▁do", add_special_tokens=False)
    assert sum(3 + 0x80 <= i < 3 + 256 for i in ids) >= 7  # 中 and 🙂 went as UTF-8 bytes
    chunks, _ = stream(sentencepiece, ids)
    assert "".join(chunks) == sentencepiece.decode(ids) == "hello world é 中🙂. do"
    assert "中" in chunks and "🙂" in chunks  # each handed out whole, in one chunk


def test_bytes_that_are_not_utf8_never_raise(sentencepiece):
    """Byte tokens that form no character make `tokenizers`' stream find its window's text
    changed (it raises); the detokenizer starts a new window and goes on."""
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(sentencepiece.vocab_size) for _ in range(rng.randrange(1, 40))]
        chunks, _ = stream(sentencepiece, ids)
        assert isinstance("".join(chunks), str)


def test_stop_string_ends_the_text_before_it(embedded):
    ids = embedded.encode("The cat sat on the mat. The dog", add_special_tokens=False)
    chunks, stopped = stream(embedded, ids, stop=["zzz", "on the"])
    assert stopped and "".join(chunks) == "The cat sat "
    # Text that could still open a stop string is held back until it cannot.
    chunks, stopped = stream(embedded, ids, stop=["mat!"])
    assert not stopped and "".join(chunks) == "The cat sat on the mat. The dog"
    assert "mat" not in "".join(chunks[: ids.index(embedded.encode(" mat")[0]) + 1])
