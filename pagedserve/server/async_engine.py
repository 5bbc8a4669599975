"""The engine loop, off the event loop.

LLMEngine is single-threaded and not thread-safe, so exactly one thread (the loop thread)
builds it and calls its methods. The asyncio side posts ``add`` and ``abort`` commands into a
list guarded by a condition variable; the loop thread applies them between steps, runs
``step()`` while anything is unfinished, and hands each output back to the event loop with
``loop.call_soon_threadsafe`` into the asyncio queue of the request group it belongs to. When
there is nothing to do the thread sleeps on the condition (no busy spin).

A fault barrier surrounds ``step()``: if it raises, only the requests of that step fail (their
groups receive a StepFailed, their blocks are freed) and the loop goes on. If the block pool
no longer agrees with the surviving sequences, the engine rebuilds its pool, scheduler and KV
cache from the loaded weights (``/health`` says 503 meanwhile) and every in-flight request
fails. Only when loading or that rebuild raises is the engine dead: in-flight groups receive
an EngineDeadError, new submissions are refused, and ``/health`` stays 503. A tensor-parallel
rank that dies or hangs (RankFailed) leaves the ranks out of step: nothing is rebuilt, the
engine is dead at once and ``on_fatal`` tells the server to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedserve.engine import InvalidRequest, LLMEngine, RequestOutput, SamplingParams
from pagedserve.engine.distributed import RankFailed

log = logging.getLogger("pagedserve.server")


class RequestFailed(RuntimeError):
    """The engine could not finish the request (a 500-type error for the client)."""


class StepFailed(RequestFailed):
    """The engine step that ran this request raised; the engine itself goes on."""


class EngineDeadError(RequestFailed):
    """Loading or rebuilding the engine failed; nothing more can run."""


class EngineNotReady(RuntimeError):
    """The model is still loading."""


class QueueFull(RuntimeError):
    """More unfinished requests than --max-queue allows."""


@dataclass(frozen=True)
class Snapshot:
    """Engine state the loop thread publishes after every iteration (read by /metrics)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_shared: int = 0
    stats: dict[str, int] = field(default_factory=dict)


class Observer(Protocol):
    """Called from the loop thread (metrics)."""

    def on_added(self, num_prompt_tokens: int) -> None: ...

    def on_finished(self, output: RequestOutput) -> None: ...


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt), read as one stream of
    ``(prompt_index, delta)`` (in batches), each delta a step's new tokens of one request."""

    def __init__(self, owner: AsyncEngine, group_id: str, prompts: list[list[int]],
                 params: SamplingParams):
        self.owner = owner
        self.request_ids = [f"{group_id}-{i}" for i in range(len(prompts))]
        self.prompts = prompts
        self.params = params
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.unfinished = set(range(len(prompts)))  # updated on the event loop

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
        if self.unfinished:
            self.owner.post_abort([self.request_ids[i] for i in self.unfinished])


@dataclass
class _Add:
    group: RequestGroup
    future: asyncio.Future[None]


