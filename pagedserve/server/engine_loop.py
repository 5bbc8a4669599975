"""The engine loop: the one owner of an LLMEngine, in a thread of the server's process or in
a process of its own (``--frontend-multiprocessing``; async_engine.py starts either, and
engine_process.py is that process's side of its pipes).

LLMEngine is single-threaded and not thread-safe, so this loop builds it and makes every call
on it. Commands arrive through ``inbox`` (Add, Abort, Stop) and are applied between steps;
the loop runs ``step()`` while anything is unfinished and sleeps on the inbox otherwise (no
busy spin). An Add whose constraint has not compiled yet waits for it on the compile
threads, the loop stepping the others meanwhile. What happened goes back through ``emit``
as a list of events (engine_messages.py), one list an iteration; every value in them
pickles, so the same loop serves both transports.

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
from concurrent.futures import Future
from typing import Protocol

from pagedserve.engine import InvalidRequest, LLMEngine, RequestOutput
from pagedserve.engine.distributed import RankFailed
from pagedserve.models.loader import ModelLoadError
from pagedserve.server.engine_messages import (
    Abort,
    Add,
    Added,
    Command,
    Delivered,
    Died,
    EngineInfo,
    Event,
    Failed,
    Loaded,
    Snapshot,
    StateChanged,
    Stop,
)

log = logging.getLogger("pagedserve.server")


class Inbox(Protocol):
    def take(self, block: bool) -> list[Command]:
        """The commands waiting (after waiting for at least one, or a wake, when ``block``)."""
        ...

    def wake(self) -> None:
        """Ends a blocked take, or the next one, from any thread (a compile done)."""
        ...


class EngineLoop:
    def __init__(self, factory: Callable[[], LLMEngine], inbox: Inbox,
                 emit: Callable[[list[Event]], None]):
        self.factory, self.inbox, self._emit = factory, inbox, emit
        self._emit_lock = threading.Lock()
        self.live: dict[str, tuple[str, int]] = {}  # request id -> (group id, prompt index)
        self.groups: dict[str, list[str]] = {}  # group id -> its request ids, while any live
        self.events: list[Event] = []  # this iteration's, emitted together
        # Adds whose constraint compiles on the compile threads: added once it has (or has
        # failed, which add_request then says), the loop stepping the others meanwhile.
        self.compiling: list[tuple[Future, Add]] = []
        self.aborted_while_compiling: set[str] = set()

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
            # Idle, it sleeps until a command comes or a pending compile ends (its wake).
            commands = self.inbox.take(block=not engine.has_unfinished_requests())
            for command in commands:
                if isinstance(command, Add):
                    self._add_compiled(engine, command)
                elif isinstance(command, Abort):
                    engine.abort_request([i for i in command.request_ids if i in self.live])
                    self._abort_compiling(set(command.request_ids))
            self._admit_compiled(engine)
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

    def _add_compiled(self, engine: LLMEngine, add: Add) -> None:
        """Add now, or once its constraint has compiled and its prompts' matchers are built
        (~0.3-20 ms each): a slow compile (seconds, for a large schema) holds up no other
        request."""
        constraint = add.params.structured_outputs
        if constraint is not None:
            try:
                future = engine.grammars.submit(constraint, len(add.prompts))
            except Exception as e:  # noqa: BLE001 - no compile thread started: this add fails
                self._compile_failed(add, e)
                return
            if not future.done():
                self.compiling.append((future, add))
                future.add_done_callback(lambda _: self.inbox.wake())
                return
        self._add(engine, add)

    def _compile_failed(self, add: Add, e: BaseException) -> None:
        log.error("compiling a constraint failed: %s",
                  "".join(traceback.format_exception(e)).rstrip())
        self.events.append(Added(add.group_id, RuntimeError(
            f"compiling the constraint failed: {type(e).__name__}: {e}")))

    def _abort_compiling(self, request_ids: set[str]) -> None:
        """An add aborted whole while its constraint compiles is dropped (its compile with
        it, unless another request waits for it); one aborted in part, once added."""
        for entry in list(self.compiling):
            future, add = entry
            if request_ids.issuperset(add.request_ids):
                self.compiling.remove(entry)
                future.cancel()
                self.events.append(Added(add.group_id, InvalidRequest(
                    "The request was aborted while its constraint compiled.")))
            else:
                self.aborted_while_compiling.update(request_ids.intersection(add.request_ids))

    def _admit_compiled(self, engine: LLMEngine) -> None:
        for entry in [e for e in self.compiling if e[0].done()]:
            self.compiling.remove(entry)
            future, add = entry
            error = None if future.cancelled() else future.exception()
            if error is None or isinstance(error, InvalidRequest):
                self._add(engine, add)  # a refused constraint: add_request raises, Added says so
            else:  # a failure of the server's own (a MemoryError): not kept, so an add would
                self._compile_failed(add, error)  # compile it again, here, holding every step
            aborted = self.aborted_while_compiling.intersection(add.request_ids)
            self.aborted_while_compiling -= aborted
            engine.abort_request([i for i in aborted if i in self.live])

    def _add(self, engine: LLMEngine, add: Add) -> None:
        added: list[str] = []
        try:
            # The engine's own copy (not the server's), one for all of the request's prompts:
            # what it derives from the params (SamplingParams.memo) then serves them all. (In
            # the try: the copy validates, and a bad value fails this request, not the loop.)
            params = dataclasses.replace(add.params)
            for i, (request_id, prompt) in enumerate(
                    zip(add.request_ids, add.prompts, strict=True)):
                engine.add_request(prompt, params, request_id)
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
        self._woken = False

    def put(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def take(self, block: bool) -> list[Command]:
        with self._cond:
            while block and not self._commands and not self._woken:
                self._cond.wait()
            commands, self._commands, self._woken = self._commands, [], False
        return commands

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()
