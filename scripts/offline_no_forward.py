"""`bench serve`'s random load run offline on one engine, with every forward replaced by fixed
logits (serve_no_forward.py): the engine's CPU a token and tokens a step, to set beside the
engine process's over HTTP (`LOGITS_WIDTH=64 ... serve_no_forward.py --num-threads 1`,
scripts/ab_serve_loop.sh).

    .venv/bin/python scripts/offline_no_forward.py [--num-prompts 1024] [--rounds 3]
        [--deltas] [engine flags]

The requests are `bench serve`'s own (serve_dataset: random ids, 288 tokens +- 77%, 128 out
with ignore_eos), at most 64 running (`--max-concurrency 64`); round r takes seed r, as
ab_serve_loop.sh's round r does. `--output-len` and `--repetition-penalty` change them."""

import argparse
import dataclasses
import time

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
# isort: on
from serve_no_forward import fake_forwards  # scripts/, this script's directory

from pagedserve.bench.workloads import serve_dataset
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
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="e.g. 1.05, Qwen2.5's generation_config default: the penalties' "
                         "host cost a step (the rows then as wide as the vocabulary: a "
                         "penalty reads the prompt's ids)")
    ap.set_defaults(num_threads=1, max_num_seqs=64)
    args = ap.parse_args()
    engine = LLMEngine(engine_config(args))
    fake_forwards(None if args.repetition_penalty != 1.0 else 64)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
        repetition_penalty=args.repetition_penalty, detokenize=not args.deltas,
        output_kind=RequestOutputKind.DELTA if args.deltas else RequestOutputKind.FINAL_ONLY)
    for r in range(1, args.rounds + 1):
        requests = serve_dataset("random", args.num_prompts, 288, args.output_len,
                                 range_ratio=0.77, seed=r)
        for i, request in enumerate(requests):
            engine.add_request(request.prompt, dataclasses.replace(params), f"r{r}-{i}")
        steps0 = engine.stats()["steps"]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        tokens, steps = args.num_prompts * args.output_len, engine.stats()["steps"] - steps0
        print(f"round {r}: {tokens / wall:.0f} output tok/s, CPU {cpu / tokens * 1e6:.2f} "
              f"us a token, {tokens / steps:.1f} output tokens a step ({steps} steps)")


if __name__ == "__main__":
    main()
