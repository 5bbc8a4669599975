"""How fast this machine can read a decode step's KV blocks at all: the memory floor under
the decode attention kernel.

    .venv/bin/python scripts/kv_read_floor.py --seqs 128 --context 170 --threads 2

Lays out a KV cache the way the engine does (huge-page memory, one head's key block and
value block 2 KiB each in bf16, 4 KiB in float32), scatters each sequence's blocks at
random, and times a loop that only loads every byte of every block a step reads (30
layers x KV heads x blocks), with plain 64-byte loads. Prints ms per step and GB/s;
compare with the decode attention time from scripts/profile_step.py."""

import argparse
import random
import statistics
import time

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on
from torch.utils.cpp_extension import load_inline

from pagedserve.kernels import cpu
from pagedserve.kernels.kernel_set import kv_cache_zeros

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#pragma GCC target("prefer-vector-width=512")
// XORs every 64-bit word of blocks ids[i] of both caches, so that no load can be skipped.
int64_t touch_blocks(const at::Tensor& k, const at::Tensor& v, const at::Tensor& ids,
                     int64_t block_bytes) {
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<uint64_t> sums(at::get_num_threads(), 0);
  at::parallel_for(0, ids.numel(), 1, [&](int64_t begin, int64_t end) {
    uint64_t s = 0;
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t* kb = reinterpret_cast<const uint64_t*>(kp + ip[i] * block_bytes);
      const uint64_t* vb = reinterpret_cast<const uint64_t*>(vp + ip[i] * block_bytes);
      for (int64_t w = 0; w < block_bytes / 8; ++w) s ^= kb[w] ^ vb[w];
    }
    sums[at::get_thread_num()] ^= s;
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total ^= s;
  return static_cast<int64_t>(total);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--context", type=int, default=170)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-gib", type=float, default=2.0, help="K and V together")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_inline("kv_read_floor", cpp_sources=SOURCE, functions=["touch_blocks"],
                      extra_cflags=cpu.cflags(), extra_ldflags=["-fopenmp"])
    dtype = getattr(torch, args.dtype)
    block_bytes = args.head_dim * args.block_size * dtype.itemsize
    planes = args.layers * args.kv_heads
    per_plane = int(args.cache_gib * 2**30 / 2 / block_bytes / planes)
    shape = (planes * per_plane, block_bytes // dtype.itemsize)
    k = kv_cache_zeros(shape, dtype, torch.device("cpu")).fill_(1)
    v = kv_cache_zeros(shape, dtype, torch.device("cpu")).fill_(1)
    per_seq = -(-args.context // args.block_size)
    rng = random.Random(0)
    tables = [rng.sample(range(per_plane), per_seq) for _ in range(args.seqs)]
    # The kernel's order: per layer, per (sequence, KV head), that sequence's blocks.
    layers = [torch.tensor([(layer * args.kv_heads + h) * per_plane + b
                            for table in tables for h in range(args.kv_heads) for b in table])
              for layer in range(args.layers)]

    def step() -> None:
        for ids in layers:
            ext.touch_blocks(k, v, ids, block_bytes)

    step()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    total = sum(len(ids) for ids in layers) * block_bytes * 2
    print(f"{args.seqs} seqs x {args.context} tokens, {args.layers} layers: {total / 1e6:.0f} MB "
          f"of K/V blocks read in {ms:.1f} ms per step = {total / ms / 1e6:.1f} GB/s "
          f"(median of 7, {args.threads} threads)")


if __name__ == "__main__":
    main()
