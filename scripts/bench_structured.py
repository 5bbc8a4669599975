"""The cost of guided decoding: one decode-heavy batch of 64 sequences, all unconstrained,
against the same batch with half of them JSON-constrained, in the same process.

    .venv/bin/python scripts/bench_structured.py --seqs 64 --output-len 32 --reps 2

The constrained half follows a nested JSON schema (an array of objects with an integer, a
bounded string and an enum) whose minItems cannot be met within --output-len, so no sample
stops early and both runs decode the same number of tokens; every sample has ignore_eos.
Runs alternate (plain, guided, plain, guided, ...) and the best of each is compared, so
drift on a shared machine hits both. Prints one JSON line: seconds, tokens/s, overhead."""

import argparse
import json
import time

# isort: off
import pagedserve  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads OpenMP)
import torch
# isort: on

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.scheduler import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 500, "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
        "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["id", "name", "tag"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def run_batch(engine: LLMEngine, prompts: list[list[int]], guided: bool, output_len: int
              ) -> tuple[float, int]:
    constraint = StructuredOutputs(json=json.dumps(SCHEMA))
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=output_len, ignore_eos=True,
                                structured=constraint if guided and i % 2 == 0 else None)
        engine.add_request(prompt, params)
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += sum(len(o.token_ids) for o in out.outputs)
    elapsed = time.perf_counter() - start
    assert engine.block_manager.num_used_blocks == 0, "blocks leaked"
    return elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads,
        max_num_seqs=args.seqs, max_num_batched_tokens=max(2048, args.seqs * args.input_len)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.input_len,), generator=g).tolist()
               for _ in range(args.seqs)]
    engine.grammars.compile(StructuredOutputs(json=json.dumps(SCHEMA)))  # compile off the clock
    run_batch(engine, prompts[:4], True, 4)  # warm-up
    best: dict[bool, tuple[float, int]] = {}
    for _ in range(args.reps):
        for guided in (False, True):
            elapsed, tokens = run_batch(engine, prompts, guided, args.output_len)
            if guided not in best or elapsed < best[guided][0]:
                best[guided] = (elapsed, tokens)
    (plain_s, plain_tokens), (guided_s, guided_tokens) = best[False], best[True]
    assert plain_tokens == guided_tokens == args.seqs * args.output_len
    print(json.dumps({
        "seqs": args.seqs, "guided_seqs": (args.seqs + 1) // 2, "output_len": args.output_len,
        "plain_s": round(plain_s, 3), "guided_s": round(guided_s, 3),
        "plain_tok_s": round(plain_tokens / plain_s, 1),
        "guided_tok_s": round(guided_tokens / guided_s, 1),
        "overhead_pct": round(100 * (guided_s / plain_s - 1), 1),
    }))


if __name__ == "__main__":
    main()
