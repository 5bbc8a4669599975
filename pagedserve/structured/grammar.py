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
from collections.abc import Callable
from typing import Any

import llguidance
import torch

from pagedserve.scheduler import InvalidRequest, StructuredOutputs

# Any JSON object, as OpenAI's {"type": "json_object"} asks for.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON laid out as json.dumps does (", " and ": ", no other whitespace): free whitespace
# lets a small model pad with newlines until max_tokens instead of closing the object.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuide:
    """One sample's matcher (the scheduler's ``Guide``)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        ok = self.matcher.consume_token(token_id)
        return not ok or self.matcher.is_stopped()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(),
                                             words.numel() * words.element_size())

    def fork(self) -> LLGuide:
        return LLGuide(self.matcher.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe: the server validates requests
    from its worker threads while the engine thread makes matchers."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_id: int,
                 cache_size: int = 256):
        self._tokenizer_json = tokenizer_json
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.5 s)
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # grammars actually compiled (cache misses), for tests

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> GrammarCompiler:
        """For a pagedserve Tokenizer (its backend's JSON, its first EOS token)."""
        return cls(tokenizer.backend.to_str, vocab_size, (tokenizer.eos_token_ids or [0])[0])

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_id)
            return self._tokenizer

    def compile(self, constraint: StructuredOutputs) -> str:
        """The validated grammar of ``constraint``; InvalidRequest (naming its field) if it
        is not a valid schema, regex or grammar."""
        key = constraint.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._grammar(constraint)
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
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


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice list", "grammar": "grammar"}
