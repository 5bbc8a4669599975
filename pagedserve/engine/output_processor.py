"""What the engine keeps per request beside the scheduler's sequences: each sample's random
stream, detokenizer and logprobs, the request's timings, and the per-step deltas it hands
back (only the last, holding everything, for a FINAL_ONLY request). A step's work here is
proportional to the tokens it added, never to a stream's length."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedserve.engine.detokenizer import CONTEXT_SPAN, IncrementalDetokenizer
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.sampler import TokenLogprob, make_generator
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.scheduler import REPETITION_STOP_REASON, RequestOutputKind, SamplingParams, Sequence


@dataclass
class SampleState:
    seq: Sequence
    request: RequestState
    generator: torch.Generator | None  # None: unseeded, the device's default stream
    detok: IncrementalDetokenizer | None  # None: params.detokenize off, no text
    # Tokens whose text is not shown where they end the sample (looked up every token).
    hidden_enders: frozenset[int] = frozenset()
    new_token_ids: list[int] = field(default_factory=list)  # since the last output
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    # (pieces, joined once a delta: a final-only output's text grows all its run, and a
    # string built with += was copied whole every token)
    new_text: list[str] = field(default_factory=list)
    reported_finish: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[SampleState] = field(default_factory=list)
    num_cached_tokens: int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per step that added tokens
    aborted: bool = False
    # Prompt logprobs: None for the first token (nothing predicts it), then one per token;
    # reported once, in the delta of the step that completes them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    delivered: bool = False  # a delta has gone out (the first token goes at once)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:  # a one-token prompt's are complete here
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        """Every one of its n samples exists and has a finish reason (or it was aborted)."""
        if self.aborted:
            return True
        if len(self.samples) != self.params.n:
            return False
        # A loop, not all(genexpr) (3x slower): asked for each changed request every step.
        for s in self.samples:  # noqa: SIM110
            if not s.seq.finish_reason:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, device: torch.device, stream_interval: int = 1):
        self.tokenizer, self.device = tokenizer, device
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}
        self.num_output_tokens = 0
        self._changed: set[str] = set()  # requests with something to report
        self._state_of: dict[int, SampleState] = {}  # seq_id -> its sample

    def add_request(self, request: RequestState, seqs: list[Sequence]) -> None:
        self.requests[request.request_id] = request
        try:
            for seq in seqs:
                self.add_sample(seq)
        except BaseException:  # nothing of it kept
            self.drop(request.request_id)
            raise

    def add_sample(self, seq: Sequence) -> None:
        p = seq.params
        request = self.requests[seq.request_id]
        state = SampleState(
            seq=seq,
            request=request,
            generator=make_generator(p.seed, seq.sample_index, self.device),
            detok=(IncrementalDetokenizer(
                self.tokenizer, p.stop, p.skip_special_tokens, p.include_stop_str_in_output,
                seq.token_ids[max(0, seq.num_prompt_tokens - CONTEXT_SPAN):seq.num_prompt_tokens])
                if p.detokenize else None),
            hidden_enders=p.text_hidden_tokens(self.tokenizer.eos_token_ids),
        )
        request.samples.append(state)
        self._state_of[seq.seq_id] = state

    def generators(self, seqs: list[Sequence]) -> list[torch.Generator | None]:
        return [self._state_of[s.seq_id].generator for s in seqs]

    def on_scheduled(self, seqs: list[Sequence], now: float) -> None:
        for seq in seqs:
            request = self.requests[seq.request_id]
            if request.num_cached_tokens is None:
                request.num_cached_tokens = seq.num_cached_tokens
                request.first_scheduled_time = now

    def on_token(self, seq: Sequence, logprob: TokenLogprob | None, now: float) -> bool:
        """Take the token ``seq`` just appended; True if a stop string ended its text.
        (This runs for every sequence every step.)"""
        state = self._state_of[seq.seq_id]
        request = state.request
        if request.first_token_time is None:
            request.first_token_time = now
        times = request.token_times
        if not times or times[-1] != now:
            times.append(now)
        self.num_output_tokens += 1
        token_id = seq.token_ids[-1]
        state.new_token_ids.append(token_id)
        if logprob is not None:
            state.new_logprobs.append(logprob)
        self._changed.add(request.request_id)
        if state.detok is None:
            return False
        p = seq.params
        if token_id in state.hidden_enders and seq.may_stop:
            return False  # it ends the sample (the scheduler's rule): its text is not shown
        min_tokens = p.min_tokens
        text, stopped = state.detok.add(
            token_id, not min_tokens or seq.num_output_tokens > min_tokens)
        if text:
            state.new_text.append(text)
        return stopped

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.aborted = True
            self._changed.add(request_id)

    def on_prompt_logprobs(self, seq: Sequence, logprobs: list[TokenLogprob]) -> None:
        request = self.requests[seq.request_id]
        request.prompt_logprobs += logprobs  # reported with the first token's delta

    def drop(self, request_id: str) -> None:
        """Forget a request without an output (its step failed)."""
        request = self.requests.pop(request_id, None)
        self._changed.discard(request_id)
        for state in request.samples if request else []:
            del self._state_of[state.seq.seq_id]

    def take_outputs(self) -> list[RequestOutput]:
        """A delta for each request that changed since the last call; finished requests
        are forgotten after their last one. A FINAL_ONLY request gets its final delta
        alone: until then its samples' new tokens, text and logprobs pile up."""
        outputs = []
        now = time.monotonic()
        for request_id in sorted(self._changed):
            request = self.requests[request_id]
            finished = request.finished
            if not finished and (request.params.output_kind is RequestOutputKind.FINAL_ONLY
                                 or self._holds(request)):
                continue
            outputs.append(self._delta(request, finished, now))
            if finished:
                self.drop(request_id)
        self._changed.clear()
        return outputs

    def _holds(self, r: RequestState) -> bool:
        """Whether a running DELTA request's delta waits for more tokens (stream_interval);
        what it has piles up in its samples meanwhile, as a FINAL_ONLY request's does. A
        sample that has ended is not held (vLLM reports each sample on its own)."""
        if self.stream_interval == 1 or not r.delivered:
            return False
        return all(len(s.new_token_ids) < self.stream_interval
                   and not (s.seq.finish_reason and not s.reported_finish) for s in r.samples)

    def _delta(self, r: RequestState, finished: bool, now: float) -> RequestOutput:
        outs = []
        for s in r.samples:
            reason = s.seq.finish_reason
            if reason and not s.reported_finish and s.detok is not None:
                s.new_text.append(s.detok.flush())  # held for a stop string that never came
            # The final delta lists every sample, so that it carries all finish reasons.
            if not (finished or s.new_token_ids or s.new_text
                    or (reason and not s.reported_finish)):
                continue
            # (positional arguments: this runs for every streamed request every step)
            outs.append(CompletionOutput(
                s.seq.sample_index, "".join(s.new_text), s.new_token_ids, reason,
                s.new_logprobs if s.seq.params.num_logprobs is not None else None,
                _stop_reason(s) if reason in ("stop", "repetition") else None))
            s.new_token_ids, s.new_logprobs, s.new_text = [], [], []
            s.reported_finish = reason is not None
        first = not r.delivered
        r.delivered = True
        prompt_logprobs = None
        if (r.prompt_logprobs is not None and not r.prompt_logprobs_sent
                and len(r.prompt_logprobs) == len(r.prompt_token_ids)):
            prompt_logprobs, r.prompt_logprobs_sent = r.prompt_logprobs, True
        if len(outs) > 1:
            outs.sort(key=lambda o: o.index)
        return RequestOutput(
            r.request_id, r.prompt, r.prompt_token_ids, outs, finished,
            r.num_cached_tokens or 0, r.arrival_time, r.first_scheduled_time,
            r.first_token_time if first or finished else None, now if finished else None,
            r.token_times if finished else [], prompt_logprobs)


def _stop_reason(s: SampleState) -> str | int | None:
    """vLLM's stop_reason of a sample that ended with "stop": the stop string its text met,
    else the stop token id (None for EOS); "repetition_detected" with "repetition"."""
    if s.seq.finish_reason == "repetition":
        return REPETITION_STOP_REASON
    return (s.detok.stop_hit if s.detok is not None else None) or s.seq.stop_reason
