"""Token logprobs in OpenAI's two shapes: the legacy completions shape (tokens,
token_logprobs, top_logprobs as dicts, text_offset) and the chat shape (content entries with
token, logprob, bytes and top_logprobs)."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.sampler import TokenLogprob
from pagedserve.models.tokenizer import Tokenizer

_FLOOR = -9999.0  # JSON has no -inf


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.token_text(token_id)
        return text

    def width(self, token_id: int) -> int:
        """The characters a generated token advances text_offset by."""
        return len(self.text(token_id))

    def bytes(self, token_id: int) -> list[int]:
        """The token's raw UTF-8 bytes; a token holding part of a character gives its part."""
        return list(self.tokenizer.token_bytes(token_id))

    def legacy(self, lps: list[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
        """Completions shape for ``lps``, whose first token starts at character ``offset``;
        returns it and the offset after the last token. top_logprobs holds the top k
        alternatives plus the sampled token."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for lp in lps:
            text = self.text(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(max(lp.logprob, _FLOOR))
            top = {self.text(t): max(v, _FLOOR) for t, v in lp.top}
            top.setdefault(text, max(lp.logprob, _FLOOR))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += self.width(lp.token_id)
        return out, offset

    def legacy_prompt(self, prompt_ids: list[int], lps: list[TokenLogprob | None], k: int,
                      echoed: str) -> dict[str, Any]:
        """The prompt's tokens in the completions shape (``echo`` with ``logprobs``): the
        first has no logprob (null, as OpenAI gives it), the others their top ``k``. Each
        text_offset is where the token starts in ``echoed``, the prompt as echoed (the
        request's text, or its ids' decode), so that the generated tokens', which start at
        its end, go on from them. A special token not written there (a BOS the tokenizer
        added to a text) takes no width, nor does a first space SentencePiece's decode drops."""
        first = self.text(prompt_ids[0])
        rest, _ = self.legacy([TokenLogprob(lp.token_id, lp.logprob, lp.top[:k])
                               for lp in lps[1:]], 0)
        detokenizer = IncrementalDetokenizer(self.tokenizer, [], skip_special_tokens=False)
        special, offsets, at = self.tokenizer.special_ids, [], 0
        for token_id in prompt_ids:
            offsets.append(at)
            piece = detokenizer.add(token_id)[0]
            if echoed.startswith(piece, at):
                at += len(piece)
            elif piece[:1] == " " and echoed.startswith(piece[1:], at):
                at += len(piece) - 1
            elif token_id not in special:  # (a text that decodes otherwise: its length)
                at += len(piece)
        return {"tokens": [first, *rest["tokens"]],
                "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]],
                "text_offset": offsets}

    def vllm_prompt(self, lps: list[TokenLogprob | None], k: int) -> list[Any]:
        """vLLM's ``prompt_logprobs``: None for the first token, then for each token a dict
        of token id -> {logprob, rank, decoded_token} holding it and the top ``k``."""
        out: list[Any] = [None]
        for lp in lps[1:]:
            entry = {str(lp.token_id): self._vllm(lp.token_id, lp.logprob, lp.rank)}
            for rank, (token_id, value) in enumerate(lp.top[:k], 1):
                entry.setdefault(str(token_id), self._vllm(token_id, value, rank))
            out.append(entry)
        return out

    def _vllm(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": max(logprob, _FLOOR), "rank": rank,
                "decoded_token": self.text(token_id)}

    def chat(self, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        return [
            {
                **self._entry(lp.token_id, lp.logprob),
                "top_logprobs": [self._entry(t, v) for t, v in lp.top],
            }
            for lp in lps
        ]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token_id), "logprob": max(logprob, _FLOOR),
                "bytes": self.bytes(token_id)}


class TokenIdFormatter(LogprobFormatter):
    """vLLM's return_tokens_as_token_ids: each token as "token_id:N" (its bytes those of that
    text), for a client that maps ids itself, where a token alone may be part of a character."""

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def width(self, token_id: int) -> int:  # the token's own text, as the echo's offsets
        return len(super().text(token_id))

    def bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode())
