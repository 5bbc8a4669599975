"""What the engine loop (engine_loop.py) and the server's side of it (async_engine.py) say to
each other: the loaded engine's facts (EngineInfo), the commands (Add, Abort, Stop) and the
events. Every value pickles, so the same messages cross a thread or a process's pipes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine import LLMEngine, RequestOutput, SamplingParams
from pagedserve.engine.outputs import CompletionOutput
from pagedserve.models.generation_config import SamplingDefaults
from pagedserve.models.reasoning import ReasoningParser
from pagedserve.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side reads of the loaded engine: names, limits and the tokenizer."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer
    sampling_defaults: SamplingDefaults  # what a request's omitted sampling fields take
    reasoning: ReasoningParser | None  # --reasoning-parser's

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.model_name, engine.max_model_len, engine.vocab_size,
                   engine.tokenizer, engine.sampling_defaults, engine.reasoning)


@dataclass(frozen=True)
class Snapshot:
    """Engine state published after every iteration (read by /metrics)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_shared: int = 0
    stats: dict[str, int] = field(default_factory=dict)


# ---- commands (server -> loop) ------------------------------------------------------------
@dataclass(frozen=True)
class Add:
    """One engine request per prompt, all or none (each sample params.n times)."""

    group_id: str
    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Stop:
    """Abort what is left, close the engine and end the loop."""


Command = Add | Abort | Stop


# ---- events (loop -> server) --------------------------------------------------------------
@dataclass(frozen=True)
class Loaded:
    info: EngineInfo


@dataclass(frozen=True)
class Added:
    group_id: str
    error: Exception | None  # InvalidRequest, or whatever add_request raised: nothing queued


@dataclass(frozen=True)
class Delivered:
    # (group id, prompt index, delta); a delta's prompt_token_ids are left empty (the
    # server has them: no need to copy every prompt into every step's message)
    items: list[tuple[str, int, RequestOutput]]

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent every step, pickled on the engine's critical path: rows of plain tuples pickle
        # in half the time of the dataclasses (each pickled as its instance dict), and load
        # in half the time too. A running request's delta of one sample without logprobs,
        # which most are, goes as one flat short row (a third of a full row's time): its
        # sample's index, text and new token ids and the cached count; not its request id
        # (the server's group has it) or its timings (read from the first delta, whole, and
        # the final one).
        rows: list[tuple[Any, ...]] = []
        for group_id, index, out in self.items:
            outs = out.outputs
            if (len(outs) == 1 and not out.finished and out.prompt is None
                    and out.prompt_logprobs is None and outs[0].finish_reason is None
                    and outs[0].logprobs is None and out.first_token_time is None):
                c = outs[0]
                rows.append((group_id, index, c.index, c.text, c.token_ids,
                             out.num_cached_tokens))
            else:
                rows.append((group_id, index, _output_row(out)))
        return _delivered, (rows,)


def _output_row(o: RequestOutput) -> tuple[Any, ...]:
    """RequestOutput's fields in declaration order, its CompletionOutputs' too."""
    return (o.request_id, o.prompt, o.prompt_token_ids,
            [(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs, c.stop_reason)
             for c in o.outputs],
            o.finished, o.num_cached_tokens, o.arrival_time, o.first_scheduled_time,
            o.first_token_time, o.finished_time, o.token_times, o.prompt_logprobs)


def _delivered(rows: list[tuple[Any, ...]]) -> Delivered:
    return Delivered([_from_row(*row) for row in rows])


def _from_row(group_id: str, index: int, *row: Any) -> tuple[str, int, RequestOutput]:
    if len(row) == 4:  # a short row; the request id is the server's to fill in
        sample, text, token_ids, cached = row
        return group_id, index, RequestOutput(
            "", None, [], [CompletionOutput(sample, text, token_ids, None)], False, cached)
    ((rid, prompt, ids, outs, done, cached, t0, t1, t2, t3, times, prompt_logprobs),) = row
    return group_id, index, RequestOutput(
        rid, prompt, ids, [CompletionOutput(*c) for c in outs], done, cached, t0, t1, t2, t3,
        times, prompt_logprobs)


@dataclass(frozen=True)
class Failed:
    """These groups' requests failed (a failed step) or were dropped (shutting down)."""

    group_ids: list[str]
    message: str
    shutting_down: bool = False


@dataclass(frozen=True)
class StateChanged:
    state: str  # ready | rebuilding


@dataclass(frozen=True)
class Died:
    error: str  # for /health and later submissions
    message: str  # for the requests in flight
    fatal: bool = False  # the model never loaded, or a tensor-parallel rank was lost: exit


Event = Loaded | Added | Delivered | Failed | StateChanged | Died | Snapshot
