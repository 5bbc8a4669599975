"""Constraints to llguidance grammars, compiled once per key, and the per-sample matcher.

llguidance was picked over xgrammar by measurement (nested JSON schema, 49k vocabulary,
batch of 32, one CPU thread): a schema compiles in ~1.5-3 ms against xgrammar's ~14-19 ms,
it imports in 0.1 s (xgrammar pulls in transformers: 5 s) and has no dependencies; its
masks cost ~2 ms a step for 32 distinct schemas (xgrammar's precomputed ones ~0.2 ms), small
beside a decode step. Matchers deep-copy, which is how forked samples get their own."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import torch

from pagedserve.scheduler import InvalidRequest, StructuredOutputs
from pagedserve.structured.bitmask import allocate_bitmask, allowed_tokens
from pagedserve.structured.schema import depth, subschemas

# Any JSON object, as OpenAI's {"type": "json_object"} asks for.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON laid out as json.dumps does (", " and ": ", no other whitespace): free whitespace
# lets a small model pad with newlines until max_tokens instead of closing the object.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# How many tokens past a grammar's start the compile step follows where its mask allows one
# token only: a resource limit of llguidance's (a{1000000}, minItems 20000) trips there.
_FORCED_STEPS = 16


class LLGuide:
    """One sample's matcher (the scheduler's ``Guide``)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.error: str | None = None  # why the matcher gave up, if it did

    def accept(self, token_id: int) -> bool:
        ok = self.matcher.consume_token(token_id)
        if not ok or self.matcher.is_error():  # a resource limit tripped mid-output
            self.error = _first_line(self.matcher.get_error()) or "the token was refused"
            return True
        return self.matcher.is_stopped()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(),
                                             words.numel() * words.element_size())

    def fork(self) -> LLGuide:
        return LLGuide(self.matcher.deep_copy())


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


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe: the server validates requests
    from its worker threads while the engine thread makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 256):
        """For a pagedserve Tokenizer (its first EOS token in the model's vocabulary ends
        every grammar; None: the model has none, and takes no constraint) and a model of
        ``vocab_size`` ids."""
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = next(
            (i for i in tokenizer.eos_token_ids if 0 <= i < vocab_size), None)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # grammars actually compiled (cache misses), for tests

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(
                        TokenTable(self._source, self.vocab_size, self.eos_token_id)),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_id)
            return self._tokenizer

    def compile(self, constraint: StructuredOutputs) -> str:
        """The validated grammar of ``constraint``; InvalidRequest (naming its field) if it
        is not a valid schema, regex or grammar."""
        if self.eos_token_id is None:  # a grammar may only end with it
            raise InvalidRequest(
                "Structured outputs need the model's end-of-sequence token, and this model "
                "has none in its vocabulary", constraint.param)
        key = constraint.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        if constraint.kind == "json":
            _check_schema(constraint)
        grammar = self._grammar(constraint)
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer) \
                or self._forced_start_error(grammar)
        except BaseException as e:  # noqa: BLE001 - a Rust panic arrives as a BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            error = f"{type(e).__name__}: {e}"
        if error:
            raise InvalidRequest(f"Invalid {_NAMES[key[0]]}: {error.strip()}",
                                 constraint.param)
        with self._lock:
            self.compiles += 1
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def guide(self, constraint: StructuredOutputs) -> LLGuide:
        matcher = llguidance.LLMatcher(self.tokenizer, self.compile(constraint), log_level=0)
        if matcher.is_error():  # validated above; a resource limit can still trip here
            raise InvalidRequest(f"Invalid {_NAMES[constraint.kind]}: {matcher.get_error()}",
                                 constraint.param)
        return LLGuide(matcher)

    def _forced_start_error(self, grammar: str) -> str | None:
        """The matcher's error on the tokens every output must start with (where the mask
        allows one token only), or None: a grammar that llguidance cannot follow from its
        start is the request's 400, not an output cut short after a token or two."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        bitmask = allocate_bitmask(1, self.vocab_size)
        for _ in range(_FORCED_STEPS):
            if matcher.is_error():
                break
            LLGuide(matcher).fill_bitmask(bitmask, 0)
            allowed = allowed_tokens(bitmask, self.vocab_size)[0].nonzero()
            if matcher.is_error() or len(allowed) != 1:
                break
            token = int(allowed[0])
            if token == self.eos_token_id or not matcher.consume_token(token):
                break
        return _first_line(matcher.get_error()) if matcher.is_error() else None

    @staticmethod
    def _grammar(c: StructuredOutputs) -> str:
        kind = c.kind
        try:
            if kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(c.json, _JSON_LAYOUT)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(_JSON_OBJECT_SCHEMA,
                                                                     _JSON_LAYOUT)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(c.regex)
            if kind == "choice":
                if not c.choice:
                    raise ValueError("the choice list is empty")
                return llguidance.grammar_from("choice", json.dumps(list(c.choice)))
            return llguidance.grammar_from("grammar", c.grammar)  # GBNF/EBNF or Lark
        except BaseException as e:  # noqa: BLE001 - the client's text; a Rust panic too
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            raise InvalidRequest(f"Invalid {_NAMES[kind]}: {e}", c.param) from None


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else ""


# llguidance follows $refs recursively as it builds a grammar: a chain of ~1,000 overflowed
# its stack and killed the process (plain nesting stops at its parser's 128 levels).
_MAX_DEPTH = 400


def _check_schema(c: StructuredOutputs) -> None:
    """Refuse what llguidance accepts but does not keep: it counts an object's keys, not its
    distinct keys, so a minProperties past the required ones can be met by one key twice
    (``{"a": 1, "a": 2}``, one property once parsed)."""
    try:
        schema = json.loads(c.json)
    except (ValueError, RecursionError):
        return  # not JSON: the grammar's compile says so
    try:
        too_deep = depth(schema) > _MAX_DEPTH
    except RecursionError:
        too_deep = True
    if too_deep:
        raise InvalidRequest(f"Invalid JSON schema: nested more than {_MAX_DEPTH} levels deep "
                             "(its $refs followed)", c.param)
    for node in subschemas(schema):
        least = node.get("minProperties")
        required = node.get("required")
        known = len({r for r in required if isinstance(r, str)}) \
            if isinstance(required, list) else 0
        if isinstance(least, int) and not isinstance(least, bool) and least > known:
            raise InvalidRequest("Invalid JSON schema: minProperties beyond the required "
                                 "properties is not supported (list the properties in "
                                 "required instead)", c.param)


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice list", "grammar": "grammar"}
