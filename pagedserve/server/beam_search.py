"""use_beam_search (vLLM's, both endpoints): the engine's beam search (engine/beam_search.py)
for each of a request's prompts, every step's beams one request group, and the answer built
as any non-streamed one (``respond`` reads a BeamSearchGroup as it reads a RequestGroup)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from pagedserve.engine import (
    CompletionOutput,
    InvalidRequest,
    RequestOutput,
    SamplingParams,
)
from pagedserve.engine.beam_search import BeamSearch, BeamSearchParams, BeamSequence
from pagedserve.engine.sampler import TokenLogprob
from pagedserve.server.async_engine import EngineDeadError, EngineNotReady
from pagedserve.server.queue_limit import QueueFull
from pagedserve.server.request_group import RequestGroup, final_outputs
from pagedserve.server.serving import (
    ServerContext,
    engine_refusal,
    invalid_request,
    log_ignored_fields,
    refusal,
    take_priority_header,
)

# Request fields a beam search does not read. vLLM ignores them; here one that asks
# something is a 400, as every field the server cannot honour is (an answer that ignored it
# would not be the one asked for).
UNREAD = ("best_of", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "logit_bias",
          "allowed_token_ids", "bad_words", "min_tokens", "prompt_logprobs",
          "logprob_token_ids", "thinking_token_budget", "repetition_detection")


def beam_search_params(req: Any, params: SamplingParams) -> BeamSearchParams:
    """The search a request asks (``params``: its SamplingParams, validated). A chat's may be
    streamed, its answer coming whole at the end; a completion's may not (vLLM's rules)."""
    if req.stream and not hasattr(req, "messages"):  # (vLLM's words)
        raise InvalidRequest("Streaming is not currently supported with beam search", "stream")
    fields = type(req).model_fields
    for name in UNREAD:  # (one the endpoint does not know, as chat's best_of, is only logged)
        value = getattr(req, name, None) if name in fields else None
        if value is not None and value != fields[name].default:
            raise InvalidRequest(f"{name} cannot be used with use_beam_search", name)
    if params.structured_outputs is not None:
        raise InvalidRequest("a structured-output constraint cannot be used with "
                             "use_beam_search", params.structured_outputs.param)
    if getattr(req, "echo", False) and params.num_logprobs is not None:  # (vLLM's words)
        raise InvalidRequest("`echo` with `logprobs` is not supported with beam search "
                             "because beam search does not compute prompt logprobs.", "echo")
    if getattr(req, "echo_only", False):
        raise InvalidRequest("max_tokens 0 cannot be used with use_beam_search", "max_tokens")
    # (no max_tokens: as many steps as the context leaves, BeamSearch's bound)
    return BeamSearchParams(params.n, params.max_tokens or 2**31, params.ignore_eos,
                            params.temperature, req.length_penalty,
                            params.include_stop_str_in_output, params.skip_special_tokens)


async def beam_search_group(ctx: ServerContext, prompts: list[list[int]], req: Any,
                            http: Request) -> BeamSearchGroup:
    """The request's search, checked (every refusal a 400) before anything runs."""
    log_ignored_fields(req)
    try:
        params = req.to_params(ctx.limits())
        take_priority_header(params, http)
        beam = beam_search_params(req, params)
        limit = ctx.engine.queue.max_queue
        if limit is not None and len(prompts) * beam.beam_width > limit:
            # (each step queues every live beam: refused now, not after steps already run)
            raise InvalidRequest(f"A beam search of {len(prompts)} prompts and n={params.n} "
                                 f"queues up to {len(prompts) * params.n} requests a step, "
                                 f"more than the server's --max-queue of {limit}.", "n")
        return BeamSearchGroup(ctx, prompts, params, beam)
    except InvalidRequest as e:
        raise refusal(e, req) from None


class BeamSearchGroup:
    """A request's beam searches, read as a RequestGroup of one final output a prompt: each
    prompt's beam_width best beams as its samples, best first."""

    def __init__(self, ctx: ServerContext, prompts: list[list[int]], params: SamplingParams,
                 beam: BeamSearchParams):
        self.ctx, self.prompts, self.params, self.beam = ctx, prompts, params, beam
        self.unfinished = set(range(len(prompts)))
        self._step: RequestGroup | None = None  # the step running now

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def abort(self) -> None:
        if self._step is not None:
            self._step.abort()

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        info = self.ctx.engine_info()
        eos = info.tokenizer.eos_token_ids[0] if info.tokenizer.eos_token_ids else None
        searches = [BeamSearch(p, self.beam, eos, info.max_model_len) for p in self.prompts]
        step = self.beam.step_params(cache_salt=self.params.cache_salt,
                                     priority=self.params.priority)
        while live := [s for s in searches if not s.done]:
            beams = [beam.tokens for s in live for beam in s.beams]
            try:
                self._step = await self.ctx.engine.submit(beams, step)
            except (QueueFull, EngineNotReady, EngineDeadError) as e:
                raise engine_refusal(e) from None
            except InvalidRequest as e:
                raise invalid_request(e) from None
            try:
                outputs = iter(await final_outputs(self._step))
            finally:
                self._step.abort()  # (a no-op once all have finished; a client gone cancels)
            for s in live:
                s.advance([next(outputs).outputs[0].logprobs[0] for _ in s.beams])
        ends = [(s, s.finish()) for s in searches]
        answers = [self._answer(s, best) for s, best in ends]
        shown = [s.text_tokens(beam) for s, best in ends for beam in best]
        skip, decode = self.beam.skip_special_tokens, info.tokenizer.decode
        texts = iter(await self.ctx.run(lambda: [decode(ids, skip) for ids in shown]))
        self.unfinished.clear()
        batch = []
        for i, outs in enumerate(answers):
            for o in outs:
                o.text = next(texts)
            batch.append((i, RequestOutput(f"beam-{i}", None, self.prompts[i], outs, True)))
        yield batch

    def _answer(self, search: BeamSearch, best: list[BeamSequence]) -> list[CompletionOutput]:
        """The best beams as samples: their tokens and, where asked, each one's logprob with
        the most likely of its step's candidates."""
        k = self.params.num_logprobs
        outputs = []
        for index, beam in enumerate(best):
            tokens = search.output_tokens(beam)
            logprobs = None if k is None else [
                TokenLogprob(token, options[token],
                             sorted(options.items(), key=lambda kv: -kv[1])[:k])
                for token, options in zip(tokens, beam.logprobs, strict=False)]
            outputs.append(CompletionOutput(index, "", tokens, beam.finish_reason, logprobs,
                                            beam.stop_reason))
        return outputs