class AsyncEngine:
    def __init__(
        self,
        factory: Callable[[], LLMEngine],
        max_queue: int | None = None,
        observer: Observer | None = None,
    ):
        self.factory = factory
        self.max_queue = max_queue
        self.observer = observer
        self.llm_engine: LLMEngine | None = None  # once loaded; the HTTP side reads attributes only
        self.state = "created"  # created | loading | ready | rebuilding | dead | stopped
        self.error: str | None = None
        self.snapshot = Snapshot()
        self.num_unfinished = 0  # engine requests submitted and not finished (event loop)
        self._cond = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self.on_fatal: Callable[[], None] | None = None  # the engine died for good: exit
        self.fatal = False

    # ---- lifecycle (event loop) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.state = "loading"
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the loop thread to finish (aborting what is left) and wait for it."""
        with self._cond:
            self._stop = True
            self._cond.notify()
            loading = self.state == "loading"
        if self._thread is not None and not loading:  # a load in progress is not waited for
            self._thread.join(timeout)
        if self.state != "dead":
            self.state = "stopped"

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    # ---- submitting (event loop) --------------------------------------------------------
    async def submit(self, prompts: list[list[int]], params: SamplingParams,
                     group_id: str | None = None) -> RequestGroup:
        """Queue one engine request per prompt (each with ``params.n`` samples). Raises
        InvalidRequest (nothing queued), QueueFull, EngineNotReady or EngineDeadError."""
        self._check_alive()
        if self.max_queue is not None and len(prompts) > self.max_queue:
            # A 429 would have clients retry what can never fit.
            raise InvalidRequest(f"The request has {len(prompts)} prompts, more than the "
                                 f"server's --max-queue of {self.max_queue}.", "prompt")
        if self.max_queue is not None and self.num_unfinished + len(prompts) > self.max_queue:
            raise QueueFull(f"{self.num_unfinished} requests are unfinished "
                            f"(--max-queue {self.max_queue}); retry later")
        assert self._loop is not None
        self._next_id += 1
        group = RequestGroup(self, group_id or f"r{self._next_id}", prompts, params)
        future: asyncio.Future[None] = self._loop.create_future()
        self.num_unfinished += len(prompts)
        with self._cond:
            if self.state != "ready":
                self.num_unfinished -= len(prompts)
                self._check_alive()
            self._adds.append(_Add(group, future))
            self._cond.notify()
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            group.abort()
            raise
        return group

    def post_abort(self, request_ids: list[str]) -> None:
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()

    def _check_alive(self) -> None:
        if self.state == "dead":
            raise EngineDeadError(f"the engine has died: {self.error}")
        if self.state != "ready":
            raise EngineNotReady({"loading": "the model is still loading",
                                  "rebuilding": "the engine is rebuilding after a failure"}
                                 .get(self.state, "the engine is not running"))

    # ---- delivering (event loop, scheduled from the loop thread) ------------------------
    def _deliver(self, items: list[tuple[RequestGroup, int, RequestOutput]]) -> None:
        for group, index, output in items:
            if output.finished and index in group.unfinished:
                group.unfinished.discard(index)
                self.num_unfinished -= 1
            group.queue.put_nowait((index, output))

    def _resolve(self, add: _Add, error: BaseException | None) -> None:
        if error is not None:
            self.num_unfinished -= len(add.group.prompts)
            add.group.unfinished.clear()
        if add.future.done():
            return
        if error is None:
            add.future.set_result(None)
        else:
            add.future.set_exception(error)

    def _fail(self, groups: list[RequestGroup], error: BaseException) -> None:
        for group in groups:
            self.num_unfinished -= len(group.unfinished)
            group.unfinished.clear()
            group.queue.put_nowait(error)

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    # ---- the loop thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self.factory()
        except BaseException as e:  # noqa: BLE001 - reported through /health
            log.exception("loading the model failed")
            self.error = f"loading the model failed: {e}"
            self._die(EngineDeadError(self.error), {})
            return
        self.llm_engine = engine
        self._publish(engine)
        with self._cond:
            if self._stop:
                return
            self.state = "ready"
        log.info("engine ready: %s (max_model_len %d)", engine.model_name, engine.max_model_len)
        live: dict[str, tuple[RequestGroup, int]] = {}
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stop
                           or engine.has_unfinished_requests()):
                    self._cond.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                stop = self._stop
            for add in adds:
                self._apply_add(engine, add, live)
            for request_id in aborts:
                if request_id in live:
                    engine.abort_request(request_id)
            if stop:
                for request_id in live:
                    engine.abort_request(request_id)
                gone = EngineDeadError("the server is shutting down")
                self._call(self._fail, _groups(live), gone)
                self._publish(engine)
                engine.close()
                return
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except RankFailed as e:
                    self._rank_failed(engine, live, e)
                    return
                except Exception:  # noqa: BLE001 - the fault barrier: fail this step only
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    if not self._recover(engine, live):
                        return
                    continue
                self._dispatch(outputs, live)
            self._publish(engine)

    def _recover(self, engine: LLMEngine, live: dict[str, tuple[RequestGroup, int]]) -> bool:
        """Fail the groups of the failed step's requests (aborting their other requests),
        rebuilding the engine first if its pool is unsound; False if the engine is dead."""
        try:
            failed, sound = engine.fail_step()
            if not sound:
                log.error("the block pool is inconsistent after the failure; rebuilding")
                self.state = "rebuilding"
                failed += engine.reset()
                self.state = "ready"
        except Exception as e:  # noqa: BLE001 - nothing left to fall back on
            log.exception("recovering from a failed step failed")
            self.error = f"{type(e).__name__}: {e}"
            self._die(EngineDeadError(f"the engine failed: {self.error}"), live)
            return False
        groups = _groups({rid: live[rid] for rid in failed if rid in live})
        for group in groups:
            for request_id in group.request_ids:
                if live.pop(request_id, None) is not None:
                    engine.abort_request(request_id)  # siblings of a failed request
        error = StepFailed("The engine step running this request failed (the error is in "
                           "the server log); other requests are unaffected.")
        self._call(self._fail, groups, error)
        self._publish(engine)
        return True

    def _rank_failed(self, engine: LLMEngine, live: dict[str, tuple[RequestGroup, int]],
                     error: RankFailed) -> None:
        log.critical("%s; the engine is dead and the server exits", error)
        self.error = "a tensor-parallel rank failed or timed out"
        self.fatal = True
        self._die(EngineDeadError(f"The engine failed: {self.error} (details in the server "
                                  "log); the server is shutting down."), live)
        engine.close()  # the surviving ranks are stuck in a collective: stop them
        if self.on_fatal is not None:
            self.on_fatal()

    def _apply_add(self, engine: LLMEngine, add: _Add,
                   live: dict[str, tuple[RequestGroup, int]]) -> None:
        group = add.group
        added: list[str] = []
        try:
            for i, (request_id, prompt) in enumerate(
                    zip(group.request_ids, group.prompts, strict=True)):
                engine.add_request(prompt, dataclasses.replace(group.params), request_id)
                added.append(request_id)
                live[request_id] = (group, i)
        except Exception as e:  # noqa: BLE001 - InvalidRequest, or anything add_request raised
            for request_id in added:  # all or nothing: its final output is dropped
                engine.abort_request(request_id)
                live.pop(request_id, None)
            self._call(self._resolve, add, e)
            return
        if self.observer is not None:
            self.observer.on_added(sum(len(p) for p in group.prompts))
        self._call(self._resolve, add, None)

    def _dispatch(self, outputs: list[RequestOutput],
                  live: dict[str, tuple[RequestGroup, int]]) -> None:
        items = []
        for out in outputs:
            entry = live.pop(out.request_id, None) if out.finished else live.get(out.request_id)
            if out.finished and self.observer is not None:
                self.observer.on_finished(out)
            if entry is not None:
                items.append((entry[0], entry[1], out))
        if items:
            self._call(self._deliver, items)

    def _die(self, error: EngineDeadError, live: dict[str, tuple[RequestGroup, int]]) -> None:
        with self._cond:
            self.state = "dead"
            adds, self._adds = self._adds, []
        for add in adds:
            self._call(self._resolve, add, error)
        self._call(self._fail, _groups(live), error)

    def _publish(self, engine: LLMEngine) -> None:
        stats = engine.stats()
        self.snapshot = Snapshot(
            running=stats["num_requests_running"],
            waiting=stats["num_requests_waiting"],
            kv_blocks_used=stats["kv_blocks_used"],
            kv_blocks_total=stats["num_kv_blocks"],
            kv_blocks_shared=stats["kv_blocks_shared"],
            stats=stats,
        )


def _groups(live: dict[str, tuple[RequestGroup, int]]) -> list[RequestGroup]:
    return list({id(g): g for g, _ in live.values()}.values())
