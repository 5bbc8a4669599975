"""Incremental detokenization with stop strings.

Text grows by decoding a short window of recent tokens; a window that ends inside a
multi-byte character (U+FFFD) waits for the next token, so a stream never splits one. Only
the text that could still open a stop string is kept; everything before it has been handed
out, so each token costs the same however long the stream is.
"""

from pagedserve.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 num_prompt_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        # Offsets into the sequence's token ids: tokens before _prefix_offset are fully
        # reflected in the text handed out or pending; the window starts there.
        self._prefix_offset = self._read_offset = num_prompt_tokens
        self._pending = ""  # decoded, not yet handed out: it might open a stop string
        # This many trailing characters are held back: they might open a stop string.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Take the sequence's newest tokens. Returns the text that became visible, and
        whether a stop string was hit (the text then ends before it, and nothing follows)."""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(token_ids[self._prefix_offset : self._read_offset], skip)
        after = decode(token_ids[self._prefix_offset :], skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return "", False
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        self._pending += after[len(before) :]
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

    def flush(self) -> str:
        """The held-back text, once the sequence has finished for another reason."""
        text, self._pending = self._pending, ""
        return text
