"""`bench serve`'s random load run offline on one engine, with every forward replaced by fixed
logits (serve_no_forward.py): the engine's CPU a token and tokens a step, to set beside the
engine process's over HTTP (`LOGITS_WIDTH=64 ... serve_no_forward.py --num-threads 1`,
scripts/ab_serve_loop.sh).

    .venv/bin/python scripts/offline_no_forward.py [--num-prompts 1024] [--rounds 3]
        [--deltas] [engine flags]

The prompts are 66-510 random ids (288 +- 77%), 128 tokens out with ignore_eos, at most 64
running (`bench serve --max-concurrency 64`); each round has prompts of its own."""

import argparse
import dataclasses
import time

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on
from serve_no_forward import fake_forwards  # scripts/, this script's directory

from pagedserve.engine import LLMEngine, RequestOutputKind, SamplingParams
from pagedserve.engine.args import add_engine_args, engine_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_engine_args(ap)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deltas", action="store_true",
                    help="ask for a stream's deltas without text, as the server does "
                         "(default: final outputs with text, as bench throughput does)")
    ap.set_defaults(num_threads=1, max_num_seqs=64)
    args = ap.parse_args()
    engine = LLMEngine(engine_config(args))
    fake_forwards(64)
    params = SamplingParams(
        temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=not args.deltas,
        output_kind=RequestOutputKind.DELTA if args.deltas else RequestOutputKind.FINAL_ONLY)
    g = torch.Generator().manual_seed(0)
    low, high = int(288 * 0.23), int(288 * 1.77)
    for r in range(args.rounds):
        for i in range(args.num_prompts):
            n = int(torch.randint(low, high + 1, (1,), generator=g))
            prompt = torch.randint(100, 32000, (n,), generator=g).tolist()
            engine.add_request(prompt, dataclasses.replace(params), f"r{r}-{i}")
        steps0 = engine.stats()["steps"]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        tokens, steps = args.num_prompts * 128, engine.stats()["steps"] - steps0
        print(f"round {r + 1}: {tokens / wall:.0f} output tok/s, CPU {cpu / tokens * 1e6:.2f} "
              f"us a token, {tokens / steps:.1f} output tokens a step ({steps} steps)")


if __name__ == "__main__":
    main()
