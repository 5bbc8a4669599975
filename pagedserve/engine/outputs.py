"""What the engine hands back for each request after a step: deltas (each step's new tokens,
text and logprobs; for a FINAL_ONLY request one, with all of them), which an
OutputCollector joins into whole outputs."""

import dataclasses
from dataclasses import dataclass, field

from pagedserve.engine.sampler import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str  # new since the last output; held back while it may open a stop string
    token_ids: list[int]
    # "stop" | "length" | "repetition" (vLLM's repetition_detection) | "abort" | "error" (its
    # constraint's matcher gave up) | None while running
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    # vLLM's: what ended a "stop": the stop string, or the stop token id (None for EOS);
    # "repetition_detected" beside "repetition"
    stop_reason: str | int | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sampled tokens' logprobs summed (None unless logprobs were asked)."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)

    def finished(self) -> bool:  # vLLM's
        return self.finish_reason is not None


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
    # On a request's first delta and its final output (a server's TTFT, observed at once);
    # None on the deltas between.
    first_token_time: float | None = None
    finished_time: float | None = None
    # When each step added tokens; on the final output only.
    token_times: list[float] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then each
    # token's logprob and top alternatives; in exactly one delta (the first with all of them).
    prompt_logprobs: list[TokenLogprob | None] | None = None


class OutputCollector:
    """Joins a request's deltas into whole outputs: ``add`` returns the request's complete
    output once its final delta arrives. Each delta costs its own size, not the total's."""

    def __init__(self) -> None:
        # request id -> sample index -> (text pieces, token ids, logprobs or None)
        self._parts: dict[str, dict[int, tuple[list[str], list[int], list | None]]] = {}
        self._prompt_logprobs: dict[str, list] = {}

    def add(self, delta: RequestOutput) -> RequestOutput | None:
        samples = self._parts.setdefault(delta.request_id, {})
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs[delta.request_id] = delta.prompt_logprobs
        for o in delta.outputs:
            texts, token_ids, logprobs = samples.setdefault(
                o.index, ([], [], [] if o.logprobs is not None else None))
            texts.append(o.text)
            token_ids.extend(o.token_ids)
            if logprobs is not None and o.logprobs is not None:
                logprobs.extend(o.logprobs)
        if not delta.finished:
            return None
        del self._parts[delta.request_id]
        prompt_logprobs = self._prompt_logprobs.pop(delta.request_id, None)
        ends = {o.index: o for o in delta.outputs}
        outputs = [CompletionOutput(i, "".join(texts), token_ids,
                                    ends[i].finish_reason if i in ends else None, logprobs,
                                    ends[i].stop_reason if i in ends else None)
                   for i, (texts, token_ids, logprobs) in sorted(samples.items())]
        return dataclasses.replace(delta, outputs=outputs, prompt_logprobs=prompt_logprobs)
