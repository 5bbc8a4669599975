"""Beam search as vLLM 0.32 runs it: a loop around the engine, not inside it. Each step every
live beam is one engine request of one token with the 2k most likely next tokens' logprobs
(k the beam width); the beams' candidates are ranked by cumulative logprob and the best k go
on, while a candidate ending in EOS is set aside as complete. After max_tokens steps the k
best of the complete and the live beams, by cumulative logprob over length ** length_penalty,
are the answer. The prefix cache makes each step's requests cost their last tokens only."""

import math
from dataclasses import dataclass, field

from pagedserve.engine.sampler import TokenLogprob
from pagedserve.scheduler import InvalidRequest, RequestOutputKind, SamplingParams

# A step asks for 2k logprobs, and no request may ask for more than MAX_LOGPROBS (vLLM's
# default max_logprobs bounds it the same way).
MAX_BEAM_WIDTH = SamplingParams.MAX_LOGPROBS // 2


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (the fields pagedserve honours)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # only draws each step's one sampled candidate
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the EOS that ended a beam stays in its output
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        width, steps = self.beam_width, self.max_tokens
        if isinstance(width, bool) or not isinstance(width, int) or not (
                1 <= width <= MAX_BEAM_WIDTH):
            raise InvalidRequest(f"the beam width (n) must be in [1, {MAX_BEAM_WIDTH}] with "
                                 "beam search, each step asking 2n logprobs", "n")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if not (isinstance(self.length_penalty, int | float)
                and math.isfinite(self.length_penalty)):
            raise InvalidRequest("length_penalty must be a finite number", "length_penalty")
        self.step_params()  # the temperature's range, checked as any request's

    def step_params(self, **fields: object) -> SamplingParams:
        """What each beam's request of a step asks (``fields``: a request's own, as its
        cache_salt and priority)."""
        return SamplingParams(max_tokens=1, temperature=self.temperature,
                              logprobs=2 * self.beam_width, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY, **fields)


@dataclass
class BeamSequence:
    """One beam (vLLM's BeamSearchSequence): the prompt's and its output's tokens (with the
    EOS that completed it), each step's candidates with their logprobs, and their sum."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (EOS) | "length" once the search is over
    stop_reason: int | None = None  # the EOS id of a "stop" (vLLM's, online)
    text: str | None = None  # filled by the caller


@dataclass
class BeamSearchOutput:
    """vLLM's: one prompt's best beams, best first."""

    sequences: list[BeamSequence]


class BeamSearch:
    """One prompt's search; ``advance`` takes a step's engine outputs, one per live beam."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int):
        self.prompt_len = len(prompt)
        self.params, self.eos = params, eos_token_id
        self.beams = [BeamSequence(list(prompt))]
        self.completed: list[BeamSequence] = []
        # max_tokens steps, or as many as the context leaves (vLLM's server's bound); one at
        # least, whose request the engine checks the prompt by (a full context is its 400)
        self.steps_left = min(params.max_tokens, max(1, max_model_len - self.prompt_len))

    @property
    def done(self) -> bool:
        return not self.beams or self.steps_left <= 0

    def advance(self, steps: list[TokenLogprob]) -> None:
        """``steps[i]``: the token the engine sampled for beam i and its top 2k; each is a
        candidate (vLLM's order: the sampled token first). Only the beams kept are built:
        a candidate's token list is as long as the context."""
        if len(steps) != len(self.beams):
            raise ValueError(f"{len(steps)} step outputs for {len(self.beams)} beams")
        candidates = []
        stops = self.eos is not None and not self.params.ignore_eos
        for b, (beam, step) in enumerate(zip(self.beams, steps, strict=True)):
            options = {step.token_id: step.logprob, **dict(step.top)}
            for token, logprob in options.items():
                total = beam.cum_logprob + logprob
                if stops and token == self.eos:
                    self._complete(beam, options, total)
                else:
                    candidates.append((total, b, token, options))
        # (stable: equal sums keep the beams' and candidates' order)
        candidates.sort(key=lambda c: -c[0])
        self.beams = [BeamSequence([*self.beams[b].tokens, token],
                                   [*self.beams[b].logprobs, options], total)
                      for total, b, token, options in candidates[:self.params.beam_width]]
        self.steps_left -= 1

    def _complete(self, beam: BeamSequence, options: dict[int, float], total: float) -> None:
        """Set ``beam`` and the EOS aside as complete, among the beam_width best complete
        ones: the answer is the best of those and the live beams, so no other one can be
        in it (and the EOS of every step would otherwise pile up)."""
        rank = self._rank(total, len(beam.tokens))  # (its EOS not counted)
        width = self.params.beam_width
        if len(self.completed) == width and rank <= self.rank(self.completed[-1]):
            return
        done = BeamSequence([*beam.tokens, self.eos], [*beam.logprobs, options], total,
                            "stop", self.eos)
        self.completed = sorted([*self.completed, done], key=self.rank, reverse=True)[:width]

    def finish(self) -> list[BeamSequence]:
        """End the search: the beam_width best beams, complete or not, best first (the live
        ones ended by "length")."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted([*self.completed, *self.beams], key=self.rank, reverse=True)
        return ranked[:self.params.beam_width]

    def rank(self, beam: BeamSequence) -> tuple[int, float]:
        """Orders beams as vLLM's score does (after transformers'): the sum over the length,
        prompt included and a final EOS not, raised to length_penalty. Compared in logs, as
        a length to a penalty of 400 overflows a float."""
        return self._rank(beam.cum_logprob, len(beam.tokens) - (beam.tokens[-1] == self.eos))

    def _rank(self, total: float, length: int) -> tuple[int, float]:
        if total == 0:
            return 1, 0.0
        scaled = math.log(abs(total)) - self.params.length_penalty * math.log(max(length, 1))
        return (2, scaled) if total > 0 else (0, -scaled)

    def text_tokens(self, beam: BeamSequence) -> list[int]:
        """The tokens a beam's text is decoded from: its output without the EOS that ended
        it, which vLLM's server never shows as text."""
        tokens = beam.tokens[self.prompt_len:]
        return tokens[:-1] if beam.finish_reason == "stop" else tokens

    def output_tokens(self, beam: BeamSequence) -> list[int]:
        """A beam's generated tokens as an answer shows them: the ending EOS only under
        include_stop_str_in_output (vLLM's server)."""
        tokens = beam.tokens[self.prompt_len:]
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            tokens = tokens[:-1]
        return tokens
