"""The model's vocabulary as llguidance reads it (grammar.py's LLTokenizer)."""

from __future__ import annotations

import json
from typing import Any


class TokenTable:
    """The vocabulary as llguidance's TokenizerWrapper reads it: each of the model's token
    ids' bytes, the special ids, and an encoder. Read from a tokenizer.json, llguidance
    would mark every added token special, even one that is plain text (Qwen3's ``<think>``
    and ``<tool_call>``): no constraint whose text holds one could then be generated."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int):
        """``tokenizer``: a pagedserve Tokenizer (structured/ imports no model code)."""
        backend = tokenizer.backend
        known = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        # The model's rows past the tokenizer's (Qwen pads its vocabulary) spell nothing.
        self.tokens = [tokenizer.token_bytes(i) if i < known else b""
                       for i in range(vocab_size)]
        # An EOS added as plain text (some ChatML fine-tunes' <|im_end|>) stays special: the
        # grammar may end an output with it, never write it.
        ends = {*tokenizer.eos_token_ids, tokenizer.bos_token_id} - {None}
        self.special_token_ids = sorted(i for i in {*tokenizer.special_ids, *ends}
                                        if i < vocab_size)
        self.eos_token_id, self.bos_token_id = eos_token_id, tokenizer.bos_token_id
        self._encode = _encoder(backend, vocab_size, self.special_token_ids).encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # (TokenizerWrapper probes with bytes: text it is)
            raise TypeError("text only")
        return self._encode(text, add_special_tokens=False).ids


def _encoder(backend: Any, vocab_size: int, special_ids: list[int]) -> Any:
    """A copy of the tokenizer that adds no space in front of a text (SentencePiece's "▁",
    a byte-level add_prefix_space): llguidance tokenizes pieces of an output, not whole
    texts (and its own reader drops the Prepend normalizer likewise). Nor does it know the
    added tokens past the model's vocabulary: no output can hold one, so their text is
    spelled with the model's tokens, as is a special token's."""
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if t["id"] < vocab_size]
    for token in spec["added_tokens"]:  # an EOS added as plain text is special here too
        token["special"] = bool(token.get("special")) or token["id"] in special_ids
    for node in _nodes(spec.get("normalizer")):
        if node.get("type") == "Sequence":
            node["normalizers"] = [n for n in node["normalizers"] if n.get("type") != "Prepend"]
    if (spec.get("normalizer") or {}).get("type") == "Prepend":
        spec["normalizer"] = None
    for node in _nodes(spec.get("pre_tokenizer")):
        if node.get("type") in ("Metaspace", "ByteLevel"):
            if "prepend_scheme" in node:
                node["prepend_scheme"] = "never"
            if "add_prefix_space" in node:
                node["add_prefix_space"] = False
    encoder = type(backend).from_str(json.dumps(spec))
    encoder.encode_special_tokens = True  # "<|im_end|>" in a regex: text, not the EOS id
    return encoder


def _nodes(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer and, for a Sequence, the ones in it."""
    if not node:
        return []
    return [node, *node.get("normalizers", []), *node.get("pretokenizers", [])]
