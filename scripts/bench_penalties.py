"""What the penalties cost a step on the host, against the output's length: apply_penalties
on 64 rows of a 49,152-token vocabulary, one new token a row between calls, the median of 9
calls, on one thread. Tokens are drawn Zipf(1.2) (as a text spreads them) or uniformly
(every token differs: the worst case for counts kept per distinct token).

    python scripts/bench_penalties.py [--rows 64] [--lengths 128 1024 16384]
"""

import argparse
import statistics
import time

import numpy as np
import torch

from pagedserve.engine import logits_processors
from pagedserve.scheduler import SamplingParams, Sequence

VOCAB = 49152
CASES = {"repetition 1.05": dict(repetition_penalty=1.05),
         "presence 0.3 + frequency 0.5": dict(presence_penalty=0.3, frequency_penalty=0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 16384])
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)

    def draw(n: int, spread: str) -> list[int]:
        if spread == "uniform":
            return rng.integers(VOCAB, size=n).tolist()
        return (rng.zipf(1.2, size=n) % VOCAB).tolist()

    for spread in ("zipf", "uniform"):
        for name, fields in CASES.items():
            for length in args.lengths:
                rows = [Sequence(f"r{i}", draw(300, spread) + draw(length, spread),
                                 SamplingParams(**fields), 0.0, num_prompt_tokens=300)
                        for i in range(args.rows)]
                logits = torch.randn(args.rows, VOCAB)
                logits_processors.apply_penalties(logits, rows, None)  # (a first read)
                times = []
                for _ in range(9):
                    for r in rows:
                        r.token_ids += draw(1, spread)
                    start = time.perf_counter()
                    logits_processors.apply_penalties(logits, rows, None)
                    times.append(time.perf_counter() - start)
                print(f"{spread:7} {name:28} {length:6} tokens: "
                      f"{statistics.median(times) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
