"""The server's side of the engine loop (engine_loop.py): request groups submitted from the
event loop, and the loop's events applied there.

The loop runs in a thread of this process, or with ``engine_process`` in a process of its own
(spawned), as vLLM runs its engine core: there it has a GIL of its own, so the event loop's
per-token work (SSE chunks, socket writes) no longer waits for the engine's host work, nor
the engine for it. Commands go to the loop in order (a thread's inbox, or a pipe the event
loop writes without blocking, command_pipe.py); events come back in order
(``call_soon_threadsafe`` from the loop thread, or read off the events pipe by the event
loop itself) and are applied on the event loop, which alone owns the request groups. An
engine process that exits unasked (killed, crashed) is a dead engine: in-flight requests
fail, /health says 503, the server stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any, Protocol

from pagedserve.engine import (
    InvalidRequest,
    LLMEngine,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from pagedserve.server.command_pipe import CommandWriter
from pagedserve.server.engine_loop import EngineLoop, ThreadInbox
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
from pagedserve.server.engine_process import end_at_exit, engine_pipes, run_engine_process
from pagedserve.server.queue_limit import QueueLimit
from pagedserve.server.request_group import RequestGroup

log = logging.getLogger("pagedserve.server")
PROCESS_STOP_TIMEOUT_S = 30.0


class RequestFailed(RuntimeError):
    """The engine could not finish the request (a 500-type error for the client)."""

    status, param = 500, None


class ConstraintFailed(RequestFailed):
    """A sample's structured-output matcher gave up mid-output (a grammar engine limit)."""

    status = 400

    def __init__(self, param: str | None):
        super().__init__(f"The output could not be held to {param}: its structured-output "
                         "matcher gave up (a limit of the grammar engine; the log says which).")
        self.param = param


class StepFailed(RequestFailed):
    """The engine step that ran this request raised; the engine itself goes on."""


class EngineDeadError(RequestFailed):
    """Loading or rebuilding the engine failed; nothing more can run."""


class EngineNotReady(RuntimeError):
    """The model is still loading."""


class Observer(Protocol):
    """Called on the event loop as the engine's events arrive (metrics)."""

    def on_loaded(self) -> None: ...

    def on_added(self, num_prompt_tokens: int) -> None: ...

    def on_first_token(self, output: RequestOutput) -> None: ...

    def on_finished(self, output: RequestOutput, num_samples: int) -> None: ...


