"""Incremental detokenization with stop strings.

Text grows by decoding a short window of recent tokens; a window that ends inside a
multi-byte character (U+FFFD) waits for the next token, so a stream never splits one.
"""

from pagedserve.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix_offset = 0  # tokens before this are fully reflected in self.text
        self._read_offset = 0
        # Streams hold back this many characters: they might open a stop string.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add(self, output_token_ids: list[int]) -> str | None:
        """Take the newest output tokens into ``text``. Returns the stop string hit, if any
        (``text`` is then cut before it)."""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(output_token_ids[self._prefix_offset : self._read_offset], skip)
        after = decode(output_token_ids[self._prefix_offset :], skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        new_text = after[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_token_ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new_text
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) != -1]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[:at]
        return stop

    def visible_text(self, finished: bool) -> str:
        """What may be sent to a client so far."""
        if finished or not self._holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]
