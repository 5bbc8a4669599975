"""Request bodies under OpenAI's (and vLLM's) field names, and the OpenAI error shape.

Responses are plain dicts built in serving.py; only what clients send is modelled here, so
that pydantic's validation errors can be turned into OpenAI-shaped 400s in one place."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.scheduler import InvalidRequest, SamplingParams


class _Body(BaseModel):
    # Unknown fields (logit_bias, suffix, ...) are ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields both endpoints share; ``to_params`` makes the engine's SamplingParams."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
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
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )
        params.validate()  # InvalidRequest(message, param) -> 400
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        opts = self.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None

    def to_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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

    def to_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", "top_logprobs")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template wants them: role and plain-text content."""
        roles = {"developer": "system"}
        return [{"role": roles.get(m.role, m.role), "content": m.text()} for m in self.messages]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# ---- errors ---------------------------------------------------------------------------------
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
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = "Field required"
    text = f"{'.'.join(loc)}: {message}" if loc else message
    # param names the top-level field; the message keeps the full path.
    return APIError(400, text, param=loc[0] if loc else None, code="invalid_value")


_Model = TypeVar("_Model", bound=BaseModel)


def parse_body(model: type[_Model], body: Any) -> _Model:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
