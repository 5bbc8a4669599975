"""The kernels a mixed step launches from Python (decodes beside a prompt chunk), on the
eager path and on the piecewise path (engine/piecewise_graphs.py), counted on a CPU: the
Triton "flash" set runs under the interpreter, each Triton launch and each PyTorch op that
would launch a CUDA kernel (not views, not allocations) is counted, and on the piecewise
path each piece counts as one graph replay, its contents not at all (as captured on a GPU).

A host-bound step's time follows its launches (a Triton launch costs tens of microseconds
of Python; docs/performance-gpu.md). Counts, not times: a CPU says nothing of a GPU's.

    python scripts/count_step_launches.py --layers 24 --decodes 8 --prompt 100
"""

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from engine_utils import tiny_llama_with_embedded_tokenizer  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedserve.engine.piecewise_graphs import PiecewiseGraphs  # noqa: E402
from pagedserve.kernels.triton import kernel_set  # noqa: E402

# PyTorch ops that launch nothing on a GPU: views and allocations.
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select",
             "t", "transpose", "as_strided", "detach", "alias", "unsqueeze", "squeeze",
             "expand", "permute", "empty", "empty_like", "new_empty", "empty_strided",
             "lift_fresh", "promote_types"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if not self.paused and name not in NO_LAUNCH:
            self.counts["torch " + name] += 1
        return func(*args, **(kwargs or {}))


def count_step(engine: LLMEngine, decodes: int, prompt: int, vocab: int) -> Counter[str]:
    """Launches of one step: ``decodes`` running sequences beside a new ``prompt``."""
    g = torch.Generator().manual_seed(0)
    long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for _ in range(decodes):
        engine.add_request(torch.randint(100, vocab, (100,), generator=g).tolist(), long)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0
                                          for s in engine.scheduler.running):
        engine.step()
    engine.add_request(torch.randint(100, vocab, (prompt,), generator=g).tolist(),
                       SamplingParams(temperature=0, max_tokens=1))
    counter = LaunchCounter()
    launch, piece = InterpretedFunction.run, PiecewiseGraphs._piece

    def counted_launch(kernel, *args, **kwargs):  # the interpreter's own torch ops: none
        paused, counter.paused = counter.paused, True
        if not paused:
            counter.counts["triton " + kernel.fn.__name__] += 1
        try:
            return launch(kernel, *args, **kwargs)
        finally:
            counter.paused = paused

    def replayed_piece(self, n, i):  # a graph replay: its contents launch nothing
        counter.counts["graph replay"] += 1
        paused, counter.paused = counter.paused, True
        try:
            piece(self, n, i)
        finally:
            counter.paused = paused

    InterpretedFunction.run, PiecewiseGraphs._piece = counted_launch, replayed_piece
    try:
        with counter:
            engine.runner.execute(engine.scheduler.schedule())
    finally:
        InterpretedFunction.run, PiecewiseGraphs._piece = launch, piece
    return counter.counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--prompt", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = tiny_llama_with_embedded_tokenizer(args.layers, max_positions=4096)
    for name, piecewise in (("eager", False), ("piecewise", True)):
        engine = LLMEngine(EngineConfig(block_size=16, dtype="float32", device="cpu",
                                        num_kv_blocks=512, enforce_eager=not piecewise,
                                        piecewise_graphs=piecewise),
                           loaded=loaded, kernels=kernel_set("flash"))
        counts = count_step(engine, args.decodes, args.prompt, loaded.config.vocab_size - 100)
        total = sum(counts.values())
        print(f"{name}: {total} launches a step ({total / args.layers:.1f} a layer)")
        for op, n in counts.most_common():
            print(f"  {n:5d}  {op}")


if __name__ == "__main__":
    main()
