"""Time and profile one engine decode step: B sequences at a given context length, and
with --prefill-chunk N a mixed step (a new N-token prompt beside the B decodes each step).

    .venv/bin/python scripts/profile_step.py --seqs 64 --context 400 --num-threads 1
    python scripts/profile_step.py --model DIR --device cuda --dtype bfloat16 \\
        --seqs 64 --context 300 [--no-enforce-eager] [--triton-attention flash] --json F
    python scripts/profile_step.py ... --prefill-chunk 448 [--piecewise-graphs]
    .venv/bin/python scripts/profile_step.py --no-forward [--async-scheduling]
    python scripts/profile_step.py ... --steps 1000 --py-spy stacks.txt   # needs py-spy

Takes every engine flag (pagedserve/engine/args.py). Prints the median wall time of a whole
step (schedule, inputs, forward, sampling, outputs), the host's time in each of those phases,
and torch.profiler's top ops; on CUDA also the GPU-busy time and the kernel launches per
step. --no-forward replaces the packed step's forward with fixed logits: what is left is
the host's own work per step (scheduling, inputs, sampling, settling, outputs)."""

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from unittest.mock import patch

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on
from serve_no_forward import fake_forwards  # scripts/, this script's directory
from torch.profiler import ProfilerActivity, profile

from pagedserve.engine import LLMEngine, SamplingParams, llm_engine
from pagedserve.engine.args import add_engine_args, engine_config
from pagedserve.engine.device_setup import default_block_size, resolve_device

PROFILED_STEPS = 3


def record_stacks(path: str, run: Callable[[], None]) -> None:
    """py-spy samples this process's main thread (waits included: a CUDA sync is host time
    too) while run() runs, without pausing it; its collapsed stacks go to path. Prints the
    lines where most samples end: the phase timers split a step by phase, this by line."""
    try:
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--format",
                                "raw", "--idle", "--nonblocking", "--rate", "1000",
                                "--output", path],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:  # a diagnostic: the figures above stand without it
        print(f"py-spy did not start: {e}")
        return
    time.sleep(1.0)  # attached by then
    run()
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
    if not os.path.exists(path):
        print(f"py-spy wrote no stacks (exit status {spy.returncode})")
        return
    ends: Counter[str] = Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if ".step (profile_step.py:" in stack:  # the main thread, inside a step
                ends[stack.rsplit(";", 1)[-1]] += int(count)
    total = sum(ends.values()) or 1
    print(f"py-spy: {total} samples of the main thread inside a step; where they end:")
    for frame, n in ends.most_common(15):
        print(f"  {100 * n / total:5.1f}%  {frame}")


