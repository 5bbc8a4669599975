"""The engine loop: the one owner of an LLMEngine, in a thread of the server's process or in
a process of its own (``--frontend-multiprocessing``; async_engine.py starts either, and
engine_process.py is that process's side of its pipes).

LLMEngine is single-threaded and not thread-safe, so this loop builds it and makes every call
on it. Commands arrive through ``inbox`` (Add, Abort, Stop) and are applied between steps;
the loop runs ``step()`` while anything is unfinished and sleeps on the inbox otherwise (no
busy spin). What happened goes back through ``emit`` as a list of events, one list an
iteration; every value in them pickles, so the same loop serves both transports.

A fault barrier surrounds ``step()``: if it raises, only the requests of that step fail (their
groups get Failed, their blocks are freed) and the loop goes on. If the block pool no longer
agrees with the surviving sequences, the engine rebuilds its pool, scheduler and KV cache
from the loaded weights (state "rebuilding" meanwhile) and every in-flight request fails.
Only when loading or that rebuild raises is the engine dead (Died). A model that fails to
load never will, and a tensor-parallel rank that dies or hangs (RankFailed) leaves the ranks
out of step (nothing is rebuilt, the engine is dead at once): in both, Died says the server
must exit (``fatal``). A spawned rank that exits while the server is idle is noticed at once
(its exit is watched from another thread, hence the lock around ``emit``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedserve.engine import InvalidRequest, LLMEngine, RequestOutput, SamplingParams
from pagedserve.engine.distributed import RankFailed
from pagedserve.engine.outputs import CompletionOutput
from pagedserve.models.generation_config import SamplingDefaults
from pagedserve.models.loader import ModelLoadError
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.structured import GrammarCompiler

log = logging.getLogger("pagedserve.server")


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side reads of the loaded engine: names, limits and the tokenizer."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer
    grammars: GrammarCompiler  # validates structured outputs before they queue
    sampling_defaults: SamplingDefaults  # what a request's omitted sampling fields take

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.model_name, engine.max_model_len, engine.vocab_size,
                   engine.tokenizer, engine.grammars, engine.sampling_defaults)

    def __reduce__(self) -> tuple[Any, ...]:
        # Across processes the compiler is built anew: its cache and llguidance's tokenizer
        # belong to the process that made them.
        return _unpickled_info, (self.model_name, self.max_model_len, self.vocab_size,
                                 self.tokenizer, self.grammars is not None,
                                 self.sampling_defaults)


def _unpickled_info(model_name: str, max_model_len: int, vocab_size: int,
                    tokenizer: Tokenizer, grammars: bool,
                    sampling_defaults: SamplingDefaults) -> EngineInfo:
    # (no compiler: only a test's stand-in engine has none)
    compiler = GrammarCompiler(tokenizer, vocab_size) if grammars else None
    return EngineInfo(model_name, max_model_len, vocab_size, tokenizer,
                      compiler, sampling_defaults)  # type: ignore[arg-type]


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


class Inbox(Protocol):
    def take(self, block: bool) -> list[Command]:
        """The commands waiting (after waiting for at least one when ``block``)."""
        ...


class EngineLoop:
    def __init__(self, factory: Callable[[], LLMEngine], inbox: Inbox,
                 emit: Callable[[list[Event]], None]):
        self.factory, self.inbox, self._emit = factory, inbox, emit
        self._emit_lock = threading.Lock()
        self.live: dict[str, tuple[str, int]] = {}  # request id -> (group id, prompt index)
        self.groups: dict[str, list[str]] = {}  # group id -> its request ids, while any live
        self.events: list[Event] = []  # this iteration's, emitted together

    def emit(self, events: list[Event]) -> None:
        with self._emit_lock:  # the rank watcher's thread emits too
            self._emit(events)

    def run(self) -> None:
        try:
            engine = self.factory()
        except BaseException as e:  # noqa: BLE001 - reported through /health, then exit
            if isinstance(e, (ValueError, ModelLoadError, RankFailed)):  # one line says it
                log.error("loading the model failed: %s", e)
            else:
                log.exception("loading the model failed")
            # It will not load on a retry either: the server exits (1), as vLLM's does.
            error = f"loading the model failed: {e}"
            self.emit([Died(error, error, fatal=True)])
            return
        try:
            self._serve(engine)
        except BaseException as e:  # noqa: BLE001 - a bug outside the fault barrier
            log.exception("the engine loop failed")
            error = f"the engine loop failed: {type(e).__name__}: {e}"
            with contextlib.suppress(BaseException):
                self.emit([Died(error, f"The engine failed: {error}")])
            with contextlib.suppress(BaseException):
                engine.close()

    def _serve(self, engine: LLMEngine) -> None:
        self.events.append(Loaded(EngineInfo.of(engine)))
        self._flush(engine)
        log.info("engine ready: %s (max_model_len %d)", engine.model_name, engine.max_model_len)
        # Idle, a lost rank would show only at the next request. (A test's stand-in engine
        # has no group.)
        if (group := getattr(engine, "group", None)) is not None:
            group.on_failure(self._rank_exited)
        while True:
            commands = self.inbox.take(block=not engine.has_unfinished_requests())
            for command in commands:
                if isinstance(command, Add):
                    self._add(engine, command)
                elif isinstance(command, Abort):
                    engine.abort_request([i for i in command.request_ids if i in self.live])
            if any(isinstance(command, Stop) for command in commands):
                engine.abort_request(list(self.live))
                self.events.append(Failed(list(self.groups), "the server is shutting down",
                                          shutting_down=True))
                self._flush(engine)
                engine.close()
                return
            if self.events:  # the adds' answers: submit() returns before the step, not after
                self.emit(self._take_events())
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except RankFailed as e:
                    self._rank_failed(engine, e)
                    return
                except Exception:  # noqa: BLE001 - the fault barrier: fail this step only
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    if not self._recover(engine):
                        return
                    continue
                self._deliver(outputs)
            self._flush(engine)

    def _add(self, engine: LLMEngine, add: Add) -> None:
        added: list[str] = []
        try:
            for i, (request_id, prompt) in enumerate(
                    zip(add.request_ids, add.prompts, strict=True)):
                engine.add_request(prompt, dataclasses.replace(add.params), request_id)
                added.append(request_id)
                self.live[request_id] = (add.group_id, i)
        except Exception as e:  # noqa: BLE001 - InvalidRequest, or anything add_request raised
            engine.abort_request(added)  # all or nothing: its final output is dropped
            for request_id in added:
                self.live.pop(request_id, None)
            if not isinstance(e, InvalidRequest):  # a 500; not every exception pickles
                log.error("adding a request failed:\n%s", traceback.format_exc())
                e = RuntimeError(f"adding the request failed: {type(e).__name__}: {e}")
            self.events.append(Added(add.group_id, e))
            return
        self.groups[add.group_id] = add.request_ids
        self.events.append(Added(add.group_id, None))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for out in outputs:
            entry = self.live.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                self._drop(out.request_id)
            out.prompt_token_ids = []
            items.append((entry[0], entry[1], out))
        if items:
            self.events.append(Delivered(items))

    def _drop(self, request_id: str) -> None:
        group_id, _ = self.live.pop(request_id)
        if not any(r in self.live for r in self.groups[group_id]):
            del self.groups[group_id]

    def _recover(self, engine: LLMEngine) -> bool:
        """Fail the groups of the failed step's requests (aborting their other requests),
        rebuilding the engine first if its pool is unsound; False if the engine is dead."""
        try:
            failed, sound = engine.fail_step()
            if not sound:
                log.error("the block pool is inconsistent after the failure; rebuilding")
                self.events.append(StateChanged("rebuilding"))
                self.emit(self._take_events())  # /health answers 503 while this runs
                failed += engine.reset()
                self.events.append(StateChanged("ready"))
        except Exception as e:  # noqa: BLE001 - nothing left to fall back on
            log.exception("recovering from a failed step failed")
            error = f"{type(e).__name__}: {e}"
            self.events.append(Died(error, f"the engine failed: {error}"))
            self.emit(self._take_events())
            return False
        group_ids = list(dict.fromkeys(self.live[r][0] for r in failed if r in self.live))
        siblings = [r for g in group_ids for r in self.groups[g] if r in self.live]
        engine.abort_request(siblings)  # the failed requests' siblings
        for request_id in siblings:
            self._drop(request_id)
        self.events.append(Failed(group_ids, "The engine step running this request failed "
                                  "(the error is in the server log); other requests are "
                                  "unaffected."))
        self._flush(engine)
        return True

    def _rank_failed(self, engine: LLMEngine, error: RankFailed) -> None:
        log.critical("%s; the engine is dead and the server exits", error)
        self.events.append(_rank_died())
        self.emit(self._take_events())
        engine.close()  # the surviving ranks are stuck in a collective: stop them

    def _rank_exited(self, message: str) -> None:
        """From the rank watcher's thread: a spawned rank exited (the loop may be idle)."""
        log.critical("%s; the engine is dead and the server exits", message)
        self.emit([_rank_died()])

    def _flush(self, engine: LLMEngine) -> None:
        stats = engine.stats()
        self.events.append(Snapshot(
            running=stats["num_requests_running"], waiting=stats["num_requests_waiting"],
            kv_blocks_used=stats["kv_blocks_used"], kv_blocks_total=stats["num_kv_blocks"],
            kv_blocks_shared=stats["kv_blocks_shared"], stats=stats))
        self.emit(self._take_events())

    def _take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events


def _rank_died() -> Died:
    reason = "a tensor-parallel rank failed or timed out"
    return Died(reason, f"The engine failed: {reason} (details in the server log); the server "
                "is shutting down.", fatal=True)


# ---- the inbox of a loop in a thread ----------------------------------------------------------
class ThreadInbox:
    """Commands from the event loop to a loop thread in the same process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._commands: list[Command] = []

    def put(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def take(self, block: bool) -> list[Command]:
        with self._cond:
            while block and not self._commands:
                self._cond.wait()
            commands, self._commands = self._commands, []
        return commands
