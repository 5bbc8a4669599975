"""What the engine hands back for each request after a step."""

from dataclasses import dataclass, field

from pagedserve.engine.sampler import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative; while streaming, excludes a possible stop-string prefix
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each step added tokens
