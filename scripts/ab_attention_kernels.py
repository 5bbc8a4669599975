"""A/B two versions of the C++ paged attention on CPU, one layer, in one process: both
builds called alternately on the same cache, medians and their ratio, and the largest
difference between their outputs (0 where the change keeps every product and sum).

    cp -r pagedserve/kernels/cpu /tmp/base_cpu      # before editing
    ... edit pagedserve/kernels/cpu ...
    PAGEDSERVE_CPU_ARCH=x86-64-v3 .venv/bin/python scripts/ab_attention_kernels.py \\
        --base /tmp/base_cpu --dtype float32 --block-size 32

PAGEDSERVE_CPU_ARCH=x86-64-v3 builds both as for an AVX2-only CPU. One layer's cache stays
in the L3 between calls; --layers 30 runs each case over 30 layers' caches in turn, so that
the blocks come from memory as in an engine step.
"""

import argparse
import functools
import statistics
import time
from pathlib import Path
from types import ModuleType

from ab_cpu_kernels import HERE, build_ops
from bench_prefill_attention import HEAD_DIM, causal_flops, make_case

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on

# name: (context lengths, new tokens per sequence, tokens the sequences share up front)
CASES = {
    "prefill 2 x 512": ([512] * 2, [512] * 2, 0),
    "prefill 100, 300, 500": ([100, 300, 500], [100, 300, 500], 0),
    "prefill 32 x 32 on a 1,536 prefix": ([1568] * 32, [32] * 32, 1536),
    "decode 64 x 300, lone": ([300] * 64, [1] * 64, 0),
    "decode 128 x 170, lone": ([170] * 128, [1] * 128, 0),
    "decode 32 x 1,600 on a 1,536 prefix": ([1600] * 32, [1] * 32, 1536),
}


def run_layers(ops: ModuleType, op: str, layers: list[tuple]) -> list[torch.Tensor]:
    return [getattr(ops, op)(*inputs, HEAD_DIM**-0.5) for inputs in layers]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="folder with the A sources")
    ap.add_argument("--new", default=str(HERE), help="folder with the B sources")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--layers", type=int, default=1, help="caches per case, called in turn")
    args = ap.parse_args()
    sides = [build_ops(Path(args.base)), build_ops(Path(args.new))]
    dtype, bs = getattr(torch, args.dtype), args.block_size
    gen = torch.Generator().manual_seed(0)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, block size {bs}, "
          f"{args.layers} layer(s); medians of {args.reps}, alternated")
    for name, (ctxs, new, shared) in CASES.items():
        prefill = max(new) > 1
        op = "paged_prefill_attention" if prefill else "paged_decode_attention"
        layers = []
        for _ in range(args.layers):
            q, k, v, tables, cu, ctx = make_case(ctxs, new, shared // bs, bs, dtype, gen)
            layers.append((q, k, v, tables, cu, ctx) if prefill else (q, k, v, tables, ctx))

        calls = [functools.partial(run_layers, ops, op, layers) for ops in sides]
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(calls[0](), calls[1](), strict=True))
        times: list[list[float]] = [[], []]
        for rep in range(args.reps):
            for side in (0, 1) if rep % 2 == 0 else (1, 0):
                start = time.perf_counter()
                calls[side]()
                times[side].append(time.perf_counter() - start)
        a, b = (statistics.median(t) * 1e3 for t in times)
        gflop = causal_flops(ctxs, new) * args.layers / 1e9
        print(f"{name:36s} A {a:7.2f} ms ({gflop / a * 1e3:4.0f} GFLOP/s)  "
              f"B {b:7.2f} ms ({gflop / b * 1e3:4.0f})  A/B x{a / b:.2f}  max diff {diff:.1e}")


if __name__ == "__main__":
    main()
