"""What a request asks of sampling (vLLM's SamplingParams and its parts)."""

import contextlib
import enum
import json
import math
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar

from pagedserve.scheduler.errors import InvalidRequest
from pagedserve.scheduler.repetition import RepetitionDetection

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MIN_TEMPERATURE = 0.01  # vLLM's floor for a positive temperature
# vLLM's limits of bad_words (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS) as token
# sequences, each compared with a sample's last tokens every step.
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 128, 1024
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
# (vLLM's words: it stops counting at the first sequence past the limit)
TOO_MANY_BAD_WORDS = (f"Too many bad words after tokenization: {MAX_BAD_WORDS + 1}. The max "
                      f"number is {MAX_BAD_WORDS}.")
T = TypeVar("T")


@dataclass(frozen=True)
class BadWords:
    """A request's bad_words as token ids (the engine's tokenizer's), indexed for the step:
    the one-token words, and the longer ones by the last token of their prefix (the token
    a sample's output must end with for the word's last token to be masked)."""

    singles: tuple[int, ...]
    by_prefix_end: dict[int, tuple[tuple[int, ...], ...]]

    @classmethod
    def of(cls, words: tuple[tuple[int, ...], ...]) -> "BadWords | None":
        """None for no words."""
        if not words:
            return None
        longer: dict[int, tuple[tuple[int, ...], ...]] = {}
        for word in words:
            if len(word) > 1:
                longer[word[-2]] = (*longer.get(word[-2], ()), word)
        return cls(tuple(w[0] for w in words if len(w) == 1), longer)


