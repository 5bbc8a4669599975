"""A request group: the engine requests of one HTTP request, their deltas queued on the
event loop as the engine's events arrive, and, for a stream, the text of each sample decoded
from its token ids (the engine sends a stream's tokens without text; async_engine.py), and
the deltas that piled up while a stream was away joined (merge_deltas)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pagedserve.engine import CompletionOutput, OutputCollector, RequestOutput, SamplingParams
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.models.tokenizer import Tokenizer


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt), read as one stream of
    ``(prompt_index, delta)`` (in batches), each delta a step's new tokens of one request."""

    def __init__(self, post_abort: Callable[[list[str]], None] | None, group_id: str,
                 prompts: list[list[int]], params: SamplingParams,
                 tokenizer: Tokenizer | None = None, echo_only: bool = False):
        self.post_abort = post_abort  # the engine's: abort these request ids
        self.group_id = group_id
        self.request_ids = [f"{group_id}-{i}" for i in range(len(prompts))]
        self.prompts = prompts
        self.params = params
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.unfinished = set(range(len(prompts)))  # updated on the event loop
        self.awaiting_first_token = set(range(len(prompts)))  # for the TTFT metric
        # Completions' echo with max_tokens 0 (OpenAI's, vLLM's): the prompt alone is the
        # answer; the engine generates one token for it, which is never shown.
        self.echo_only = echo_only
        # With a tokenizer, the engine sends this group's tokens without text, and each
        # sample's text is decoded here as they arrive (prompt index, sample index).
        self.tokenizer = tokenizer
        self._detokenizers: dict[tuple[int, int], IncrementalDetokenizer] = {}

    def fill_text(self, index: int, output: RequestOutput) -> None:
        """Each sample's text in ``output`` from its new token ids (the engine left it out)."""
        assert self.tokenizer is not None
        for o in output.outputs:
            detokenizer = self._detokenizers.get((index, o.index))
            if detokenizer is None:
                detokenizer = self._detokenizers[(index, o.index)] = IncrementalDetokenizer(
                    self.tokenizer, [], self.params.skip_special_tokens,
                    prompt_ids=self.prompts[index])
            tokens = o.token_ids
            if o.finish_reason == "stop" and tokens and tokens[-1] in (
                    self.params.text_hidden_tokens(self.tokenizer.eos_token_ids)):
                tokens = tokens[:-1]  # the token that ended it (the engine's rule, there)
            o.text = "".join([detokenizer.add(token)[0] for token in tokens])
            if o.finish_reason is not None:  # a character left incomplete, as decoded whole
                o.text += detokenizer.flush()

    def hide_generated(self, output: RequestOutput) -> None:
        """Leave ``output``'s samples without their generated tokens (echo_only)."""
        for o in output.outputs:
            o.text, o.token_ids = "", []
            if o.logprobs is not None:
                o.logprobs = []

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """The deltas in lists: each list all that arrived while the reader was away (a
        stream writes them in one piece)."""
        while self.unfinished or not self.queue.empty():
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch = []
            for item in items:
                if isinstance(item, BaseException):
                    if batch:
                        yield batch
                    raise item
                batch.append(item)
            yield batch

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def abort(self) -> None:
        """Abort every unfinished request of the group (client gone); idempotent."""
        if self.unfinished and self.post_abort is not None:
            self.post_abort([self.request_ids[i] for i in self.unfinished])


def merge_deltas(batch: list[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
    """Each request's deltas in ``batch`` joined into one, as vLLM joins them when its engine
    gets ahead of a stream: a stream that lags pays per wake-up, not per token. A sample's
    "abort" part is dropped (an aborted sample sends nothing; its client has gone)."""
    if len(batch) < 2:
        return batch
    by_prompt: dict[int, list[RequestOutput]] = {}
    for p, out in batch:
        by_prompt.setdefault(p, []).append(out)
    merged = []
    for p, deltas in by_prompt.items():
        cut = _joinable(deltas)
        if cut > 1:
            joined = deltas[0]
            for delta in deltas[1:cut]:
                joined = _join(joined, delta)
            merged.append((p, joined))
            deltas = deltas[cut:]
        merged.extend((p, delta) for delta in deltas)
    return merged


def _joinable(deltas: list[RequestOutput]) -> int:
    """How many leading deltas join into one chunk: up to the last after which no sample has
    tokens whose text is still held back (the detokenizer waits for a whole character or a
    possible stop string). Beyond it, their logprobs would go out ahead of their text."""
    waiting: set[int] = set()
    cut = 0
    for k, delta in enumerate(deltas, 1):
        for o in delta.outputs:
            if o.text or o.finish_reason is not None:
                waiting.discard(o.index)
            elif o.token_ids:
                waiting.add(o.index)
        if not waiting:
            cut = k
    return cut


def _join(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    samples = {o.index: o for o in first.outputs}
    for o in then.outputs:
        before = samples.get(o.index)
        if before is None:
            samples[o.index] = o
        elif o.finish_reason != "abort":
            logprobs = (None if before.logprobs is None and o.logprobs is None
                        else (before.logprobs or []) + (o.logprobs or []))
            samples[o.index] = CompletionOutput(o.index, before.text + o.text,
                                                before.token_ids + o.token_ids,
                                                o.finish_reason, logprobs, o.stop_reason)
    prompt_logprobs = then.prompt_logprobs if first.prompt_logprobs is None \
        else first.prompt_logprobs
    # (not dataclasses.replace, which reads the fields anew each call: this runs per chunk
    # of a stream that lags)
    return RequestOutput(**{**vars(then), "outputs": [samples[i] for i in sorted(samples)],
                            "prompt_logprobs": prompt_logprobs})


async def final_outputs(group: RequestGroup) -> list[RequestOutput]:
    """A group's whole outputs, in prompt order, once every request has finished."""
    collector, finals = OutputCollector(), {}
    async for batch in group.batches():
        for index, delta in batch:
            if (out := collector.add(delta)) is not None:
                finals[index] = out
    return [finals[i] for i in range(len(group.prompts))]
