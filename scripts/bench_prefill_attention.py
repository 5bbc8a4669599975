"""Paged prefill attention on CPU, one layer: the C++ kernel against what it replaced (the
C++ gather, each KV head repeated for its query heads, then PyTorch's fused attention),
alternated in one process, medians and their ratio. The cache is the engine's (huge pages,
head-major, key blocks d-major), its blocks in random order.

    .venv/bin/python scripts/bench_prefill_attention.py --dtype float32 --threads 2
"""

import argparse
import functools
import statistics
import time

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
from pagedserve.kernels import cpu, reference
# isort: on

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M

# name: (context lengths, new tokens per sequence, blocks the sequences share up front)
CASES = {
    "fresh prompts 4 x 256": ([256] * 4, [256] * 4, 0),
    "fresh prompts 2 x 512": ([512] * 2, [512] * 2, 0),
    "fresh prompts 100, 300, 500": ([100, 300, 500], [100, 300, 500], 0),
    "512-token chunk after 1,024 cached": ([1536], [512], 0),
    "32 x 32 new tokens on a 1,536 prefix": ([1568] * 32, [32] * 32, 96),
}


def make_case(ctxs: list[int], new: list[int], shared_blocks: int, bs: int,
              dtype: torch.dtype, gen: torch.Generator):
    blocks = [-(-c // bs) for c in ctxs]
    num_blocks = sum(blocks) + 8
    k_caches, v_caches = cpu.allocate_kv_cache(1, num_blocks, bs, KV_HEADS, HEAD_DIM, dtype,
                                               torch.device("cpu"))
    k_cache, v_cache = k_caches[0], v_caches[0]
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen).to(dtype))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen).to(dtype))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [free.pop() for _ in range(shared_blocks)]
    tables = torch.zeros(len(ctxs), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        row = shared + [free.pop() for _ in range(n - shared_blocks)]
        tables[i, :n] = torch.tensor(row, dtype=torch.int32)
    q = torch.randn(sum(new), HEADS, HEAD_DIM, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, cu, torch.tensor(ctxs, dtype=torch.int32)


def causal_flops(ctxs: list[int], new: list[int]) -> int:
    """QK^T and PV over the keys each query may see."""
    keys = sum(c - n + i + 1 for c, n in zip(ctxs, new, strict=True) for i in range(n))
    return 4 * HEADS * HEAD_DIM * keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu.load()
    if ops is None:
        raise SystemExit("the C++ kernels did not build")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.dtype}, {args.threads} threads, block size {args.block_size}; medians of "
          f"{args.reps}, alternated")
    for name, (ctxs, new, shared) in CASES.items():
        inputs = (*make_case(ctxs, new, shared, args.block_size, dtype, gen), HEAD_DIM**-0.5)
        sides = {
            "gather + SDPA": functools.partial(reference.paged_prefill_attention, *inputs,
                                               gather_kv=ops.gather_kv),
            "C++ kernel": functools.partial(ops.paged_prefill_attention, *inputs),
        }
        results = {side: fn() for side, fn in sides.items()}
        diff = (results["gather + SDPA"].float() - results["C++ kernel"].float()).abs().max()
        times: dict[str, list[float]] = {side: [] for side in sides}
        for rep in range(args.reps):
            for side in sides if rep % 2 == 0 else reversed(sides):
                start = time.perf_counter()
                sides[side]()
                times[side].append(time.perf_counter() - start)
        (old, new_ms) = (statistics.median(times[s]) * 1e3 for s in sides)
        gflop = causal_flops(ctxs, new) / 1e9
        print(f"{name:38s} gather + SDPA {old:7.2f} ms ({gflop / old * 1e3:5.1f} GFLOP/s)  "
              f"C++ {new_ms:7.2f} ms ({gflop / new_ms * 1e3:5.1f})  x{old / new_ms:.2f}  "
              f"max diff {diff:.1e}")


if __name__ == "__main__":
    main()