class AsyncEngine:
    def __init__(
        self,
        factory: Callable[[], LLMEngine] | None,
        max_queue: int | None = None,
        observer: Observer | None = None,
        engine_process: bool = False,
        engine_pipes: tuple[Any, Any] | None = None,
        server_index: int | None = None,
        shared_queue: Any | None = None,
    ):
        self.factory = factory  # pickled into the engine process when there is one
        self.queue = QueueLimit(max_queue, shared_queue)  # engine requests not finished
        self.observer = observer
        self.engine_process = engine_process
        # --api-server-count: the pipes (commands, events) to an engine process started by
        # the parent, shared with other servers; this server's groups say whose they are.
        self.engine_pipes = engine_pipes
        self._id_prefix = f"s{server_index}-" if server_index is not None else ""
        self.info: EngineInfo | None = None  # once loaded
        self.state = "created"  # created | loading | ready | rebuilding | dead | stopped
        self.error: str | None = None
        self.snapshot = Snapshot()
        self._adding: dict[str, tuple[RequestGroup, asyncio.Future[None]]] = {}
        self._groups: dict[str, RequestGroup] = {}  # added, with requests unfinished
        self._send: Callable[[Command], None] = lambda command: None
        self._commands: CommandWriter | None = None  # the engine process's pipe, if any
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: threading.Thread | multiprocessing.process.BaseProcess | None = None
        self._next_id = 0
        self._stopping = False  # from stop(): the engine process's exit is expected
        self.on_fatal: Callable[[], None] | None = None  # the engine died for good: exit
        self.fatal = False

    # ---- lifecycle (event loop) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.state = "loading"
        if self.engine_pipes is not None:
            self._attach(*self.engine_pipes, process=None)
            return
        if self.engine_process:
            self._start_process()
            return
        inbox = ThreadInbox()
        self._send = inbox.put
        engine_loop = EngineLoop(self.factory, inbox, lambda events: self._call(events))
        self._worker = threading.Thread(target=engine_loop.run, name="pagedserve-engine",
                                        daemon=True)
        self._worker.start()

    def _start_process(self) -> None:
        context = multiprocessing.get_context("spawn")  # a fork would copy threads and CUDA
        (commands_in, commands_out), (events_in, events_out) = engine_pipes(context)
        process = context.Process(
            target=run_engine_process, name="pagedserve-engine", daemon=True,
            args=(self.factory, [commands_in], [events_out], logging.getLogger().level))
        process.start()
        commands_in.close()
        events_out.close()  # the process's copy is the last: its exit reads as EOF here
        self._worker = process
        self._attach(commands_out, events_in, process)
        end_at_exit(process, self._commands.close_now)

    def _attach(self, commands_out: Any, events_in: Any,
                process: multiprocessing.process.BaseProcess | None) -> None:
        assert self._loop is not None
        self._commands = CommandWriter(self._loop, commands_out)
        self._send = self._commands.send
        # Read on the event loop itself: a reader thread would contend with it for the GIL.
        # The process writes each message whole, so a readable pipe never stalls the loop.
        self._loop.add_reader(events_in.fileno(), self._read_events, events_in, process)

    def _read_events(self, conn: Any,
                     process: multiprocessing.process.BaseProcess | None) -> None:
        try:
            while conn.poll():
                self._apply(conn.recv())
        except (EOFError, OSError):
            assert self._loop is not None
            self._loop.remove_reader(conn.fileno())
            conn.close()
            self._loop.run_in_executor(None, self._process_lost, process)

    def _process_lost(self, process: multiprocessing.process.BaseProcess | None) -> None:
        error = "the engine process exited"
        if process is not None:  # ours: its exit code
            process.join(5)
            error += f" (exit code {process.exitcode})"
        self._call([Died(error, f"The engine failed: {error}.")], lost=True)

    def stop(self, timeout: float = PROCESS_STOP_TIMEOUT_S) -> None:
        """Ask the engine loop to finish (aborting what is left) and wait for it."""
        loading, self._stopping = self.state == "loading", True
        if self._commands is None:
            self._send(Stop())
        else:  # the writer belongs to the event loop (this runs in a thread of its own)
            try:
                self._loop.call_soon_threadsafe(self._commands.close_after, Stop())
            except RuntimeError:  # the loop is closed: a closed pipe reads as Stop too
                self._commands.close_now()
        # A load in progress is not waited for: a thread is left to it (a daemon), a process
        # killed.
        if isinstance(self._worker, threading.Thread):
            if not loading:
                self._worker.join(timeout)
        elif self._worker is not None:
            self._worker.join(0.0 if loading else timeout)
            if self._worker.is_alive():
                self._worker.kill()
        if self.state != "dead":
            self.state = "stopped"
        if self._loop is not None:  # what the loop no longer answers (none, normally)
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(
                    self._fail_all, EngineDeadError("the server is shutting down"))

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    # ---- submitting (event loop) --------------------------------------------------------
    async def submit(self, prompts: list[list[int]], params: SamplingParams,
                     echo_only: bool = False) -> RequestGroup:
        """Queue one engine request per prompt (each with ``params.n`` samples); its outputs
        without their generated tokens where ``echo_only``. Raises InvalidRequest (nothing
        queued), QueueFull, EngineNotReady or EngineDeadError."""
        self._check_alive()
        limit = self.queue.max_queue
        if limit is not None and len(prompts) > limit:
            # A 429 would have clients retry what can never fit.
            raise InvalidRequest(f"The request has {len(prompts)} prompts, more than the "
                                 f"server's --max-queue of {limit}.", "prompt")
        assert self._loop is not None and self.info is not None
        self._next_id += 1
        # A stream's text is decoded here, as its tokens arrive, off the engine's critical
        # path (one engine for every server), unless the engine needs it (stop strings). A
        # final output comes whole: decoded here at once, it would hold the event loop.
        tokenizer, engine_params = None, params
        if params.detokenize and not params.stop \
                and params.output_kind is RequestOutputKind.DELTA:
            tokenizer = self.info.tokenizer
            engine_params = dataclasses.replace(params, detokenize=False)
        group = RequestGroup(self.post_abort, f"{self._id_prefix}r{self._next_id}", prompts, params,
                             tokenizer, echo_only)  # (its outputs may come with its Added)
        self.queue.admit(len(prompts))  # QueueFull
        try:
            self._send(Add(group.group_id, group.request_ids, prompts, engine_params))
        except Exception as e:  # it did not pickle for the engine process: refuse it alone
            self.queue.release(len(prompts))
            log.exception("sending a request to the engine process failed")
            raise RuntimeError(f"sending the request failed: {type(e).__name__}") from None
        future: asyncio.Future[None] = self._loop.create_future()
        self._adding[group.group_id] = (group, future)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            # Its client left: the add's answer has no reader (an error set on the future
            # would be logged as never retrieved, a traceback per disconnect).
            future.cancel()
            group.abort()
            raise
        return group

    def post_abort(self, request_ids: list[str]) -> None:
        self._send(Abort(request_ids))

    def _check_alive(self) -> None:
        if self.state == "dead":
            raise EngineDeadError(f"the engine has died: {self.error}")
        if self.state != "ready":
            raise EngineNotReady({"loading": "the model is still loading",
                                  "rebuilding": "the engine is rebuilding after a failure"}
                                 .get(self.state, "the engine is not running"))

    # ---- the loop's events (event loop) -------------------------------------------------
    def _call(self, events: list[Event], lost: bool = False) -> None:
        assert self._loop is not None
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._apply, events, lost)

    def _apply(self, events: list[Event], lost: bool = False) -> None:
        if lost and (self._stopping or self.state == "dead"):
            return  # the process ended because it was asked to (or had already died)
        for event in events:
            if isinstance(event, Delivered):
                self._deliver(event)
            elif isinstance(event, Snapshot):
                self.snapshot = event
            elif isinstance(event, Added):
                self._added(event)
            elif isinstance(event, Failed):
                error = (EngineDeadError(event.message) if event.shutting_down
                         else StepFailed(event.message))
                self._fail([g for gid in event.group_ids
                            if (g := self._groups.pop(gid, None)) is not None], error)
            elif isinstance(event, Loaded):
                self.info = event.info
                if self.observer is not None:
                    self.observer.on_loaded()
                if self.state == "loading":
                    self.state = "ready"
                    # What is alive now lives as long as the server (the app, the imports,
                    # the tokenizer): out of the collector's sight, as the engine's own heap
                    # is, a full collection on the event loop takes ~1 ms, not ~90.
                    gc.collect()
                    gc.freeze()
            elif isinstance(event, StateChanged):
                if self.state in ("ready", "rebuilding"):
                    self.state = event.state
            elif isinstance(event, Died):
                self._died(event)

    def _deliver(self, event: Delivered) -> None:
        for group_id, index, output in event.items:
            group = self._groups.get(group_id)
            if group is None:
                continue
            # Not sent with a running delta (engine_loop.Delivered): the group has them.
            output.request_id = group.request_ids[index]
            output.prompt_token_ids = group.prompts[index]
            if group.tokenizer is not None:
                try:
                    group.fill_text(index, output)
                except Exception:  # noqa: BLE001 - this group fails; the others' events go on
                    log.exception("decoding a stream's tokens failed")
                    self._drop(group_id, StepFailed("Decoding this request's output failed "
                                                    "(the error is in the server log)."))
                    continue
            if self.observer is not None:
                # A request's first delta with tokens carries its first token's time (a
                # FINAL_ONLY request's only delta is its final one).
                if output.first_token_time is not None and index in group.awaiting_first_token:
                    group.awaiting_first_token.discard(index)
                    self.observer.on_first_token(output)
                if output.finished:
                    self.observer.on_finished(output, group.params.n)
            if output.finished and any(o.finish_reason == "error" for o in output.outputs):
                self._drop(group_id, ConstraintFailed(group.params.structured_outputs.param))
                continue
            if group.echo_only:
                group.hide_generated(output)
            if output.finished and index in group.unfinished:
                group.unfinished.discard(index)
                self.queue.release(1)
                if not group.unfinished:
                    del self._groups[group_id]
            group.queue.put_nowait((index, output))

    def _added(self, event: Added) -> None:
        entry = self._adding.pop(event.group_id, None)
        if entry is None:  # failed meanwhile (stop() or the engine's death got there first)
            return
        group, future = entry
        if event.error is None:
            self._groups[event.group_id] = group
            if self.observer is not None:
                self.observer.on_added(sum(len(p) for p in group.prompts))
            if not future.done():
                future.set_result(None)
            return
        self.queue.release(len(group.prompts))
        group.unfinished.clear()
        if not future.done():
            future.set_exception(event.error)

    def _drop(self, group_id: str, error: RequestFailed) -> None:
        """Fail one group alone, aborting what of it still runs in the engine."""
        group = self._groups.pop(group_id)
        group.abort()
        self._fail([group], error)

    def _fail(self, groups: list[RequestGroup], error: BaseException) -> None:
        for group in groups:
            self.queue.release(len(group.unfinished))
            group.unfinished.clear()
            group.queue.put_nowait(error)

    def _died(self, event: Died) -> None:
        self.state, self.error, self.fatal = "dead", event.error, event.fatal
        self._fail_all(EngineDeadError(event.message))
        if event.fatal and self.on_fatal is not None:
            self.on_fatal()

    def fail_in_flight(self, message: str) -> None:
        """Fail every request not finished (the server is going away; the engine is not)."""
        self._fail_all(EngineDeadError(message))

    def _fail_all(self, error: EngineDeadError) -> None:
        """Every group still waiting to be added, or with requests unfinished."""
        adding, self._adding = self._adding, {}
        for group, future in adding.values():
            self.queue.release(len(group.prompts))
            group.unfinished.clear()
            if not future.done():
                future.set_exception(error)
        groups, self._groups = list(self._groups.values()), {}
        self._fail(groups, error)
