"""The engine's host time a step, offline against served, with the forward faked out
(serve_no_forward.py): what the engine process adds to a step for streaming clients.

- offline: FINAL_ONLY requests (as `bench throughput` and `LLM.generate` ask), nothing sent;
- served: the requests as a server sends a stream's (DELTA, and without text where the
  server decodes it: `detokenize=False`), and each step's outputs turned into the engine
  process's events (`EngineLoop._deliver` and `_flush`) and pickled as its pipe pickles them.

    .venv/bin/python scripts/step_events.py [--seqs 64] [--steps 300] [--rounds 5]
        [--served-text]

The two run in interleaved rounds on one engine, each on prompts of its own (no prefix
cache hits across them); each prints the median step of a round, then the medians of the
rounds. Both decode every token's text in the engine, except served by default, as a
server's streams are since 9858fda (the server decodes them). Takes every engine flag
(pagedserve/engine/args.py)."""

import argparse
import dataclasses
import statistics
import time
from multiprocessing.reduction import ForkingPickler

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on
from serve_no_forward import fake_forwards  # scripts/, this script's directory

from pagedserve.engine import LLMEngine, RequestOutputKind, SamplingParams
from pagedserve.engine.args import add_engine_args, engine_config
from pagedserve.server.engine_loop import EngineLoop


def median_step(engine: LLMEngine, params: SamplingParams, served: bool, seqs: int,
                context: int, steps: int, seed: int) -> float:
    """Median seconds a step of ``seqs`` decoding sequences (after 10 untimed steps)."""
    sent: list[int] = []
    loop = EngineLoop(lambda: engine, None, lambda events: sent.append(
        len(ForkingPickler.dumps(events))))
    g = torch.Generator().manual_seed(seed)
    ids = []
    for i in range(seqs):
        prompt = torch.randint(100, engine.vocab_size - 100, (context,), generator=g).tolist()
        ids.append(engine.add_request(prompt, dataclasses.replace(params), f"r{seed}-{i}"))
        loop.live[ids[-1]], loop.groups[f"g{i}"] = (f"g{i}", 0), [ids[-1]]
    for _ in range(10):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        if served:
            loop._deliver(outputs)
            loop._flush(engine)
        times.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--served-text", action="store_true",
                    help="served requests decoded by the engine (a stream with stop strings; "
                         "every stream before 9858fda)")
    ap.add_argument("--logits-width", type=int, default=None, metavar="N",
                    help="the fixed logits' rows N wide (default: the vocabulary's): an "
                         "argmax as cheap as launching one on a GPU")
    ap.set_defaults(max_num_batched_tokens=4096, dtype="bfloat16")
    args = ap.parse_args()
    args.max_num_seqs = args.seqs
    if args.num_kv_blocks is None:
        args.num_kv_blocks = args.seqs * (args.context + args.steps + 64) // 16 + 64
    engine = LLMEngine(engine_config(args))
    fake_forwards(args.logits_width)
    common = dict(temperature=0.0, max_tokens=args.steps + 50, ignore_eos=True)
    offline = SamplingParams(**common, output_kind=RequestOutputKind.FINAL_ONLY)
    served = SamplingParams(**common, output_kind=RequestOutputKind.DELTA,
                            **({} if args.served_text else {"detokenize": False}))
    rounds: dict[str, list[float]] = {"offline": [], "served": []}
    for r in range(args.rounds):  # the two in turn first; prompts of their own each time
        order = [("offline", offline), ("served", served)]
        for k, (name, params) in enumerate(order[:: 1 if r % 2 == 0 else -1]):
            rounds[name].append(median_step(engine, params, name == "served", args.seqs,
                                            args.context, args.steps, seed=2 * r + k))
        print(f"round {r + 1}: offline {rounds['offline'][-1] * 1e3:.3f} ms, served "
              f"{rounds['served'][-1] * 1e3:.3f} ms a step")
    a, b = statistics.median(rounds["offline"]), statistics.median(rounds["served"])
    print(f"{args.seqs} sequences, medians of {args.rounds} rounds: offline {a * 1e3:.3f} ms, "
          f"served {b * 1e3:.3f} ms a step ({b / a:.2f}x, +{(b - a) * 1e6:.0f} us)")


if __name__ == "__main__":
    main()
