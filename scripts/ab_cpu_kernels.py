"""A/B two versions of the C++ CPU kernels inside one engine process.

    cp -r pagedserve/kernels/cpu /tmp/base_cpu      # before editing
    ... edit pagedserve/kernels/cpu ...
    .venv/bin/python scripts/ab_cpu_kernels.py --base /tmp/base_cpu --seqs 128 --context 170

Builds both source folders (under different extension names), fills the engine with SEQS
greedy sequences of CONTEXT prompt tokens, then runs decode steps alternating the two
kernel sets (A B, B A, ...), so that both see the same contexts and the same machine
phase. Prints each side's median step and the ratio. Separate processes drift too much on
shared machines to show a few percent."""

import argparse
import hashlib
import os
import statistics
import time
from pathlib import Path

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on
from torch.utils.cpp_extension import load as jit_load

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.kernels import KernelSet, cpu

HERE = Path(cpu.__file__).parent


def build(folder: Path) -> KernelSet:
    sources = sorted(str(p) for p in folder.glob("*.cpp"))
    tag = hashlib.sha1(b"".join(Path(s).read_bytes() for s in sources)).hexdigest()[:10]
    ops = jit_load(name=f"pagedserve_ab_{tag}", sources=sources, extra_cflags=cpu.cflags(),
                   extra_ldflags=["-fopenmp"])
    return cpu.kernel_set(ops)


def use(engine: LLMEngine, kernels: KernelSet) -> None:
    engine.runner.kernels = kernels
    for module in engine.runner.model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="folder with the A sources")
    ap.add_argument("--new", default=str(HERE), help="folder with the B sources")
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--context", type=int, default=170)
    ap.add_argument("--steps", type=int, default=40, help="decode steps per side")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(
        dtype="bfloat16", num_threads=args.threads, max_num_seqs=args.seqs,
        num_kv_blocks=args.seqs * (args.context + 2 * args.steps + 32) // 16 + 64))
    sides = {name: build(Path(folder)) for name, folder in (("A", args.base), ("B", args.new))}
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 8, ignore_eos=True)
    for _ in range(args.seqs):
        engine.add_request(torch.randint(100, 40000, (args.context,), generator=gen).tolist(),
                           params)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in running):
        engine.step()
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(args.steps):
        for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
            use(engine, sides[side])
            start = time.perf_counter()
            engine.step()
            times[side].append(time.perf_counter() - start)
    a, b = (statistics.median(times[s]) * 1e3 for s in ("A", "B"))
    print(f"decode step, {args.seqs} seqs x ~{args.context} tokens: A {a:.1f} ms, "
          f"B {b:.1f} ms, B/A {b / a:.3f}")


if __name__ == "__main__":
    main()
