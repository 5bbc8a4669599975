"""The engine: sizes the device, dtype and pool, admits requests, and runs each step as
schedule -> execute -> sample -> postprocess (advance, settle) -> outputs (per-step deltas);
with asynchronous scheduling, the next step is launched between advance and settle."""

import copy
import gc
import logging
import time
import uuid
from collections.abc import Iterable

import torch

from pagedserve.engine import distributed
from pagedserve.engine.config import (
    EngineConfig,
    resolve_config,
    resolve_max_model_len,
    sampling_defaults,
)
from pagedserve.engine.device_setup import (
    keep_freed_memory,
    resolve_device,
    resolve_dtype,
)
from pagedserve.engine.in_flight import InFlightStep, samples_from_history
from pagedserve.engine.kv_pool import (
    check_pool_fits,
    fixed_pool_blocks,
    profiled_model_and_pool,
    profiles_memory,
)
from pagedserve.engine.logits_processors import bad_words_token_ids, thinking_budget_of
from pagedserve.engine.model_runner import (
    ModelRunner,
    build_model,
    prompt_logprob_positions,
    samples,
)
from pagedserve.engine.output_processor import OutputProcessor, RequestState
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.piecewise_graphs import takes_whole_graphs
from pagedserve.engine.sampler import prompt_token_logprobs, sample
from pagedserve.engine.step_inputs import on_device
from pagedserve.kernels import KernelSet, kernels_for
from pagedserve.models.loader import LoadedModel, load_model_files, read_model_config
from pagedserve.models.parallel import TensorParallel
from pagedserve.models.reasoning import ReasoningParser
from pagedserve.paging import BlockManager
from pagedserve.scheduler import (
    BadWords,
    Guide,
    InvalidRequest,
    SamplingParams,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    Sequence,
)
from pagedserve.structured import GrammarCompiler

