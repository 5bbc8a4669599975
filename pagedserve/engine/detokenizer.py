"""Incremental detokenization with stop strings.

Each new token goes to a `tokenizers` DecodeStream, which decodes a short window of recent
tokens in Rust and returns the text the token completes, or nothing while the window ends
inside a multi-byte character, so a stream never splits one. One call a token, without the
GIL handoffs of `decode_batch`: this runs for every sequence on every step. Only the text
that could still open a stop string is kept; everything before it has been handed out, so
each token costs the same however long the stream is.
"""

import functools
from collections.abc import Callable

from tokenizers.decoders import DecodeStream

from pagedserve.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.stop = [s for s in stop if s]
        # The stream starts at the first generated token: the text is that of the output
        # ids decoded alone (the prompt's last tokens are no context).
        self._backend, self._skip_special_tokens = tokenizer.backend, skip_special_tokens
        self._step = self._new_stream()
        self._pending = ""  # decoded, not yet handed out: it might open a stop string
        # This many trailing characters are held back: they might open a stop string.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_id: int) -> tuple[str, bool]:
        """Take the sequence's newest token. Returns the text that became visible, and
        whether a stop string was hit (the text then ends before it, and nothing follows)."""
        try:
            text = self._step(token_id)
        except Exception as e:
            # The stream finds its window's text changed under it (bytes that are not UTF-8,
            # decoded by byte fallback): start a fresh window at this token.
            if not str(e).startswith("Invalid prefix"):
                raise
            self._step = self._new_stream()
            text = self._step(token_id)
        if not text:
            return "", False
        if not self.stop:  # nothing to hold back
            return text, False
        self._pending += text
        hits = [(at, s) for s in self.stop if (at := self._pending.find(s)) != -1]
        if hits:
            text = self._pending[: min(hits)[0]]
            self._pending = ""
            return text, True
        visible = len(self._pending) - self._holdback
        if visible <= 0:
            return "", False
        text, self._pending = self._pending[:visible], self._pending[visible:]
        return text, False

    def _new_stream(self) -> Callable[[int], str | None]:
        stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return functools.partial(stream.step, self._backend)

    def flush(self) -> str:
        """The held-back text, once the sequence has finished for another reason."""
        text, self._pending = self._pending, ""
        return text
