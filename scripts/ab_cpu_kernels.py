"""A/B two versions of the C++ CPU kernels inside one engine process.

    cp -r pagedserve/kernels/cpu /tmp/base_cpu      # before editing
    ... edit pagedserve/kernels/cpu ...
    .venv/bin/python scripts/ab_cpu_kernels.py --base /tmp/base_cpu --seqs 128 --context 170

Builds both source folders (under different extension names), fills the engine with SEQS
greedy sequences of CONTEXT prompt tokens, then runs decode steps alternating the two
kernel sets (A B, B A, ...), so that both see the same contexts and the same machine
phase. Prints each side's median step and the ratio. With --workload, a whole offline
workload instead (see --help). Separate processes drift too much on
shared machines to show a few percent. --background-load 3/17 runs another process busy 3
ms of every 20 meanwhile, about what a streaming benchmark client takes of a core."""

import argparse
import contextlib
import hashlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on
from torch.utils.cpp_extension import load as jit_load

from pagedserve.bench.workloads import WORKLOADS, build_workload
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.kernels import KernelSet, cpu
from pagedserve.models.loader import load_model_files

HERE = Path(cpu.__file__).parent
BURNER = """import sys, time
busy, idle = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(idle)
"""


@contextlib.contextmanager
def background_load(spec: str | None) -> Iterator[None]:
    """Another process, busy BUSY ms then asleep IDLE ms (spec "BUSY/IDLE"), while it lasts."""
    if not spec:
        yield
        return
    busy, idle = (str(float(v)) for v in spec.split("/"))
    proc = subprocess.Popen([sys.executable, "-c", BURNER, busy, idle])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def build_ops(folder: Path) -> ModuleType:
    """The extension built from ``folder``'s sources, named by their hash and the flags."""
    sources = sorted(str(p) for p in folder.glob("*.cpp"))
    content = b"".join(Path(s).read_bytes() for s in sorted(folder.glob("*.[ch]*")))
    tag = hashlib.sha1(content + " ".join(cpu.cflags()).encode()).hexdigest()[:10]
    return jit_load(name=f"pagedserve_ab_{tag}", sources=sources, extra_cflags=cpu.cflags(),
                    extra_ldflags=["-fopenmp"])


def build(folder: Path) -> KernelSet:
    return cpu.kernel_set(build_ops(folder))


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
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--workload", choices=WORKLOADS[:-1],
                    help="instead of decode steps: this whole offline workload (pagedserve "
                         "bench throughput's), in two engines, one per build, their steps "
                         "alternated; prints each side's total step time")
    ap.add_argument("--background-load", metavar="BUSY/IDLE",
                    help="milliseconds: another process's busy-then-idle cycle meanwhile")
    args = ap.parse_args()
    with background_load(args.background_load):
        if args.workload:
            return whole_workload(args)
        decode_steps(args)


def decode_steps(args: argparse.Namespace) -> None:
    engine = LLMEngine(EngineConfig(
        dtype=args.dtype, num_threads=args.threads, max_num_seqs=args.seqs,
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


def whole_workload(args: argparse.Namespace) -> None:
    loaded = load_model_files(None, torch.float32)  # the embedded model, read once
    requests = build_workload(args.workload, loaded.config.vocab_size).requests
    engines = [LLMEngine(EngineConfig(dtype=args.dtype, num_threads=args.threads),
                         loaded=loaded, kernels=build(Path(folder)))
               for folder in (args.base, args.new)]
    for engine in engines:
        for r in requests:
            engine.add_request(r.prompt, SamplingParams(n=r.n, max_tokens=r.output_len,
                                                        temperature=0, ignore_eos=True))
    totals, i = [0.0, 0.0], 0
    while any(e.has_unfinished_requests() for e in engines):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            if engines[side].has_unfinished_requests():
                start = time.perf_counter()
                engines[side].step()
                totals[side] += time.perf_counter() - start
        i += 1
    print(f"{args.workload}, {args.dtype}: A {totals[0]:.2f} s, B {totals[1]:.2f} s of steps, "
          f"B/A {totals[1] / totals[0]:.3f}")


if __name__ == "__main__":
    main()