log = logging.getLogger("pagedserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 kernels: KernelSet | None = None):
        config = config or EngineConfig()
        device = resolve_device(config.device)
        config = self.config = resolve_config(config, device)
        dtype = resolve_dtype(config.dtype, device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.seed is not None:  # the default streams that unseeded requests draw from
            torch.manual_seed(config.seed)
        if device.type == "cpu":
            keep_freed_memory()
        if device.type == "cuda" and device.index is not None:
            # Events, streams and Triton launches use the current device, not the tensors'.
            torch.cuda.set_device(device)
        self.group: distributed.Group | None = None
        try:
            self._init(config, loaded, kernels, device, dtype)
        except BaseException:
            if self.group is not None:  # the other ranks may wait mid-start-up: stop them
                self.group.failed = self.group.failed or "the engine failed to start"
                self.group.close()
            raise

    def _init(self, config: EngineConfig, loaded: LoadedModel | None,
              kernels: KernelSet | None, device: torch.device, dtype: torch.dtype) -> None:
        tp = TensorParallel()
        if config.tensor_parallel_size > 1:
            # Refused before any worker starts (the config alone is read: no weight).
            mcfg = loaded.config if loaded is not None else read_model_config(config.model)
            TensorParallel(0, config.tensor_parallel_size).check(mcfg)
            self.group = distributed.start(config.tensor_parallel_size,
                                           distributed.WorkerSpec.of(config, device, dtype))
            tp, device = self.group.tp, self.group.device
        loaded = loaded.sharded(tp) if loaded else load_model_files(config.model, dtype, tp)
        self.dtype = dtype
        self.tokenizer = loaded.tokenizer
        if config.chat_template is not None:  # on a copy: a loaded model may be shared
            self.tokenizer = copy.copy(self.tokenizer)
            self.tokenizer.set_chat_template(config.chat_template)  # ValueError if it is bad
        self.sampling_defaults = sampling_defaults(config, loaded.sampling_defaults)
        self.model_name = loaded.name
        mcfg = loaded.config
        self.vocab_size = mcfg.vocab_size  # the model's (token ids below it are valid)
        # Compiled grammars cached by key, filled by the compile threads (thread-safe).
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.reasoning = ReasoningParser.load(config.reasoning_parser, self.tokenizer) \
            if config.reasoning_parser else None  # (ValueError without the think tokens)

        # Under tensor parallelism a rank's pool holds only its KV heads: more blocks fit.
        kv_heads = len(tp.kv_heads(mcfg))
        block_bytes = config.block_size * mcfg.kv_bytes_per_token(dtype.itemsize) \
            * kv_heads // mcfg.num_kv_heads
        kernels = kernels or kernels_for(device, dtype, config.native_kernels,
                                         config.triton_attention)
        model = None
        if profiles_memory(config, device):  # the model first: the pool is what it leaves
            model, num_blocks = profiled_model_and_pool(loaded, kernels, config, dtype,
                                                        block_bytes, device, tp)
        else:
            num_blocks = fixed_pool_blocks(config, block_bytes)
        self.max_model_len = resolve_max_model_len(
            config.max_model_len or None, mcfg.max_position_embeddings,
            num_blocks * config.block_size)
        if self.group is not None:  # the other ranks size their pools and RoPE by rank 0
            self.group.share_ints([num_blocks, self.max_model_len], 2)
        self.model = model if model is not None else build_model(
            loaded, kernels, self.max_model_len, dtype, device, tp)
        self.kernels, self.device, self.num_blocks = kernels, device, num_blocks
        check_pool_fits(num_blocks, block_bytes, device)
        self._build_state()
        if self.group is not None:
            self.group.barrier()  # every rank has its weights and KV pool
        if device.type == "cuda":  # Triton's kernel builds, before any request waits on them
            self.runner.warm_up(config.max_num_batched_tokens, self.max_model_len)
        # The weights, tokenizer and loader leave millions of long-lived objects; move them
        # out of the collector's sight so that a step's garbage collections stay short.
        gc.collect()
        gc.freeze()

    def _build_state(self, stats: SchedulerStats | None = None, num_output_tokens: int = 0
                     ) -> None:
        """The block pool, scheduler, KV cache and request state around the loaded weights
        (at start, and again by reset(), which carries the counters over so that they stay
        monotonic for Prometheus)."""
        config = self.config
        self.runner = None  # let an old KV cache go before a new one is allocated
        self.block_manager = BlockManager(
            self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            ),
            self.block_manager,
        )
        if stats is not None:
            self.scheduler.stats = stats
        # Graphs replay one process's kernels: not under tensor parallelism, whose steps
        # also broadcast their inputs and all-reduce (a captured collective is another matter).
        eager = (self.device.type != "cuda" if config.enforce_eager is None
                 else config.enforce_eager)
        graphs = None if eager or self.group is not None else (
            config.max_num_seqs, self.max_model_len)
        pieces = config.max_num_batched_tokens if graphs and config.piecewise_graphs else None
        if config.piecewise_graphs and not graphs:
            log.warning("piecewise graphs: unused, since CUDA graphs are off "
                        "(--enforce-eager, a CPU by default, or tensor parallelism)")
        self.async_scheduling = config.async_scheduling and self.group is None
        if config.async_scheduling and self.group is not None:
            log.warning("async scheduling: unused under tensor parallelism (the other ranks "
                        "receive input ids from the host)")
        whole = bool(config.full_graphs and pieces
                     and takes_whole_graphs(self.kernels, self.device))
        if config.full_graphs and not whole:
            log.warning("full graphs: unused; they need piecewise graphs on and the flash "
                        "kernels (%s here)", self.kernels.name)
        self.runner = ModelRunner(
            self.model, self.kernels, self.num_blocks, config.block_size, self.dtype,
            self.device, self.group, graphs, pieces, whole)
        self.outputs = OutputProcessor(self.tokenizer, self.device, config.stream_interval)
        self.outputs.num_output_tokens = num_output_tokens
        self._step_requests: set[str] | None = None  # the running step's, for recovery
        self._in_flight: InFlightStep | None = None  # launched, its tokens not yet read

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank); idempotent."""
        if self.group is not None:
            self.group.close()

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises InvalidRequest (nothing queued) for bad input. ``params``
        is used as given, not copied (a request's prompts share it): set a field to change
        it between adds, which checks it anew, rather than change a list in place."""
        params = params or SamplingParams()
        params.validate(vocab_size=self.vocab_size)
        if isinstance(prompt, str):
            try:
                text, token_ids = prompt, self.tokenizer.encode(prompt)
            except ValueError as e:  # text that cannot be tokenized
                raise InvalidRequest(f"The prompt: {e}.", "prompt") from None
        else:
            text, token_ids = None, list(prompt)
        self._validate_prompt(token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.outputs.requests:
            raise InvalidRequest(f"request id {request_id!r} is already running", "request_id")
        bad_words = params.memo("bad words", lambda: BadWords.of(
            bad_words_token_ids(params.bad_words, self.tokenizer)))
        guide: Guide | None = None
        budget = thinking_budget_of(params, self.reasoning)  # (InvalidRequest: no parser)
        if params.structured_outputs is not None:  # (InvalidRequest if it is bad)
            waits = self.reasoning is not None and self.reasoning.grammar_waits(
                token_ids, params.reasoning_ended)
            guide = self.grammars.guide(params.structured_outputs,
                                        self.reasoning.end_id if waits else None)
            budget = budget if waits else None  # it takes the first token: nothing to end
        request = RequestState(request_id, text, token_ids, params, time.monotonic())
        seqs = [Sequence(request_id, list(token_ids), params, request.arrival_time,
                         num_forks_pending=params.n - 1, guide=guide, bad_words=bad_words,
                         thinking_budget=budget,
                         # (as vLLM's fcfs queue, taken and unused without the policy)
                         priority=params.priority if self.config.scheduling_policy
                         == "priority" else 0)]
        self.outputs.add_request(request, seqs)  # first: what it refuses is never scheduled
        try:
            self.scheduler.add(seqs[0])
        except BaseException:
            self.outputs.drop(request_id)
            raise
        return request_id

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequest("The prompt must not be empty.", "prompt")
        # The length first: it is O(1), and refuses a huge prompt before any scan of it.
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise InvalidRequest(f"This model's maximum context length is {limit} tokens, and "
                                 f"the prompt has {n}: no room is left for a completion.",
                                 "prompt", "context_length_exceeded")
        # A max_tokens past the room the prompt leaves is not refused: the sample ends at
        # the context's end, "length" (vLLM's; the scheduler's length check).
        if params.min_tokens > limit - n:  # (a promise the context cannot keep)
            raise InvalidRequest(f"min_tokens {params.min_tokens} is more than the {limit - n} "
                                 "tokens the context leaves after the prompt.", "min_tokens")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequest(f"Prompt token ids must be in [0, {vocab}).", "prompt")
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequest("logprobs exceeds the vocabulary size.", "logprobs")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Free the requests' blocks now (one or many, as vLLM's); their final outputs come
        from the next step()."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [i for i in ids if i in self.outputs.requests]
        for request_id in ids:
            self.outputs.abort(request_id)
        if ids:
            self.scheduler.abort(ids)

    def has_unfinished_requests(self) -> bool:
        """Requests not yet finished, or a step still in flight (its tokens unread)."""
        return bool(self.outputs.requests) or self._in_flight is not None

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over a scheduled batch; the deltas of the requests that changed.
        Under asynchronous scheduling the forward is launched before the previous step's
        tokens are read back, and those are settled while it runs (docs/design.md §8).
        If it raises, fail_step() drops the requests of that batch (and of the step still in
        flight) and keeps the rest."""
        previous, self._in_flight = self._in_flight, None
        in_flight_requests: set[str] = set()
        if previous is not None:
            self._step_requests = in_flight_requests = previous.request_ids
            self.scheduler.advance(previous.batch)
        self._step_requests = None  # a failure inside schedule() leaves the pool suspect
        batch = self.scheduler.schedule()
        self._step_requests = {seq.request_id for seq in batch.seqs} | in_flight_requests
        launched = None
        if batch.seqs:
            self.outputs.on_scheduled(batch.seqs, time.monotonic())
            carried = previous.carried_into(batch) if previous is not None else None
            logits = self.runner.execute(batch, carried)
            if previous is not None and samples_from_history(batch):
                self._settle(previous)  # on a GPU, while the forward just launched runs
                previous = None
            launched = self._launch_sampling(batch, logits, previous)
        if previous is not None:  # on a GPU, while the forward just launched runs
            self._settle(previous)
        if launched is not None and self.async_scheduling:
            self._in_flight = launched
        elif launched is not None:
            self.scheduler.advance(batch)
            self._settle(launched)
        self._step_requests = set()
        return self.outputs.take_outputs()

    def _launch_sampling(self, batch: ScheduledBatch, logits: torch.Tensor,
                         previous: InFlightStep | None) -> InFlightStep:
        # Only sequences whose whole input is now computed sample a token (a prompt chunk
        # samples nothing, so each random stream advances once per emitted token); the
        # runner returned one logits row for each of them, in batch order.
        completing = [s for s in batch.seqs if samples(s)]
        prompt_rows = len(logits) > len(completing)  # prompt logprobs' rows follow theirs
        if prompt_rows:
            self._record_prompt_logprobs(batch, logits[len(completing):])
        forks = self.scheduler.fork(batch)
        if forks or prompt_rows:
            row_of = {s.seq_id: i for i, s in enumerate(completing)}
            for child, parent in forks:  # a forked sample starts from its parent's logits
                row_of[child.seq_id] = row_of[parent.seq_id]
                self.outputs.add_sample(child)
            completing = [s for s in batch.seqs if samples(s)]
            logits = logits[on_device([row_of[s.seq_id] for s in completing], logits.device,
                                      torch.long)]
        pending = previous.pending_tokens(completing) if previous is not None else None
        sampled = sample(logits, completing, self.outputs.generators(completing),
                         self.scheduler.config.eos_token_ids, self.runner.kernels.argmax_rows,
                         pending)
        return InFlightStep(batch, sampled)

    def _settle(self, step: InFlightStep) -> None:
        """Read a step's tokens back and append them (after scheduler.advance())."""
        tokens, logprobs = step.sampled.to_host()
        now = time.monotonic()
        self.scheduler.settle(
            step.sampled.rows, tokens,
            on_append=lambda seq, i: self.outputs.on_token(seq, logprobs[i], now))

    def _record_prompt_logprobs(self, batch: ScheduledBatch, rows: torch.Tensor) -> None:
        """The rows after the sampling ones: prompt positions (prompt_logprob_positions)."""
        start = 0
        for seq in batch.seqs:
            positions = prompt_logprob_positions(seq)
            if not positions:
                continue
            targets = seq.token_ids[positions.start + 1 : positions.stop + 1]
            self.outputs.on_prompt_logprobs(seq, prompt_token_logprobs(
                rows[start : start + len(positions)], targets, seq.params.prompt_logprobs))
            seq.prompt_logprobs_done, start = positions.stop, start + len(positions)

    # ---- fault barrier ------------------------------------------------------------------
    def fail_step(self) -> tuple[list[str], bool]:
        """After step() raised: drop the requests of the failed step, freeing their blocks,
        and check the block pool against the surviving sequences. Returns the dropped ids
        (they produce no more outputs) and whether the pool is sound; when it is not (or
        the failure hit scheduling itself), the caller must reset()."""
        failed = self._step_requests
        self._step_requests = set()
        if self.device.type == "cuda":  # the failed step's copies may still read buffers
            torch.cuda.synchronize(self.device)  # that the next step would refill
        if failed is None:
            return [], False
        self.scheduler.abort(failed)
        for request_id in failed:
            self.outputs.drop(request_id)
        live = self.scheduler.running + self.scheduler.waiting
        return sorted(failed), self.block_manager.consistent_with(
            [seq.block_table for seq in live])

    def reset(self) -> list[str]:
        """Rebuild the block pool, scheduler and KV cache around the loaded weights, dropping
        every request; returns their ids."""
        dropped = sorted(self.outputs.requests)
        self._build_state(self.scheduler.stats, self.outputs.num_output_tokens)
        return dropped

    # ---- stats --------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters since start (monotonic, also across reset()) and the current gauges."""
        s, blocks = self.scheduler.stats, self.block_manager
        return {
            "prefill_tokens_computed": s.prefill_tokens_computed,
            "prefix_cache_queried_tokens": s.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "peak_kv_blocks_used": s.peak_kv_blocks_used,
            "num_kv_blocks": blocks.num_blocks,
            "block_size": blocks.block_size,
            "preemptions": s.preemptions,
            "steps": s.steps,
            "output_tokens": self.outputs.num_output_tokens,
            "num_requests_running": len({q.request_id for q in self.scheduler.running}),
            "num_requests_waiting": len({q.request_id for q in self.scheduler.waiting}),
            "kv_blocks_used": blocks.num_used_blocks,
            "kv_blocks_shared": blocks.num_shared_blocks,
        }

