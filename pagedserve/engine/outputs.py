"""What the engine hands back for each request after a step: deltas (each step's new tokens,
text and logprobs), which an OutputCollector joins into whole outputs."""

import dataclasses
from dataclasses import dataclass, field

from pagedserve.engine.sampler import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str  # new since the last output; held back while it may open a stop string
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
    # When each step added tokens; on the final output only.
    token_times: list[float] = field(default_factory=list)


class OutputCollector:
    """Joins a request's deltas into whole outputs: ``add`` returns the request's complete
    output once its final delta arrives."""

    def __init__(self) -> None:
        self._partial: dict[str, RequestOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput | None:
        whole = self._partial.pop(delta.request_id, None)
        if whole is None:
            whole = dataclasses.replace(delta, outputs=[])
        samples = {o.index: o for o in whole.outputs}
        for o in delta.outputs:
            if o.index not in samples:
                samples[o.index] = CompletionOutput(
                    o.index, "", [], None, [] if o.logprobs is not None else None)
            sample = samples[o.index]
            sample.text += o.text
            sample.token_ids.extend(o.token_ids)
            if sample.logprobs is not None and o.logprobs is not None:
                sample.logprobs.extend(o.logprobs)
            sample.finish_reason = o.finish_reason
        whole = dataclasses.replace(
            delta, outputs=sorted(samples.values(), key=lambda o: o.index))
        if not delta.finished:
            self._partial[delta.request_id] = whole
            return None
        return whole
