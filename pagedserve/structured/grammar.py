"""Constraints to llguidance grammars, compiled once per key, and the per-sample matcher.

llguidance was picked over xgrammar by measurement (nested JSON schema, 49k vocabulary,
batch of 32, one CPU thread): a schema compiles in ~1.5-3 ms against xgrammar's ~14-19 ms,
it imports in 0.1 s (xgrammar pulls in transformers: 5 s) and has no dependencies; its
masks cost ~2 ms a step for 32 distinct schemas (xgrammar's precomputed ones ~0.2 ms), small
beside a decode step.

Each request gets a matcher of its own, built from the cached grammar, not a copy of one
compiled matcher: copies share their lexer, whose states grow with every copy's output. One
sample that ran it out of states (``(b|c)a{500000}`` on its b) would leave every later
request of the constraint failing at its first mask, and ~12-80 MB of states held in the
cache. A fork (n > 1) copies its parent's matcher: a request's samples share one lexer."""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import is_lark_syntax

from pagedserve.scheduler import InvalidRequest, StructuredOutputs
from pagedserve.structured import workers
from pagedserve.structured.bitmask import allocate_bitmask, allowed_tokens
from pagedserve.structured.limits import NAMES, check_constraint
from pagedserve.structured.token_table import TokenTable

# Any JSON object, as OpenAI's {"type": "json_object"} asks for.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON laid out as json.dumps does (", " and ": ", no other whitespace): free whitespace
# lets a small model pad with newlines until max_tokens instead of closing the object.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                # oneOf read as anyOf (pydantic's discriminated unions write oneOf, whose
                # branches exclude each other): llguidance refuses it otherwise.
                "coerce_one_of": True}


_GBNF_LOCK = threading.Lock()
_BACKTRACE = re.compile(r"^\s*(?:<backtrace>|stack backtrace:)", re.MULTILINE)
# How many tokens past a grammar's start the compile step follows where its mask allows one
# token only: a resource limit of llguidance's (a{1000000}, minItems 20000) trips there.
_FORCED_STEPS = 16
_READY = 8  # matchers built ahead that may wait in a cache entry unclaimed


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


