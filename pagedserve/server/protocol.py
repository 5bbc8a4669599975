"""Request bodies under OpenAI's (and vLLM's) field names, and the OpenAI error shape.

Responses are plain dicts built in serving.py; only what clients send is modelled here, so
that pydantic's validation errors can be turned into OpenAI-shaped 400s in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
)

from pagedserve.engine import InvalidRequest, SamplingParams


class _Body(BaseModel):
    # Unknown fields (suffix, ...) are ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")


def _valid_unicode(text: str) -> str:
    # JSON can spell a lone UTF-16 surrogate ("\\ud800"), which neither a tokenizer nor a
    # UTF-8 response can carry.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (a lone surrogate was found)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


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


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields both endpoints share; ``to_params`` makes the engine's SamplingParams."""

    model: Text | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
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

    def _params(self, max_tokens: int | None, logprobs: int | None,
                limits: RequestLimits) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = self.logit_bias or {}
        if not all(key.isascii() and key.isdigit() for key in bias):
            raise InvalidRequest("logit_bias keys must be token ids", "logit_bias")
        params = SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            logit_bias={int(key): value for key, value in bias.items()},
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
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
    max_tokens: int | None = 16  # None (an explicit null): up to the context length
    logprobs: int | None = None
    best_of: int | None = None

    def to_params(self, limits: RequestLimits) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is only supported equal to n (every candidate is "
                                 "returned)", "best_of")
        return self._params(self.max_tokens, self.logprobs, limits)


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def to_params(self, limits: RequestLimits) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", "top_logprobs")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                            limits)



def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and plain-text content."""
    roles = {"developer": "system"}
    return [{"role": roles.get(m.role, m.role), "content": m.text()} for m in messages]


class TokenizeRequest(_Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[int]


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: every non-2xx answer has this shape."""

    error: ErrorInfo


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    default = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {
        "message": message,
        "type": ERROR_TYPES.get(status, default),
        "param": param,
        "code": code,
    }}


def validation_error(errors: list[Any]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 naming its field."""
    if not errors:
        return APIError(400, "Invalid request body.", code="invalid_value")
    first = errors[0]
    if first.get("type") == "json_invalid":  # its location is a character offset
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}".rstrip(": "),
                        code="invalid_json")
    # Union members and validators add steps such as "function-after[...]" to the path.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p)]
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = "Field required"
    text = f"{'.'.join(loc)}: {message}" if loc else message
    # param names the top-level field; the message keeps the full path.
    return APIError(400, text, param=loc[0] if loc else None, code="invalid_value")
