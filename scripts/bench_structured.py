"""The cost of guided decoding: one decode-heavy batch of 64 sequences, all unconstrained,
against the same batch with half of them JSON-constrained, in the same process.

    .venv/bin/python scripts/bench_structured.py --seqs 64 --output-len 32 --reps 2

The constrained half follows a nested JSON schema (an array of objects with an integer, a
bounded string and an enum) whose minItems cannot be met within --output-len, so no sample
stops early and both runs decode the same number of tokens; every sample has ignore_eos.
Runs alternate (plain, guided, plain, guided, ...) and the best of each is compared, so
drift on a shared machine hits both. Each run is timed in wall seconds and in this
process's CPU seconds (steadier where other processes share the cores), and the grammar
work itself (masks filled and applied in the sampler, matchers advanced in postprocess) is
timed directly. Prints one JSON line; overhead_pct is CPU-time based."""

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams, logits_processors
from pagedserve.scheduler import StructuredOutputs
from pagedserve.structured import LLGuide

GRAMMAR_SECONDS = [0.0]  # time spent in the grammar work, across a run


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            GRAMMAR_SECONDS[0] += time.perf_counter() - start
    return wrapper


logits_processors.apply_grammars = timed(logits_processors.apply_grammars)
LLGuide.accept = timed(LLGuide.accept)

SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 500, "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
        "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["id", "name", "tag"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def run_batch(engine: LLMEngine, prompts: list[list[int]], guided: bool, output_len: int,
              temperature: float) -> tuple[float, float, float, int]:
    """Wall seconds, CPU seconds, grammar seconds and tokens of one batch."""
    constraint = StructuredOutputs(json=json.dumps(SCHEMA))
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=temperature, seed=i, max_tokens=output_len, ignore_eos=True,
            structured_outputs=constraint if guided and i % 2 == 0 else None)
        engine.add_request(prompt, params)
    GRAMMAR_SECONDS[0] = 0.0
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += sum(len(o.token_ids) for o in out.outputs)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert engine.block_manager.num_used_blocks == 0, "blocks leaked"
    return wall, cpu, GRAMMAR_SECONDS[0], tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    # Greedy by default: random sampling sorts every row's vocabulary, and a masked row
    # (mostly -inf) sorts faster than a free one, which would hide the grammar's cost.
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads,
        max_num_seqs=args.seqs, max_num_batched_tokens=max(2048, args.seqs * args.input_len)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.input_len,), generator=g).tolist()
               for _ in range(args.seqs)]
    engine.grammars.compile(StructuredOutputs(json=json.dumps(SCHEMA)))  # compile off the clock
    run_batch(engine, prompts[:4], True, 4, args.temperature)  # warm-up
    best: dict[bool, tuple[float, float, float, int]] = {}
    for _ in range(args.reps):
        for guided in (False, True):
            result = run_batch(engine, prompts, guided, args.output_len, args.temperature)
            if guided not in best or result[1] < best[guided][1]:  # by CPU seconds
                best[guided] = result
    plain, guided = best[False], best[True]
    assert plain[3] == guided[3] == args.seqs * args.output_len
    print(json.dumps({
        "seqs": args.seqs, "guided_seqs": (args.seqs + 1) // 2, "output_len": args.output_len,
        "plain_wall_s": round(plain[0], 3), "guided_wall_s": round(guided[0], 3),
        "plain_cpu_s": round(plain[1], 3), "guided_cpu_s": round(guided[1], 3),
        "grammar_s": round(guided[2], 3),
        "grammar_pct_of_plain": round(100 * guided[2] / plain[1], 1),
        "wall_overhead_pct": round(100 * (guided[0] / plain[0] - 1), 1),
        "overhead_pct": round(100 * (guided[1] / plain[1] - 1), 1),
    }))


if __name__ == "__main__":
    main()