class ThinkingGate:
    """A thinking model's guide (vLLM's rule under a reasoning parser): until the sample has
    generated ``end`` (its end of thinking), every token is allowed and none reaches the
    matcher; from the token after it on, ``guide`` constrains it."""

    def __init__(self, guide: LLGuide, end: int, waiting: bool = True):
        self.guide, self.end, self.waiting = guide, end, waiting

    @property
    def error(self) -> str | None:
        return self.guide.error

    def accept(self, token_id: int) -> bool:
        if self.waiting:
            self.waiting = token_id != self.end
            return False
        return self.guide.accept(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.waiting:
            bitmask[row].fill_(-1)
        else:
            self.guide.fill_bitmask(bitmask, row)

    def fork(self) -> ThinkingGate:
        return ThinkingGate(self.guide.fork(), self.end, self.waiting)


@dataclass
class _Compiled:
    """A constraint's compile: its grammar, or the reason it was refused; and matchers built
    ahead (``submit``) for the requests about to be added, each taken by one."""

    grammar: str = ""
    error: str | None = None
    ready: list[llguidance.LLMatcher] = field(default_factory=list)

    @property
    def chars(self) -> int:  # what the cache bounds: a matcher takes ~70 bytes a character
        return len(self.grammar) * (1 + len(self.ready))


@dataclass
class _Job:
    """A compile queued or running, and the futures of those it is for (None: a caller
    that blocks on it)."""

    future: Future
    waiters: list[Future | None]


class GrammarCompiler:
    """Compiles constraints for one tokenizer, on the compile threads (workers.py), once per
    key: the refused ones are kept too, so that a client repeating one costs nothing.
    Thread-safe: the compile threads fill it while the engine thread reads it."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 256,
                 cache_chars: int = 4 << 20):
        """For a pagedserve Tokenizer (its first EOS token in the model's vocabulary ends
        every grammar; None: the model has none, and takes no constraint) and a model of
        ``vocab_size`` ids. The cache holds up to ``cache_size`` constraints and
        ``cache_chars`` characters of grammar, a matcher built ahead counted as its grammar's
        (a matcher takes ~70 bytes a character)."""
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = next(
            (i for i in tokenizer.eos_token_ids if 0 <= i < vocab_size), None)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use
        self._cache: OrderedDict[tuple[str, str], _Compiled] = OrderedDict()
        self._cache_size, self._cache_chars = cache_size, cache_chars
        self._compiling: dict[tuple[str, str], _Job] = {}  # each key compiles once at a time
        # What a caller still holds (a submit()'s future: the engine loop's, until its
        # request is added): found there should the cache have let it go.
        self._held: weakref.WeakValueDictionary[tuple[str, str], _Compiled] = \
            weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # held for its build (a third of a second)
        self.compiles = 0  # grammars actually compiled (cache misses), for tests

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
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
        return self._checked(constraint, self._compiled(constraint, None).result()).grammar

    def submit(self, constraint: StructuredOutputs, requests: int = 1) -> Future:
        """compile() for a caller that must not block (the engine loop, stepping): a future
        of the compile and of a matcher built for each of ``requests`` requests, which it
        may cancel (once every waiter of a queued compile has, it is skipped). Held, it
        keeps them for guide(), cached or not."""
        checked: Future = Future()

        def compiled(f: Future) -> None:
            if f.exception() is not None or f.result().error is not None or checked.done():
                _settle(checked, lambda: self._checked(constraint, f.result()))
                return
            try:  # (a callback's exception would be logged, and the waiter left waiting)
                built = workers.submit(self._build_ahead, f.result(), requests, checked)
            except BaseException as e:  # noqa: BLE001 - no compile thread: the waiter's
                if checked.set_running_or_notify_cancel():
                    checked.set_exception(e)
                return
            built.add_done_callback(lambda b: _settle(checked, b.result))

        self._compiled(constraint, checked).add_done_callback(compiled)
        return checked

    def guide(self, constraint: StructuredOutputs, after: int | None = None
              ) -> LLGuide | ThinkingGate:
        """A request's matcher, one built ahead or else one built now (on a compile thread:
        a build recurses as deep as the grammar); ``after``: a token the grammar waits for
        (ThinkingGate)."""
        compiled = self._checked(constraint, self._compiled(constraint, None).result())
        with self._lock:
            matcher = compiled.ready.pop() if compiled.ready else None
        if matcher is None:
            matcher = workers.run(self._matcher, compiled.grammar)
        guide = LLGuide(matcher)
        return guide if after is None else ThinkingGate(guide, after)

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)

    def _build_ahead(self, compiled: _Compiled, requests: int, waiter: Future) -> _Compiled:
        """On a compile thread: a matcher for each of ``requests``, unless their waiter went
        away. Those of requests that were not added after all (refused, aborted) wait for
        the next ones: at most max(_READY, requests) in all."""
        for _ in range(requests):
            if waiter.cancelled() or len(compiled.ready) >= max(_READY, requests):
                break
            matcher = self._matcher(compiled.grammar)
            with self._lock:
                compiled.ready.append(matcher)
                self._trim()
        return compiled

    def _compiled(self, constraint: StructuredOutputs, waiter: Future | None) -> Future:
        """The constraint's _Compiled: done at once where cached (or still held by a
        submit()'s future); else the compile already queued for its key, or one queued
        now, with ``waiter`` (None: a caller that blocks) among those it is for."""
        key = constraint.key
        with self._lock:
            found = self._cache.get(key)
            if found is None:
                found = self._held.get(key)
            if found is not None:
                self._keep(key, found)
                done: Future = Future()
                done.set_result(found)
                return done
            job = self._compiling.get(key)
            if job is None:
                job = _Job(Future(), [])
                workers.submit(self._compile, constraint, job)  # (may raise: none is kept)
                self._compiling[key] = job
            job.waiters.append(waiter)
            return job.future

    def _checked(self, constraint: StructuredOutputs, compiled: _Compiled) -> _Compiled:
        if compiled.error is not None:
            raise InvalidRequest(compiled.error, constraint.param)
        return compiled

    def _compile(self, constraint: StructuredOutputs, job: _Job) -> None:
        """On a compile thread: the constraint's _Compiled, kept in the cache (a refusal
        too; not a failure of the server's own, such as a MemoryError)."""
        key = constraint.key
        with self._lock:
            wanted = any(w is None or not w.cancelled() for w in job.waiters)
            if not wanted:  # its clients went away while it was queued
                del self._compiling[key]
        if not wanted:
            job.future.set_result(_Compiled(error="not compiled: no request waits for it"))
            return
        try:
            compiled = self._build(constraint)
        except InvalidRequest as e:
            compiled = _Compiled(error=str(e))
        except BaseException as e:  # noqa: BLE001 - handed to the waiters
            with self._lock:
                del self._compiling[key]
            job.future.set_exception(e)
            return
        with self._lock:
            self.compiles += 1
            del self._compiling[key]
            self._keep(key, compiled)
            self._held[key] = compiled
        job.future.set_result(compiled)

    def _keep(self, key: tuple[str, str], compiled: _Compiled) -> None:
        """In the cache, the most recent; the least recent ones out past its bounds."""
        if key in self._cache:
            self._cache.move_to_end(key)
            return
        self._cache[key] = compiled
        self._trim()

    def _trim(self) -> None:
        """The least recent constraints out, past the cache's bounds (lock held)."""
        chars = sum(c.chars for c in self._cache.values())
        while len(self._cache) > self._cache_size or (
                chars > self._cache_chars and len(self._cache) > 1):
            chars -= self._cache.popitem(last=False)[1].chars

    def _build(self, constraint: StructuredOutputs) -> _Compiled:
        if self.eos_token_id is None:  # a grammar may only end with it
            raise InvalidRequest(
                "Structured outputs need the model's end-of-sequence token, and this model "
                "has none in its vocabulary")
        check_constraint(constraint)
        kind = constraint.kind
        grammar = self._grammar(constraint)
        try:
            matcher = self._matcher(grammar)
            error = matcher.get_error() if matcher.is_error() else \
                self._forced_start_error(matcher)
        except BaseException as e:  # noqa: BLE001 - a Rust panic arrives as a BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit | MemoryError):
                raise
            error = f"{type(e).__name__}: {e}"
        if error:
            raise InvalidRequest(f"Invalid {NAMES[kind]}: {_without_backtrace(error)}")
        return _Compiled(grammar)

    def _forced_start_error(self, matcher: llguidance.LLMatcher) -> str | None:
        """The matcher's error on the tokens every output must start with (where the mask
        allows one token only), or None: a grammar that llguidance cannot follow from its
        start is the request's 400, not an output cut short after a token or two."""
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
            if is_lark_syntax(c.grammar):
                return llguidance.grammar_from("lark", c.grammar)
            with _GBNF_LOCK:  # (Python holding the GIL: one at a time, not two threads' worth)
                return llguidance.grammar_from("gbnf", c.grammar)
        except BaseException as e:  # noqa: BLE001 - the client's text; a Rust panic too
            if isinstance(e, KeyboardInterrupt | SystemExit | MemoryError):
                raise
            raise InvalidRequest(f"Invalid {NAMES[kind]}: {_without_backtrace(str(e))}",
                                 c.param) from None


def _without_backtrace(error: str) -> str:
    """llguidance's message less the native backtrace a panic appends (~3 KB of frames)."""
    return _BACKTRACE.split(error, maxsplit=1)[0].strip()


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else ""


def _settle(future: Future, value: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():  # its waiter went away (a disconnect)
        return
    try:
        future.set_result(value())
    except BaseException as e:  # noqa: BLE001 - the waiting caller's to handle
        future.set_exception(e)