@dataclass(frozen=True)
class ThinkingBudget:
    """A request's thinking_token_budget with its model's think tags (a reasoning parser's):
    once a sample has thought ``budget`` tokens since its last ``start`` with no ``end``
    since, ``end`` is its next token."""

    start: int
    end: int
    budget: int


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the generated text: exactly one of a JSON schema (serialized), any
    JSON object, a regex, a choice of strings, or a grammar (GBNF/EBNF or Lark). ``param``
    names the request field it came from, for error messages; it is not part of the key."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # vLLM's forms too: a schema as a dict, the choices as a list.
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequest("a structured-output constraint needs exactly one of json, "
                                 "json_object, regex, choice or grammar", self.param)
        return kinds[0]

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by: one key per constraint (a choice list
        as JSON, since any separator joined into it could be one of the strings)."""
        kind = self.kind
        value = {"json_object": "", "choice": json.dumps(self.choice)}.get(kind)
        return kind, value if value is not None else getattr(self, kind)


class Guide(Protocol):
    """A grammar matcher for one sample (pagedserve.structured implements it). Its state is
    a function of the sample's output tokens: it has consumed exactly those, in order.
    ``accept`` advances by the token just appended and is True once the grammar is complete,
    or once the matcher gave up (``error`` then says why: the sample ends as "error", its
    output unfinished); ``fill_bitmask`` writes the allowed next tokens into one row of a
    batch bitmask; ``fork`` copies the state."""

    error: str | None

    def accept(self, token_id: int) -> bool: ...
    def fill_bitmask(self, bitmask: object, row: int) -> None: ...
    def fork(self) -> "Guide": ...


StructuredOutputsParams = StructuredOutputs  # vLLM's name


class RequestOutputKind(enum.Enum):
    """What LLMEngine.step() hands back for a request (vLLM's names): DELTA, each step's new
    tokens and text; FINAL_ONLY, one output once it has finished, holding all of them (no
    per-step output for a caller that only wants the result: offline and non-streamed)."""

    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    MAX_LOGPROBS: ClassVar[int] = 20  # OpenAI's most top logprobs a token (logprobs, prompt's)
    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # sample i draws from the stream of seed + i
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: the sampled token plus the top k
    prompt_logprobs: int | None = None  # the same, for every prompt token after the first
    # vLLM's: the sampled token plus these ids at every generated position, in place of the
    # top k (a label set scored without asking the whole vocabulary); num_logprobs' count
    logprob_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    # vLLM's: words the output may not contain (the engine forbids each one's last token
    # after its others; bad_words_token_ids() in the engine's logits processors)
    bad_words: list[str] = field(default_factory=list)
    # vLLM's cache_salt (a request field there): the prefix cache serves this request only
    # blocks computed under the same salt (BlockTable.salt)
    cache_salt: str | None = None
    # vLLM's priority (a request field there): under --scheduling-policy priority, lower
    # values are admitted first and preempted last (arrival breaks ties); else unused
    priority: int = 0
    # A grammar the output must follow (vLLM's StructuredOutputsParams).
    structured_outputs: StructuredOutputs | None = None
    # Under a reasoning parser (EngineConfig.reasoning_parser), whether the model's thinking
    # is over before the first token: True, the grammar applies from it; False, after the
    # thinking's end; None, as the prompt says (vLLM's reasoning_ended: the server's call).
    reasoning_ended: bool | None = None
    # vLLM's: the most tokens a thinking model may think (its reasoning parser's tags) before
    # its end of thinking is forced; None or -1: no bound
    thinking_token_budget: int | None = None
    # vLLM's: end a sample whose output ends in a repeated pattern of tokens ("repetition")
    repetition_detection: RepetitionDetection | None = None
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    # vLLM's: False leaves each output's text empty (its token ids still come), for a caller
    # that detokenizes them itself (the server does, off the engine's critical path).
    detokenize: bool = True
    # What the engine derives from the fields above and reads every token or step: the stop
    # ids as a set, the logits processors' device tensors (memo); and the limits the fields
    # last passed validate() against. Both hold until a field is set (__setattr__), so a
    # request's prompts, which share its params, validate and derive once.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _valid_for: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        if not name.startswith("_"):
            object.__setattr__(self, "_derived", {})
            object.__setattr__(self, "_valid_for", None)
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        # vLLM's forms: no stop strings as None, one as a str (not its characters), no stop
        # token ids as None, and logit_bias's token ids as strings (JSON's keys).
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        elif isinstance(self.bad_words, str | tuple):
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(
                self.bad_words)
        if self.thinking_token_budget == -1 and not isinstance(self.thinking_token_budget, bool):
            self.thinking_token_budget = None  # (vLLM's "unlimited")
        if isinstance(self.repetition_detection, dict):  # (its fields checked as it is made)
            self.repetition_detection = RepetitionDetection(**self.repetition_detection)
        if isinstance(self.logprob_token_ids, list | tuple) and not self.logprob_token_ids:
            self.logprob_token_ids = None  # (vLLM's server reads an empty list as none)
        # Each entry once, as vLLM keeps stop ids (a valid id list is then no longer than
        # the vocabulary, however long the request's was); validate() refuses what is no
        # id. A list without repeats is kept, not copied: the server copies the params of
        # each of a request's prompts.
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            values = getattr(self, name)
            if isinstance(values, list | tuple):
                with contextlib.suppress(TypeError):  # unhashable: not ids at all
                    if len(set(values)) < len(values):
                        setattr(self, name, list(dict.fromkeys(values)))
        if self.logit_bias is None:
            self.logit_bias = {}
        elif any(isinstance(token, str) for token in self.logit_bias):
            # (a key longer than any token id is refused before int(), which fails past
            # 4,300 digits)
            if not all(isinstance(t, int) or (isinstance(t, str) and t.isascii() and t.isdigit()
                                              and len(t) <= 19) for t in self.logit_bias):
                raise InvalidRequest("logit_bias keys must be token ids", "logit_bias")
            self.logit_bias = {int(token): bias for token, bias in self.logit_bias.items()}
        # As vLLM's: a bad value raises here, where it was written; the limits that need
        # the model (the vocabulary, --max-n) are checked again when a request is added.
        self.validate()

    def text_hidden_tokens(self, eos_token_ids: Collection[int]) -> frozenset[int]:
        """The tokens that show no text where they end the sample (EOS unless ignore_eos, and
        the stop token ids: the scheduler's rule), as in vLLM unless include_stop_str_in_output."""
        if self.include_stop_str_in_output:
            return frozenset()
        return self.memo(("hidden", tuple(eos_token_ids)), lambda: frozenset(
            [*self.stop_token_ids, *(() if self.ignore_eos else eos_token_ids)]))

    @property
    def stop_token_set(self) -> frozenset[int]:
        return self.memo("stop_ids", lambda: frozenset(self.stop_token_ids))

    def memo(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, once per key until a field is set: what a request's samples
        and steps would otherwise each rebuild from its fields (a list as long as the
        vocabulary, for each of 128 samples, every step)."""
        derived = self._derived  # (a field set meanwhile, in another thread, replaces it)
        if key not in derived:
            derived[key] = build()
        return derived[key]

    def validate(self, vocab_size: int | None = None, max_n: int | None = None) -> None:
        """Raise InvalidRequest naming the first bad field (messages reach API clients).
        Every number is checked against the range the engine can honour, so that no value
        that passes can fail later inside a step; token ids need ``vocab_size``. Once
        passed, it costs nothing again for limits it has passed (a limit None: unchecked)
        until a field is set: the server's check with the vocabulary and --max-n covers
        the engine's with the vocabulary alone."""
        passed = self._valid_for
        if passed is not None and all(limit is None or limit == had for limit, had
                                      in zip((vocab_size, max_n), passed, strict=True)):
            return
        ints = {"n": self.n, "max_tokens": self.max_tokens, "min_tokens": self.min_tokens,
                "top_k": self.top_k, "seed": self.seed, "logprobs": self.logprobs,
                "prompt_logprobs": self.prompt_logprobs, "priority": self.priority}
        for name, value in ints.items():
            if value is not None and not (isinstance(value, int) and INT64_MIN <= value
                                          <= INT64_MAX):
                raise InvalidRequest(f"{name} must be a 64-bit integer", name)
        floats = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty,
                  "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty}
        for name, value in floats.items():
            if not (isinstance(value, int | float) and math.isfinite(value)):
                raise InvalidRequest(f"{name} must be a finite number", name)
        checks = [
            (self.n >= 1, "n", "n must be at least 1"),
            (max_n is None or self.n <= max_n, "n", f"n must be at most {max_n}"),
            # As vLLM: nothing to generate is no request (the server's echo of a prompt
            # alone asks for one token, and hides it).
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be at least 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must not exceed max_tokens"),
            (0 <= self.temperature <= 2, "temperature",  # (OpenAI's range; vLLM's too)
             f"temperature must be in [0, 2], got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1 (off), 0 (off) or positive"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty",
             "repetition_penalty must be positive"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "frequency_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
             f"logprobs must be between 0 and {self.MAX_LOGPROBS}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
             "prompt_logprobs", f"prompt_logprobs must be between 0 and {self.MAX_LOGPROBS}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids must not be empty", "allowed_token_ids")
        if self.allowed_token_ids is not None and self.structured_outputs is not None:
            # (two masks may leave no token at all, and the sample would break both)
            raise InvalidRequest("allowed_token_ids cannot be combined with a structured-"
                                 "output constraint", "allowed_token_ids")
        for name, tokens in (("stop_token_ids", self.stop_token_ids),
                             ("logit_bias", self.logit_bias),
                             ("allowed_token_ids", self.allowed_token_ids or [])):
            # (min and max: one pass over a list as long as the vocabulary, or longer)
            if not all(isinstance(token, int) for token in tokens) or tokens and (
                    min(tokens) < 0 or (vocab_size is not None and max(tokens) >= vocab_size)):
                bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
                raise InvalidRequest(f"{name} must name token ids in {bound}", name)
        for bias in self.logit_bias.values():  # OpenAI's range
            if not (isinstance(bias, int | float) and -100 <= bias <= 100):
                raise InvalidRequest("logit_bias values must be in [-100, 100]", "logit_bias")
        if not isinstance(self.stop, list | tuple) or not all(isinstance(t, str)
                                                              for t in self.stop):
            raise InvalidRequest("stop must be a string or a list of strings", "stop")
        if "" in self.stop:  # (vLLM's 400: an empty string would stop before any text)
            raise InvalidRequest("stop cannot contain an empty string", "stop")
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str)
                                                           for w in self.bad_words):
            raise InvalidRequest("bad_words must be a list of strings", "bad_words")
        if "" in self.bad_words:  # (vLLM's 400)
            raise InvalidRequest("bad_words cannot contain an empty string", "bad_words")
        if len(self.bad_words) > MAX_BAD_WORDS:  # (each word is one sequence or two)
            raise InvalidRequest(TOO_MANY_BAD_WORDS, "bad_words")
        salt = self.cache_salt  # (vLLM's rules and words: a salt names cache entries)
        if salt is not None and not (isinstance(salt, str) and salt):
            raise InvalidRequest("Parameter 'cache_salt' must be a non-empty string if "
                                 "provided.", "cache_salt")
        if salt is not None and (len(salt) > 128 or any(c in salt for c in "@/\\\0")):
            raise InvalidRequest("Parameter 'cache_salt' must be at most 128 characters and "
                                 "must not contain '@', '/', '\\\\', or NUL.", "cache_salt")
        self._validate_logprob_token_ids(vocab_size)
        budget = self.thinking_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or not 0 <= budget <= INT64_MAX):  # (vLLM's words)
            raise InvalidRequest("`thinking_token_budget` must be a non-negative integer or -1 "
                                 "for unlimited.", "thinking_token_budget")
        if not isinstance(self.repetition_detection, RepetitionDetection | None):
            raise InvalidRequest("repetition_detection must be a RepetitionDetection",
                                 "repetition_detection")
        if self.stop and not self.detokenize:  # stop strings are matched in the text
            raise InvalidRequest("stop strings need detokenize", "stop")
        if self.structured_outputs is not None:
            _ = self.structured_outputs.kind  # exactly one constraint; compiling checks the rest
        self._valid_for = (vocab_size, max_n)

    def _validate_logprob_token_ids(self, vocab_size: int | None) -> None:
        """vLLM's checks, in its words; the ids' range where the vocabulary is known."""
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
            raise InvalidRequest("logprob_token_ids must be a list of token ids",
                                 "logprob_token_ids")
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise InvalidRequest(f"Requested logprob_token_ids of length {len(ids)}, which is "
                                 f"greater than max allowed: {MAX_LOGPROB_TOKEN_IDS}",
                                 "logprob_token_ids")
        bad = [t for t in ids if not 0 <= t < vocab_size] if vocab_size is not None else []
        if bad:
            raise InvalidRequest(f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab "
                                 f"token ids. Vocabulary size: {vocab_size}", "logprob_token_ids")
        if self.logprobs is not None and self.logprobs != len(ids):
            raise InvalidRequest("When both logprobs and logprob_token_ids are set, logprobs "
                                 "must equal len(logprob_token_ids). Got logprobs="
                                 f"{self.logprobs}, len(logprob_token_ids)={len(ids)}.",
                                 "logprob_token_ids")

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives reported with each generated token (None: no logprobs at all): the
        top ``logprobs``, or the ``logprob_token_ids`` asked (vLLM's count)."""
        if self.logprobs is not None or not self.logprob_token_ids:
            return self.logprobs
        return len(self.logprob_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
