"""Time and profile one engine decode step: B sequences at a given context length.

    .venv/bin/python scripts/profile_step.py --seqs 64 --context 400 --block-size 16 --threads 1

Prints the median step time and torch.profiler's top ops (self CPU time)."""

import argparse
import statistics
import time

# isort: off
import pagedserve  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads OpenMP)
import torch
# isort: on
from torch.profiler import ProfilerActivity, profile

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(
        dtype=args.dtype, num_threads=args.threads, block_size=args.block_size,
        num_kv_blocks=(args.seqs * (args.context + 64)) // args.block_size + 64,
        max_num_batched_tokens=2048, max_num_seqs=args.seqs))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for _ in range(args.seqs):
        engine.add_request(torch.randint(100, 40000, (args.context,), generator=g).tolist(), params)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in running):
        engine.step()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"decode step, {args.seqs} seqs x ctx ~{args.context}: "
          f"median {statistics.median(times) * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
