"""Incremental detokenization with stop strings.

Each new token goes to a `tokenizers` DecodeStream, which decodes a short window of recent
tokens in Rust and returns the text the token completes, or nothing while the window ends
inside a multi-byte character, so a stream never splits one. One call a token, without the
GIL handoffs of `decode_batch`: this runs for every sequence on every step. Only the text
that could still open a stop string is kept; everything before it has been handed out, so
each token costs the same however long the stream is.

The stream's window grows for as long as it returns nothing, and it decodes the whole window
for every token: a run of tokens with no text would cost O(n) a token, O(n^2) a sequence
(measured: 0.28 ms a token 4,000 tokens into a run on this module's first version, against
0.7 us). So special tokens that decoding skips never enter it (they have no text), and a
run of tokens that form no character (bytes that are not UTF-8) is handed out after
MAX_HELD tokens as the whole decode shows it, with replacement characters, the stream
starting afresh after it. The text of a sequence is then always what its tokens add to the
whole decode of the prompt's last few tokens (`_context`): a SentencePiece "▁Hello" that
opens the output keeps its space, as in vLLM, where the output decoded alone loses it. (One
exception: byte fallback replaces a whole run of byte tokens when any of it is not UTF-8, so
no bounded window can match it; such a run may show other replacement characters.)
"""

import functools
from collections.abc import Callable, Sequence

from tokenizers.decoders import DecodeStream

from pagedserve.models.tokenizer import Tokenizer

# A UTF-8 character has at most 4 bytes, so a window still short of one after this many
# tokens holds bytes that never form one.
MAX_HELD = 8
CONTEXT = 4  # prompt tokens a stream starts after (as vLLM's detokenizer does)
CONTEXT_SPAN = 4 * MAX_HELD  # the prompt tokens looked at for them (skipped specials among)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 keep_stop: bool = False, prompt_ids: Sequence[int] = ()):
        # (shared, not copied: a request's samples hold one list of its stop strings)
        self.stop = stop if all(stop) else [s for s in stop if s]
        self.keep_stop = keep_stop  # the text ends after the stop string, not before it
        self._backend, self._skip_special_tokens = tokenizer.backend, skip_special_tokens
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._step = self._new_stream()
        self._held: list[int] = []  # in the stream's window, no text yet
        # A new stream's context (its text not shown): the last token that showed text, and
        # first the prompt's last tokens, so that the output's text is what it adds to the
        # prompt's. Decoded alone, a SentencePiece "▁Hello" first loses its space.
        self._anchor = self._context(prompt_ids)
        for token_id in self._anchor:
            self._step(token_id)
        self._pending = ""  # decoded, not yet handed out: it might open a stop string
        self._stopped = False  # a stop string was hit: no text follows
        self.stop_hit: str | None = None  # the one (vLLM's stop_reason)
        self._checking = True  # stop strings are looked for (not before min_tokens)
        # This many trailing characters are held back: they might open a stop string.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Take the sequence's newest token. Returns the text that became visible, and
        whether a stop string was hit (the text then ends before it, and nothing follows).
        ``check_stop`` False (the output is not past min_tokens yet, as vLLM counts): no
        stop string ends the text here, and none that ends in this token's text ever will."""
        self._checking = check_stop
        text = self._text(token_id) if token_id not in self._skipped else ""
        if not text:
            return "", False
        if not self.stop:  # nothing to hold back
            return text, False
        self._pending += text
        new_from = len(self._pending) - len(text)
        hit = self._first_stop(self._pending, new_from) if check_stop else None
        if hit:
            text = self._pending[: self._end(*hit)]
            self._pending, self._stopped, self.stop_hit = "", True, hit[1]
            return text, True
        visible = len(self._pending) - self._holdback
        if visible <= 0:
            return "", False
        text, self._pending = self._pending[:visible], self._pending[visible:]
        return text, False

    def flush(self) -> str:
        """The text still held back, once the sequence has finished (after a stop string:
        none). A character left incomplete shows as the whole decode shows it; a stop string
        that this completes still ends the text."""
        text = "" if self._stopped else self._pending + self._decode(self._held)
        self._pending, self._held = "", []
        hit = self._first_stop(text, 0) if self._checking else None
        return text[: self._end(*hit)] if hit else text

    def _first_stop(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The stop string found in ``text`` that ends past ``new_from`` (the rest was looked
        at before), and where: the earliest, and of two found at one place the first listed
        (vLLM's order); None if none is."""
        hits = [(at, i, s) for i, s in enumerate(self.stop)
                if (at := text.find(s, max(0, new_from - len(s) + 1))) != -1]
        if not hits:
            return None
        at, _, stop = min(hits)
        return at, stop

    def _end(self, at: int, stop: str) -> int:
        """Where the text ends when the stop string found at ``at`` (the first) ends it."""
        return at + len(stop) if self.keep_stop else at

    def _text(self, token_id: int) -> str:
        """The text ``token_id`` completes through the stream ("" for none yet)."""
        try:
            text = self._step(token_id)
        except Exception as e:
            # The stream finds its window's text changed under it (bytes that are not UTF-8,
            # decoded by byte fallback): hand out what it held, and go on in a new window.
            if not str(e).startswith("Invalid prefix"):
                raise
            return self._restart_after(self._held, [token_id])
        if text:
            self._anchor = [token_id]
            if self._held:
                self._held = []
            return text
        self._held.append(token_id)
        return self._release_held() if len(self._held) >= MAX_HELD else ""

    def _release_held(self) -> str:
        """The held run's text, cut where its decode splits cleanly (one invalid sequence's
        bytes on one side), so that it reads as in the whole decode; the tokens after the
        cut (a character perhaps still to complete) go on in a new window."""
        held, whole = self._held, self._decode(self._held)
        cut = next((k for k in range(len(held) - 1, 0, -1)
                    if whole == self._decode(held[:k]) + self._decode(held[k:])), len(held))
        return self._restart_after(held[:cut], held[cut:])

    def _restart_after(self, done: list[int], rest: list[int]) -> str:
        """``done``'s text, then a new window (the anchor its context) fed ``rest``."""
        text = self._decode(done)
        self._step, self._held = self._new_stream(), []
        # Context only (its text went out already), and only where its text is whole: a
        # token that completed a character decodes alone to a replacement character, which
        # would hold the new window back and show again.
        context = self._anchor
        if context and "\ufffd" in self._backend.decode(context, self._skip_special_tokens):
            context = []
        for token_id in context:
            self._step(token_id)
        return text + "".join(self._text(t) for t in rest)

    def _context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's shortest tail of at least CONTEXT tokens (fewer in a shorter prompt)
        that decodes to whole characters; none where every tail up to MAX_HELD ends inside
        one (the output may complete it: its text then starts afresh)."""
        tail = [t for t in prompt_ids[-CONTEXT_SPAN:] if t not in self._skipped][-MAX_HELD:]
        for n in range(min(CONTEXT, len(tail)), len(tail) + 1):
            if n and "\ufffd" not in self._backend.decode(tail[-n:], self._skip_special_tokens):
                return tail[-n:]
        return []

    def _decode(self, ids: list[int]) -> str:
        """``ids``' text after the anchor's, as the whole decode has it there."""
        if not ids:
            return ""
        skip = self._skip_special_tokens
        before = self._backend.decode(self._anchor, skip) if self._anchor else ""
        return self._backend.decode(self._anchor + ids, skip)[len(before):]

    def _new_stream(self) -> Callable[[int], str | None]:
        stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return functools.partial(stream.step, self._backend)
