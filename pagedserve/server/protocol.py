"""Request bodies under OpenAI's (and vLLM's) field names (the error shape is errors.py's,
chat messages and tool definitions are chat_messages.py's).

Responses are plain dicts built in responses.py; only what clients send is modelled here, so
that pydantic's validation errors can be turned into OpenAI-shaped 400s in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from pagedserve.engine import InvalidRequest, RequestOutputKind, SamplingParams, StructuredOutputs
from pagedserve.models.generation_config import SamplingDefaults
from pagedserve.server.chat_messages import (
    ChatMessage,
    FunctionDefinition,
    NamedToolChoice,
    ToolDefinition,
    function_parameters,
)
from pagedserve.server.errors import (  # noqa: F401 - the error shape, re-exported
    ERROR_TYPES,
    APIError,
    ErrorInfo,
    ErrorResponse,
    error_body,
    validation_error,
)
from pagedserve.server.fields import Body, Text, short_text
from pagedserve.server.structured_fields import (
    ResponseFormat,
    StructuredOutputsField,
    constraint,
    required_calls_constraint,
    response_format_constraint,
)


def _prompt_kind(value: Any) -> str:
    """Which PromptInput form ``value`` is, read from its first item: a tagged union checks
    one form (a plain union tries each in turn: 25x slower on a long list of token ids)."""
    if isinstance(value, list) and value:
        return {str: "texts", list: "id_lists"}.get(type(value[0]), "ids")
    return "text" if isinstance(value, str) else "ids"


# A string, a list of strings, token ids, or a list of token-id lists.
PromptInput = Annotated[
    Annotated[Text, Tag("text")] | Annotated[list[Text], Tag("texts")]
    | Annotated[list[int], Tag("ids")] | Annotated[list[list[int]], Tag("id_lists")],
    Discriminator(_prompt_kind),
]


@dataclass(frozen=True)
class RequestLimits:
    """What a request's numbers are checked against, beyond their own ranges."""

    vocab_size: int
    max_n: int
    # The engine's defaults for the sampling fields a request leaves out (--generation-config)
    defaults: SamplingDefaults = SamplingDefaults()
    max_model_len: int | None = None


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


MAX_REQUEST_ID_CHARS = 512  # a request's id is echoed in every chunk of its stream
MAX_STOP_STRINGS = 4
RequestIdText = short_text(MAX_REQUEST_ID_CHARS)

# Request fields of vLLM's (and OpenAI's legacy functions) that this server cannot honour: a
# value that asks something (anything but null, false, 0, [] or {}) is refused by name (a
# 400), never ignored, which would change the answer.
_REFUSED = ("logits_processors", "functions", "function_call")