@contextmanager
def phase_timers(engine: LLMEngine) -> Iterator[dict[str, float]]:
    """Wall seconds spent in each phase of engine.step(), summed over the steps run inside.
    On CUDA "execute" and "sample" are the host's side (inputs, launches or a graph
    replay), and "_settle" waits for the GPU (the sampled ids are the step's one
    device-to-host copy) before it appends them; with --async-scheduling it waits for the
    previous step's, while this step's forward runs."""
    totals: dict[str, float] = {}

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    targets = [(engine.scheduler, "schedule"), (engine.runner, "execute"),
               (llm_engine, "sample"), (engine.scheduler, "advance"), (engine, "_settle"),
               (engine.outputs, "take_outputs")]
    with ExitStack() as patches:  # each wrapper is removed on the way out
        for owner, name in targets:
            patches.enter_context(patch.object(owner, name, timed(name, getattr(owner, name))))
        yield totals


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                    help="every timed step also prefills a new N-token prompt (one output "
                         "token, so it leaves at the end of its step)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the decodes' sampling (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="the decodes' (1.05: Qwen2.5's generation_config default)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--no-forward", action="store_true",
                    help="fixed logits instead of the model (packed steps): the host's cost")
    ap.add_argument("--logits-width", type=int, default=None, metavar="N",
                    help="the fixed logits' rows N wide (default: the vocabulary's): an "
                         "argmax as cheap as launching one on a GPU")
    ap.add_argument("--py-spy", default=None, metavar="FILE",
                    help="at the end, run --py-spy-steps more steps under py-spy (on PATH) "
                         "and write its collapsed stacks here")
    ap.add_argument("--py-spy-steps", type=int, default=300)
    ap.set_defaults(max_num_batched_tokens=4096, dtype="bfloat16")
    args = ap.parse_args()
    args.max_num_seqs = args.seqs + (1 if args.prefill_chunk else 0)  # room for the prompt
    # Every sequence decodes through all the steps run: timed, profiled and under py-spy.
    steps = args.steps + PROFILED_STEPS + (args.py_spy_steps if args.py_spy else 0) + 40
    if args.num_kv_blocks is None:
        block_size = args.block_size or default_block_size(resolve_device(args.device))
        args.num_kv_blocks = (args.seqs * (args.context + steps + 16) + 2 * args.prefill_chunk
                              ) // block_size + 64
    engine = LLMEngine(engine_config(args))
    g = torch.Generator().manual_seed(0)
    if args.no_forward:
        fake_forwards(args.logits_width)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            repetition_penalty=args.repetition_penalty, max_tokens=steps,
                            ignore_eos=True)
    top = engine.vocab_size - 100
    for _ in range(args.seqs):
        engine.add_request(torch.randint(100, top, (args.context,), generator=g).tolist(), params)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in running):
        engine.step()
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def step() -> None:
        if not args.prefill_chunk:
            engine.step()
            return
        # Prefilled whole beside the decodes, and done in that step.
        engine.add_request(
            torch.randint(100, top, (args.prefill_chunk,), generator=g).tolist(), one_token)
        before = engine.stats()["prefill_tokens_computed"]
        engine.step()
        computed = engine.stats()["prefill_tokens_computed"] - before
        if computed != args.prefill_chunk or engine.scheduler.waiting:
            raise SystemExit(f"not a mixed step: {computed} prompt tokens computed "
                             "(raise --max-num-batched-tokens or the pool)")

    for _ in range(3):  # warm-up steps (allocator, autotuning caches)
        step()
    times = []
    with phase_timers(engine) as phases:
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    median_ms = statistics.median(times) * 1e3
    graphs = engine.runner.graphs is not None
    pieces = engine.runner.pieces is not None
    whole = pieces and engine.runner.pieces.whole
    kind = f"mixed step (+ a {args.prefill_chunk}-token prompt)" if args.prefill_chunk \
        else "decode step"
    mode = ("graphs, " + ("whole" if whole else "piecewise") if pieces else "graphs") \
        if graphs else "eager"
    mode += ", async scheduling" if engine.async_scheduling else ""
    if args.temperature:
        mode += f", temperature {args.temperature:g}, top_p {args.top_p:g}"
    if args.repetition_penalty != 1.0:
        mode += f", repetition_penalty {args.repetition_penalty:g}"
    print(f"{kind}, {args.seqs} seqs x ctx ~{args.context} ({engine.kernels.name}, "
          f"{mode}): median {median_ms:.2f} ms")
    phase_ms = {name: total / args.steps * 1e3 for name, total in phases.items()}
    phase_ms["rest"] = sum(times) / args.steps * 1e3 - sum(phase_ms.values())
    print("phases, mean ms/step: " + ", ".join(f"{k} {v:.3f}" for k, v in phase_ms.items()))
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
    figures = {"seqs": args.seqs, "context": args.context, "kernels": engine.kernels.name,
               "graphs": graphs, "piecewise_graphs": pieces, "full_graphs": whole,
               "async_scheduling": engine.async_scheduling, "no_forward": args.no_forward,
               "prefill_chunk": args.prefill_chunk, "median_step_ms": median_ms,
               "phases_ms": phase_ms}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        figures["gpu_busy_ms_per_step"] = sum(
            e.device_time for e in kernels) / 1e3 / PROFILED_STEPS
        launches = [e for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                           "cudaGraphLaunch")]
        figures["launches_per_step"] = len(launches) / PROFILED_STEPS
        print(f"GPU busy {figures['gpu_busy_ms_per_step']:.2f} ms/step, "
              f"{figures['launches_per_step']:.0f} host launches/step")
    table = prof.key_averages()
    if cuda:  # where the GPU's time goes, then where the host's goes
        print(table.table(sort_by="self_cuda_time_total", row_limit=15))
    print(table.table(sort_by="self_cpu_time_total", row_limit=20))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if args.py_spy:  # last: nothing above depends on py-spy attaching
        record_stacks(args.py_spy, lambda: [step() for _ in range(args.py_spy_steps)])


if __name__ == "__main__":
    main()
