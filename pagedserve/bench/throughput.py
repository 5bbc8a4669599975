"""`pagedserve bench throughput`: a fixed offline workload through LLMEngine in-process,
optionally against HF transformers on the same weights, with a matmul roofline.

Every run: build the engine, warm it up with one 8-token request (shorter than a block, so
it registers nothing in the prefix cache), then add every request at once and step until
all finish. wall_s covers add_request to the last output. Engine counters are reported as
deltas over the timed part (peak KV blocks is the engine's peak, warm-up included).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from pagedserve.bench import report
from pagedserve.bench.hf_baseline import hf_model_from_loaded, run_hf_baseline
from pagedserve.bench.machine import machine_facts
from pagedserve.bench.roofline import EngineFlopCounter, probe_peak, roofline
from pagedserve.bench.stats import ratio, summarize
from pagedserve.bench.workloads import SPECS, WORKLOADS, BenchRequest, build_workload
from pagedserve.engine import (
    EngineConfig,
    LLMEngine,
    OutputCollector,
    RequestOutputKind,
    SamplingParams,
)
from pagedserve.engine.args import engine_config
from pagedserve.engine.config import resolve_config
from pagedserve.engine.device_setup import resolve_device, resolve_dtype
from pagedserve.kernels.triton import recording_builds
from pagedserve.models.loader import LoadedModel, load_model_files

_COUNTERS = ("prefill_tokens_computed", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
             "preemptions", "output_tokens", "steps")


def _params(r: BenchRequest) -> SamplingParams:
    # Final outputs only, as LLM.generate (and vLLM's offline benchmark) asks for them.
    return SamplingParams(n=r.n, max_tokens=r.output_len, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def run_engine(loaded: LoadedModel, config: EngineConfig, request_sets: list[list[BenchRequest]],
               label: str, peak_gflops: float) -> dict[str, Any]:
    """The timed part once a request set on one engine, in turn; the result is the median
    set's (by output tok/s), with every set's figure in ``repeats``. Each set has prompts
    of its own: a repeat of the same ones would be served from the prefix cache."""
    engine = LLMEngine(config, loaded=loaded)
    engine.add_request([loaded.config.vocab_size // 2] * 8,
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    counter = EngineFlopCounter(engine, loaded.config)
    results = [_timed(engine, counter, requests, label, peak_gflops) for requests in request_sets]
    engine.close()  # its tensor-parallel ranks, if any: the next variant starts its own
    del engine, counter
    gc.collect()
    figures = [r["output_tokens_per_s"] for r in results]
    result = results[figures.index(statistics.median_low(figures))]
    result["repeats"] = figures
    result["first_output_tokens"] = results[0]["first_output_tokens"]  # the --seed set's
    return result


def _timed(engine: LLMEngine, counter: EngineFlopCounter, requests: list[BenchRequest],
           label: str, peak_gflops: float) -> dict[str, Any]:
    from tqdm import tqdm  # in-function: loaded only when a benchmark runs (start-up time)

    counter.reset()
    before = engine.stats()
    outputs = {}
    # On CUDA, the Triton kernels built (compiled, or loaded from Triton's disk cache) inside
    # the timed part: stalls that the engine's warm-up is there to prevent.
    builds = recording_builds() if engine.device.type == "cuda" else contextlib.nullcontext()
    with builds as built, tqdm(total=len(requests), desc=label, file=sys.stderr,
                               disable=None) as bar:
        start = time.perf_counter()
        ids = [engine.add_request(r.prompt, _params(r)) for r in requests]
        collector = OutputCollector()
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if (out := collector.add(delta)) is not None:
                    outputs[out.request_id] = out
                    bar.update()
        wall = time.perf_counter() - start
    after = engine.stats()
    stats = dict(after, **{k: after[k] - before[k] for k in _COUNTERS})
    outs = [outputs[i] for i in ids]
    ttft = [o.first_token_time - o.arrival_time for o in outs if o.first_token_time]
    e2e = [o.finished_time - o.arrival_time for o in outs if o.finished_time]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "label": label,
        "enable_prefix_caching": engine.config.enable_prefix_caching,
        "num_requests": len(requests),
        "num_samples": sum(r.n for r in requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.n * r.output_len for r in requests),
        "wall_s": wall,
        "requests_per_s": len(requests) / wall,
        "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall,
        "ttft_ms": summarize(ttft, 1e3),
        "e2e_ms": summarize(e2e, 1e3),
        "forwards": counter.forwards,
        "model_execute_s": counter.execute_s,
        "stats": stats,
        "roofline": roofline(counter.count, peak_gflops, wall),
        "first_output_tokens": outs[0].outputs[0].token_ids,
        "triton_builds": built,  # kernel names; None off CUDA
    }


def _variants(args: argparse.Namespace, config: EngineConfig, requests: list[BenchRequest]
              ) -> list[tuple[str, EngineConfig, list[BenchRequest]]]:
    if args.workload == "shared-prefix":
        return [("prefix caching on", replace(config, enable_prefix_caching=True), requests),
                ("prefix caching off", replace(config, enable_prefix_caching=False), requests)]
    if args.workload == "fork":
        off = replace(config, enable_prefix_caching=False)
        single = [BenchRequest(r.prompt, r.output_len) for r in requests for _ in range(r.n)]
        n = requests[0].n
        return [(f"fork n={n}, no prefix cache", off, requests),
                (f"n=1 x{len(single)}, no prefix cache", off, single)]
    return [("pagedserve", config, requests)]


def _comparison(workload: str, runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    if workload not in ("shared-prefix", "fork") or len(runs) != 2:
        return None
    a, b = runs

    def pair(get: Any) -> dict[str, Any]:
        x, y = get(a), get(b)
        return {a["label"]: x, b["label"]: y, "ratio": ratio(y, x)}

    return {
        "ratio_is": f"'{b['label']}' / '{a['label']}'",
        "prefill_tokens_computed": pair(lambda r: r["stats"]["prefill_tokens_computed"]),
        "ttft_p50_ms": pair(lambda r: r["ttft_ms"]["median"]),
        "wall_s": pair(lambda r: r["wall_s"]),
    }


def _hf(args: argparse.Namespace, loaded: LoadedModel, dtype: torch.dtype,
        requests: list[BenchRequest], main: dict[str, Any]) -> dict[str, Any]:
    from tqdm import tqdm  # in-function: loaded only when a benchmark runs (start-up time)

    sizes = args.hf_batch_sizes
    model = hf_model_from_loaded(loaded, dtype)
    model = model.to(resolve_device(args.device))
    rows = [(list(r.prompt), r.output_len) for r in requests for _ in range(r.n)]
    tok = loaded.tokenizer
    pad = tok.eos_token_ids[0] if tok.eos_token_ids else 0
    with tqdm(total=len(sizes), desc="hf baseline", file=sys.stderr, disable=None) as bar:
        hf = run_hf_baseline(model, rows, sizes, args.hf_max_prompts, pad,
                             list(tok.eos_token_ids), on_batch=bar.set_postfix_str)
        bar.update(len(sizes))
    n_cmp = len(main["first_output_tokens"])
    first_row = hf.pop("first_row_tokens")  # None without batch size 1: not checked
    hf["first_row_agrees"] = None if first_row is None else \
        first_row[:n_cmp] == main["first_output_tokens"]
    hf["ratio_output_tokens_per_s"] = ratio(main["output_tokens_per_s"],
                                            hf["best"]["output_tokens_per_s"])
    hf["ratio_total_tokens_per_s"] = ratio(main["total_tokens_per_s"],
                                           hf["best"]["total_tokens_per_s"])
    # The same workload's bound against HF's (extrapolated) wall: where the baseline sits
    # on the same roofline scale.
    hf["best_roofline_fraction"] = ratio(main["roofline"]["bound_s"],
                                         hf["best"]["estimated_full_wall_s"])
    del model
    gc.collect()
    return hf


def cmd_throughput(args: argparse.Namespace) -> int:
    config = engine_config(args)
    if config.num_threads:  # before the probe and the HF baseline, not only inside the engine
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    for name in ("repeats", "probe_reps"):  # before the model loads
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    loaded = load_model_files(config.model, dtype)
    workloads = [build_workload(
        args.workload, loaded.config.vocab_size, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len,
        n=args.n, seed=args.seed + k) for k in range(args.repeats)]
    workload = workloads[0]
    probe = probe_peak(loaded.config, dtype, device, reps=args.probe_reps)
    # Variant i of every repeat's workload, run in turn on variant i's engine.
    variants = [_variants(args, config, w.requests) for w in workloads]
    runs = [run_engine(loaded, cfg, [v[i][2] for v in variants], label, probe["peak_gflops"])
            for i, (label, cfg, _) in enumerate(variants[0])]
    result: dict[str, Any] = {
        "bench": "throughput",
        "workload": workload.name,
        "description": workload.spec.description,
        "overrides": {k: getattr(args, k) for k in
                      ("num_prompts", "input_len", "output_len", "prefix_len", "n")
                      if getattr(args, k) is not None},
        "seed": workload.seed,
        "model": loaded.name,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "machine": machine_facts(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "engine_config": vars(resolve_config(config, device)),
        "probe": probe,
        "runs": runs,
        "comparison": _comparison(args.workload, runs),
        "hf_baseline": None,
    }
    if args.baseline == "hf":
        result["hf_baseline"] = _hf(args, loaded, dtype, workload.requests, runs[0])
    for run in runs:
        del run["first_output_tokens"]
    print(report.format_throughput(result))
    if args.json:
        report.write_json(args.json, result)
    return 0


def _batch_sizes(text: str) -> list[int]:
    """--hf-batch-sizes, read as argparse reads the flags (before the model loads)."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return sizes


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="mixed",
                   help="; ".join(f"{k}: {v.description}" for k, v in SPECS.items()))
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None,
                   help="fix every prompt's length (shared-prefix: the unique suffix's)")
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: prefix length")
    p.add_argument("--n", type=int, default=None, help="samples per request (fork: 16)")
    p.add_argument("--seed", type=int, default=0, help="prompt ids seed")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed parts on each engine, with the prompts of seeds --seed, "
                        "--seed + 1, ...; a run reports its median one, and every figure")
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="hf: also run HF transformers generate on the same weights")
    p.add_argument("--hf-batch-sizes", type=_batch_sizes, default="1,8,32",
                   metavar="B1,B2,...")
    p.add_argument("--hf-max-prompts", type=int, default=16, metavar="K",
                   help="HF runs the first max(b, K) rows per batch size b and extrapolates "
                        "(0: all rows)")
    p.add_argument("--probe-reps", type=int, default=5, help="timed reps per roofline matmul")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON")

