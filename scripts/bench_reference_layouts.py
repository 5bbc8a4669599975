"""Time the PyTorch reference kernels (the ``--no-native-kernels`` path) on the block-major
cache the reference set allocates, against a head-major one (``[H_kv, N, block_size, d]``
in memory), and their K/V gather against a plain copy of the same bytes.

    .venv/bin/python scripts/bench_reference_layouts.py --seqs 64 --context 400 --threads 1

One layer of SmolLM2-135M's shapes (9 query heads on 3 KV heads, d=64), bf16; each
sequence's blocks are scattered over a pool 8x larger than they need."""

import argparse
import statistics
import time
from collections.abc import Callable

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on

from pagedserve.kernels import REFERENCE, reference
from pagedserve.kernels.kernel_set import kv_cache_zeros


def interleaved_ms(cases: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median ms of each case, the cases run in turn within every repetition, so that a
    shared machine's drifting load falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(reps):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _gather_out(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    by_head = cache.permute(2, 0, 1, 3)
    out = torch.empty((by_head.shape[0], len(ids), *by_head.shape[2:]), dtype=cache.dtype)
    for h in range(len(by_head)):
        torch.index_select(by_head[h], 0, ids, out=out[h])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, d, bs, dt = 9, 3, 64, args.block_size, torch.bfloat16
    cpu, gen = torch.device("cpu"), torch.Generator().manual_seed(0)
    per_seq = -(-args.context // bs)
    num_blocks = 8 * args.seqs * per_seq
    k_block, v_block = REFERENCE.allocate_kv_cache(1, num_blocks, bs, kv_heads, d, dt, cpu)
    layouts = {"block-major": (k_block[0], v_block[0])}
    layouts["head-major"] = tuple(
        kv_cache_zeros((kv_heads, num_blocks, bs, d), dt, cpu).permute(1, 2, 0, 3)
        for _ in range(2))
    for k, v in layouts.values():
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    tables = torch.randperm(num_blocks, generator=gen)[: args.seqs * per_seq]
    tables = tables.view(args.seqs, per_seq).int()
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    q = torch.randn(args.seqs, heads, d, generator=gen).to(dt)
    # Prefill: 4 sequences of `context` tokens, the last 64 of each new (a cached prefix).
    new = 64
    pq = torch.randn(4 * new, heads, d, generator=gen).to(dt)
    cu = torch.arange(0, 4 * new + 1, new, dtype=torch.int32)
    kv_bytes = 2 * args.seqs * per_seq * bs * kv_heads * d * dt.itemsize
    flat = torch.randn(kv_bytes // dt.itemsize, generator=gen).to(dt)
    ids, scale = tables.reshape(-1), d**-0.5
    cases: dict[str, Callable[[], object]] = {"copy": flat.clone}
    for name, (k, v) in layouts.items():
        cases[f"{name} gather"] = lambda k=k, v=v: (
            reference.gather_heads(k, ids), reference.gather_heads(v, ids))
        # The alternatives gather_heads' note compares with: all heads in one select on
        # dim 1, and per-head selects into a preallocated output.
        cases[f"{name} dim 1"] = lambda k=k, v=v: (
            k.permute(2, 0, 1, 3).index_select(1, ids), v.permute(2, 0, 1, 3).index_select(1, ids))
        cases[f"{name} out="] = lambda k=k, v=v: (_gather_out(k, ids), _gather_out(v, ids))
        cases[f"{name} decode"] = lambda k=k, v=v: reference.paged_decode_attention(
            q, k, v, tables, lens, scale)
        cases[f"{name} prefill"] = lambda k=k, v=v: reference.paged_prefill_attention(
            pq, k, v, tables[:4], cu, lens[:4], scale)
    ms = interleaved_ms(cases, args.reps)
    print(f"one layer, {args.seqs} seqs x {args.context} tokens, bf16, {args.threads} "
          f"thread(s); K+V gathered per decode step: {kv_bytes / 1e6:.1f} MB, a plain copy of "
          f"it {ms['copy']:.2f} ms ({kv_bytes / ms['copy'] / 1e6:.1f} GB/s); medians of "
          f"{args.reps}, interleaved")
    for name in layouts:
        gather = ms[f"{name} gather"]
        print(f"  {name:11s}  gather_heads {gather:6.2f} ms ({kv_bytes / gather / 1e6:4.1f} GB/s)"
              f" (dim-1 select {ms[f'{name} dim 1']:6.2f}, out= {ms[f'{name} out=']:6.2f})"
              f"   decode attention {ms[f'{name} decode']:6.2f} ms   prefill attention "
              f"(4 x {new} new) {ms[f'{name} prefill']:6.2f} ms")


if __name__ == "__main__":
    main()
