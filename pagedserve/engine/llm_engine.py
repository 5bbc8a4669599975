"""The engine loop: add requests, step (schedule -> forward -> sample -> postprocess),
stream outputs back."""

import ctypes
import gc
import time
import uuid
from dataclasses import dataclass, field

import torch

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.sampler import SampleRequest, TokenLogprob, make_generator, sample
from pagedserve.kernels import KernelSet, kernels_for
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loader import LoadedModel, load_model_files
from pagedserve.paging import BlockManager
from pagedserve.scheduler import (
    InvalidRequest,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None: the embedded SmolLM2
    dtype: str = "auto"  # auto: bfloat16 where the device has fast bf16 matmul, else float32
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gib
    kv_cache_memory_gib: float = 2.0
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    enable_prefix_caching: bool = True
    device: str = "auto"
    num_threads: int | None = None  # CPU intra-op threads; None: PyTorch's default
    native_kernels: bool = True  # CPU: the C++ kernels (built on first use); False: PyTorch


@dataclass
class _Sample:
    seq: Sequence
    generator: torch.Generator
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[_Sample] = field(default_factory=list)
    num_cached_tokens: int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    aborted: bool = False


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        kernels: KernelSet | None = None,
    ):
        self.config = config = config or EngineConfig()
        if config.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if device.type == "cpu":
            _keep_freed_memory()
        loaded = loaded or load_model_files(config.model, dtype)
        self.dtype = dtype
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        mcfg = loaded.config

        block_bytes = config.block_size * mcfg.kv_bytes_per_token(dtype.itemsize)
        num_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gib * 2**30 // block_bytes)
        self.max_model_len = min(
            config.max_model_len or mcfg.max_position_embeddings,
            mcfg.max_position_embeddings,
            num_blocks * config.block_size,
        )
        kernels = kernels or kernels_for(device, dtype, config.native_kernels)
        self.model = _build_model(loaded, kernels, self.max_model_len, dtype, device)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            self.model, kernels, num_blocks, config.block_size, dtype, device)
        self.requests: dict[str, _Request] = {}
        self.output_tokens = 0
        # The weights, tokenizer and loader leave millions of long-lived objects; move them
        # out of the collector's sight so that a step's garbage collections stay short.
        gc.collect()
        gc.freeze()

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises InvalidRequest (nothing queued) for bad input."""
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self._validate_prompt(token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already running", "request_id")
        request = _Request(request_id, text, token_ids, params, time.monotonic())
        if params.max_tokens == 0:  # nothing to generate: finished on arrival
            request.samples = [self._new_sample(Sequence(request_id, list(token_ids), params,
                                                         request.arrival_time, sample_index=i))
                               for i in range(params.n)]
            for s in request.samples:
                s.seq.finish_reason = "length"
            self.requests[request_id] = request
            return request_id
        seq = Sequence(request_id, list(token_ids), params, request.arrival_time,
                       num_forks_pending=params.n - 1)
        self.scheduler.add(seq)
        request.samples.append(self._new_sample(seq))
        self.requests[request_id] = request
        return request_id

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequest("The prompt must not be empty.", "prompt")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequest(f"Prompt token ids must be in [0, {vocab}).", "prompt")
        wanted = len(token_ids) + (params.max_tokens or 0)
        if len(token_ids) >= self.max_model_len or wanted > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {wanted} tokens ({len(token_ids)} in the prompt, "
                f"{params.max_tokens or 0} for the completion).", "max_tokens")
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequest("logprobs exceeds the vocabulary size.", "logprobs")

    def _new_sample(self, seq: Sequence) -> _Sample:
        p = seq.params
        return _Sample(
            seq=seq,
            generator=make_generator(p.seed, seq.sample_index),
            detok=IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens),
            logprobs=[] if p.logprobs is not None else None,
        )

    def abort_request(self, request_id: str) -> None:
        """Free the request's blocks now; its final output comes from the next step()."""
        if request_id in self.requests:
            self.requests[request_id].aborted = True
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over a scheduled batch; outputs of the requests it advanced."""
        touched = {rid for rid, r in self.requests.items() if _done(r)}
        batch = self.scheduler.schedule()
        now = time.monotonic()
        if batch.seqs:
            for seq in batch.seqs:
                request = self.requests[seq.request_id]
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = seq.num_cached_tokens
                    request.first_scheduled_time = now
            self._forward(batch)
            touched |= {seq.request_id for seq in batch.seqs}
        outputs = [self._output(self.requests[rid]) for rid in touched]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _forward(self, batch) -> None:
        logits = self.runner.execute(batch)
        row_of = {seq.seq_id: i for i, seq in enumerate(batch.seqs)}
        for child, parent in self.scheduler.fork(batch):
            row_of[child.seq_id] = row_of[parent.seq_id]
            self.requests[child.request_id].samples.append(self._new_sample(child))
        samples = self._samples_of(batch.seqs)
        # Only sequences whose whole input is now computed sample a token: a prompt chunk
        # samples nothing, so each random stream advances once per emitted token.
        completing = [s for s in batch.seqs
                      if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens]
        rows = [
            SampleRequest(
                params=s.params,
                generator=samples[s.seq_id].generator,
                token_ids=s.token_ids,
                num_prompt_tokens=s.num_prompt_tokens,
                eos_token_ids=self.scheduler.config.eos_token_ids,
            )
            for s in completing
        ]
        picked = [row_of[s.seq_id] for s in completing]
        if picked != list(range(len(logits))):  # the usual decode step keeps every row
            logits = logits[picked]
        tokens, logprobs = sample(logits, rows, self.runner.kernels.argmax_rows)
        token_of = {s.seq_id: t for s, t in zip(completing, tokens, strict=True)}
        self.scheduler.postprocess(batch, [token_of.get(s.seq_id, -1) for s in batch.seqs])
        now = time.monotonic()
        for seq, lp in zip(completing, logprobs, strict=True):
            sample_state = samples[seq.seq_id]
            request = self.requests[seq.request_id]
            request.first_token_time = request.first_token_time or now
            self.output_tokens += 1
            if sample_state.logprobs is not None and lp is not None:
                sample_state.logprobs.append(lp)
            if sample_state.detok.add(seq.output_token_ids) is not None:
                if seq.is_finished:  # its last token also hit max_tokens: a stop it is
                    seq.finish_reason = "stop"
                self.scheduler.finish(seq, "stop")
        for request_id in {s.request_id for s in completing}:
            self.requests[request_id].token_times.append(now)

    def _samples_of(self, seqs: list[Sequence]) -> dict[int, _Sample]:
        requests = {s.request_id for s in seqs}
        return {s.seq.seq_id: s for rid in requests for s in self.requests[rid].samples}

    def _output(self, r: _Request) -> RequestOutput:
        finished = _done(r)
        outs = []
        for s in sorted(r.samples, key=lambda s: s.seq.sample_index):
            outs.append(CompletionOutput(
                index=s.seq.sample_index,
                text=s.detok.visible_text(s.seq.finish_reason is not None),
                token_ids=s.seq.output_token_ids,
                finish_reason=s.seq.finish_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
            ))
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=r.num_cached_tokens or 0,
            arrival_time=r.arrival_time,
            first_scheduled_time=r.first_scheduled_time,
            first_token_time=r.first_token_time,
            finished_time=time.monotonic() if finished else None,
            token_times=list(r.token_times),
        )

    # ---- stats --------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        s = self.scheduler.stats
        return {
            "prefill_tokens_computed": s.prefill_tokens_computed,
            "prefix_cache_queried_tokens": s.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "peak_kv_blocks_used": s.peak_kv_blocks_used,
            "num_kv_blocks": self.block_manager.num_blocks,
            "block_size": self.block_manager.block_size,
            "preemptions": s.preemptions,
            "output_tokens": self.output_tokens,
        }


def _keep_freed_memory() -> None:
    """Make glibc reuse freed buffers of up to 32 MiB instead of unmapping them: each step
    allocates many same-sized multi-MB tensors (gathered K/V, activations, logits), and a
    fresh mapping costs a page fault per 4 KiB on first touch (2-3x slower attention)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        fast_bf16 = device.type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if fast_bf16 else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto or one of {list(DTYPES)}")
    return DTYPES[name]


def _done(r: _Request) -> bool:
    """Finished once every one of its n samples exists and has a finish reason."""
    if r.aborted:
        return True
    return len(r.samples) == r.params.n and all(s.seq.finish_reason for s in r.samples)


def _build_model(
    loaded: LoadedModel, kernels: KernelSet, max_len: int, dtype: torch.dtype,
    device: torch.device,
) -> LlamaForCausalLM:
    with torch.device("meta"):  # no random init: every weight comes from the checkpoint
        model = LlamaForCausalLM(loaded.config, kernels, max_len)
    model = model.to_empty(device=device).to(dtype)
    model.rope.compute_tables()  # fp32 again: to_empty() left them unset, .to(dtype) rounded
    model.load_weights({k: v.to(device) for k, v in loaded.weights.items()})
    if device.type == "cpu" and dtype == torch.bfloat16:
        model.pack_for_cpu()
    return model.eval()