class RepetitionDetectionField(Body):
    """vLLM's repetition_detection (SamplingParams checks the values)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class _SamplingFields(Body):
    """Fields both endpoints share; ``to_params`` makes the engine's SamplingParams. Fields
    no one knows are kept (``model_extra``), so that the server can log them, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    include_stop_str_in_output: bool = False  # vLLM's
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI) -> bias
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted and ignored
    # vLLM's: the response's id is built on it (request_ids.py)
    request_id: RequestIdText | None = None
    # vLLM's guided decoding extras (at most one of them, or structured_outputs).
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputsField | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top k
    logprob_token_ids: list[int] | None = None  # vLLM's: these ids' logprobs, not the top k
    thinking_token_budget: Any = None  # vLLM's: SamplingParams checks it (-1: no bound)
    repetition_detection: RepetitionDetectionField | None = None  # vLLM's
    response_format: ResponseFormat | None = None
    # vLLM's: only these tokens may be sampled; the prompt's first tokens dropped to keep its
    # last k (-1: max_model_len); logprobs' tokens as "token_id:N"
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[Text] | None = None  # vLLM's: words the output may not contain
    cache_salt: Text | None = None  # vLLM's: prefix-cache hits only under the same salt
    priority: int = 0  # vLLM's: lower first, under --scheduling-policy priority
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool | None = None  # vLLM's: the prompt's ids and the output's
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: which end is kept
    use_beam_search: bool = False  # vLLM's (server/beam_search.py), with length_penalty
    length_penalty: float = 1.0
    logits_processors: Any = None  # the _REFUSED fields, of any type: each refused by name
    functions: Any = None
    function_call: Any = None

    def _response_format(self) -> StructuredOutputs | None:
        return response_format_constraint(self.response_format)

    def _constraints(self) -> list[StructuredOutputs]:
        """Every structured-output constraint the request names (the endpoints add theirs)."""
        found = []
        guided = {"guided_json": ("json_schema", self.guided_json),
                  "guided_regex": ("regex", self.guided_regex),
                  "guided_choice": ("choice", self.guided_choice),
                  "guided_grammar": ("grammar", self.guided_grammar)}
        for param, (kind, value) in guided.items():
            if value is not None:
                found.append(constraint(param, **{kind: value}))
        so = self.structured_outputs
        if so is not None:
            found.append(so.constraint())
        return found

    def _structured(self, extra: list[StructuredOutputs] = ()) -> StructuredOutputs | None:
        found = [*self._constraints(), *extra]
        if len(found) > 1:
            names = ", ".join(c.param or "?" for c in found)
            raise InvalidRequest(f"Only one structured-output constraint may be given; this "
                                 f"request has {names}.", found[1].param)
        return found[0] if found else None

    def _params(self, max_tokens: int | None, logprobs: int | None,
                limits: RequestLimits, structured: StructuredOutputs | None = None,
                echo_logprobs: int | None = None) -> SamplingParams:
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt_logprobs cannot be streamed", "prompt_logprobs")
        for name in _REFUSED:
            if getattr(self, name) not in (None, False, [], {}):  # (0 == False)
                raise InvalidRequest(f"{name} is not supported by this server", name)
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            # OpenAI's "up to 4" (vLLM's VLLM_MAX_STOP_STRINGS): each is searched for in
            # every new token's text
            raise InvalidRequest(f"stop may hold at most {MAX_STOP_STRINGS} strings, got "
                                 f"{len(self.stop)}", "stop")
        if self.stream_options is not None and not self.stream:  # vLLM's 400 too
            raise InvalidRequest("stream_options can only be given with stream: true",
                                 "stream_options")
        prompt_logprobs = self.prompt_logprobs
        if echo_logprobs is not None:  # completions echo: the prompt's logprobs are shown
            prompt_logprobs = max(prompt_logprobs or 0, echo_logprobs)
        defaults, cap = limits.defaults.fields, limits.defaults.max_tokens_cap

        def given(name: str, fallback: float) -> Any:  # the request's, else the engine's
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        limit = limits.max_model_len
        if max_tokens is not None and limit is not None and max_tokens > limit:
            # vLLM's one refusal of max_tokens: a number past the room a prompt leaves is
            # not one, the output ends at the context's end ("length").
            raise InvalidRequest(f"This model's maximum context length is {limit} tokens, "
                                 f"and max_tokens={max_tokens} cannot be greater. Please "
                                 "request fewer output tokens.", "max_tokens",
                                 "context_length_exceeded")
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")  # (still None: up to the context length)
        if cap is not None:
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)
        params = SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=given("top_k", 0),
            min_p=given("min_p", 0.0),
            seed=self.seed,
            repetition_penalty=given("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=list(self.stop_token_ids or []),
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            cache_salt=self.cache_salt,
            priority=self.priority,
            ignore_eos=self.ignore_eos,
            logprobs=None if self.logprob_token_ids else logprobs,  # (vLLM's: the ids count)
            logprob_token_ids=self.logprob_token_ids,
            thinking_token_budget=self.thinking_token_budget,
            repetition_detection=(self.repetition_detection.model_dump()
                                  if self.repetition_detection else None),
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured,
            # A response that is not streamed needs the finished outputs alone.
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        params.validate(limits.vocab_size, limits.max_n)  # InvalidRequest -> 400
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        opts = self.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int = 16  # (an explicit null too, as vLLM and OpenAI read it)
    logprobs: int | None = None
    best_of: int | None = None
    suffix: Text | None = None  # refused: not ignored, which would change the answer
    add_special_tokens: bool = True  # vLLM's: a text prompt's BOS (false: sent pre-rendered)

    def to_params(self, limits: RequestLimits) -> SamplingParams:
        """With best_of > n the engine generates best_of samples (always with their logprobs,
        to rank them); the server returns the n best (``pick_best``)."""
        if self.suffix:  # as vLLM's
            raise InvalidRequest("suffix is not supported", "suffix")
        if self.logprob_token_ids and self.logprobs is None:  # (vLLM's words, both)
            raise InvalidRequest("when using `logprob_token_ids`, `logprobs` must be set.",
                                 "logprob_token_ids")
        if self.logprob_token_ids and self.echo_only:
            raise InvalidRequest("`logprob_token_ids` is not supported when `echo=True` and "
                                 "`max_tokens=0` because no output tokens are generated.",
                                 "logprob_token_ids")
        # echo with max_tokens 0: one token generated, never shown (the prompt's logprobs
        # need its forward pass; its request group hides it), as vLLM does
        max_tokens = 1 if self.echo_only else self.max_tokens
        if self.best_of is None or self.best_of == self.n:
            return self._params(max_tokens, self.logprobs, limits, self._completionconstraint(),
                                self.logprobs if self.echo else None)
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise InvalidRequest("best_of must be at least n", "best_of")
        if self.stream:
            raise InvalidRequest("best_of other than n cannot be streamed (the best samples "
                                 "are known only at the end)", "best_of")
        if self.best_of > limits.max_n:
            raise InvalidRequest(f"best_of must be at most {limits.max_n}", "best_of")
        params = self._params(max_tokens, self.logprobs, limits, self._completionconstraint(),
                              self.logprobs if self.echo else None)
        params.n = self.best_of
        if params.num_logprobs is None:  # each token's own logprob ranks the samples
            params.logprobs = 0
        return params

    def _completionconstraint(self) -> StructuredOutputs | None:
        return self._structured([c for c in [self._response_format()] if c])

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    @property
    def candidates(self) -> int:
        """Samples generated per prompt."""
        return max(self.n, self.best_of or 0)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message is left open, continued
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's own variables
    # A request's own template: used only under --trust-request-chat-template (vLLM's)
    chat_template: Text | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS before the rendered prompt
    # Template variables, as vLLM passes them (transformers' documents; gpt-oss's effort)
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] \
        | None = None
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1)  # (OpenAI's 400)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: false leaves a thinking model's reasoning out

    def to_params(self, limits: RequestLimits) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.logprob_token_ids and not self.logprobs:  # (vLLM's words)
            raise InvalidRequest("when using `logprob_token_ids`, `logprobs` must be set to "
                                 "true.", "logprob_token_ids")
        most = SamplingParams.MAX_LOGPROBS
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= most:
            raise InvalidRequest(f"top_logprobs must be between 0 and {most}", "top_logprobs")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        extra = [c for c in (self._response_format(), self._toolconstraint()) if c]
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                            limits, self._structured(extra))

    @property
    def tool_mode(self) -> str | None:
        """None (no tools in play), "auto", "required" or "named"."""
        choice = self.tool_choice
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice == "required":
            return "required"
        return "auto" if self.tools else None

    def tool(self, name: str) -> FunctionDefinition | None:
        return next((t.function for t in self.tools or [] if t.function.name == name), None)

    def _toolconstraint(self) -> StructuredOutputs | None:
        """required and a named function are enforced by a JSON schema over the calls."""
        mode = self.tool_mode
        if mode in ("required", "named") and not self.tools:
            raise InvalidRequest(f"tool_choice {mode!r} needs tools", "tool_choice")
        if self.tool_choice == "auto" and not self.tools:  # (vLLM's 400 too)
            raise InvalidRequest("tool_choice 'auto' needs tools", "tool_choice")
        if mode == "named":
            name = self.tool_choice.function.name
            function = self.tool(name)
            if function is None:
                raise InvalidRequest(f"tool_choice names the function {name!r}, which is not "
                                     "among the tools", "tool_choice")
            return constraint("tools", function_parameters(function))
        if mode == "required":
            return required_calls_constraint(self.tools, self.parallel_tool_calls)
        return None


class TokenizeRequest(Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None  # with messages: rendered as chat renders them
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Text | None = None  # as chat's
    return_token_strs: bool = False  # vLLM's: each token's vocabulary entry too


class DetokenizeRequest(Body):
    model: Text | None = None
    tokens: list[int]
