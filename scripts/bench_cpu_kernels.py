"""Time the C++ CPU kernels against their PyTorch references, and the decode kernel against
the memory bandwidth it needs (the KV bytes one layer's decode reads).

    .venv/bin/python scripts/bench_cpu_kernels.py --seqs 64 --context 400 --threads 2
"""

import argparse
import statistics
import time

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
from pagedserve.kernels import cpu, reference
# isort: on


def median_ms(fn, reps: int = 30) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fork", type=int, default=16, help="samples per prompt in the fork case")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu.load()
    if ops is None:
        raise SystemExit("the C++ kernels did not build")
    heads, kv_heads, d, bs = 9, 3, 64, args.block_size  # SmolLM2-135M
    dt = getattr(torch, args.dtype)
    per_seq = -(-args.context // bs)
    # A pool much larger than the caches, so that blocks come from memory, not cache.
    num_blocks = 8 * args.seqs * per_seq
    k_cache = torch.randn(kv_heads, num_blocks, d, bs).to(dt).permute(1, 3, 0, 2)
    v_cache = torch.randn(kv_heads, num_blocks, bs, d).to(dt).permute(1, 2, 0, 3)
    tables = torch.randperm(num_blocks)[: args.seqs * per_seq].view(args.seqs, per_seq).int()
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    q = torch.randn(args.seqs, heads, d).to(dt)
    kv_bytes = 2 * args.seqs * args.context * kv_heads * d * dt.itemsize

    def decode(impl):
        return lambda: impl(q, k_cache, v_cache, tables, lens, d**-0.5)

    ref_ms = median_ms(decode(reference.paged_decode_attention))
    cpp_ms = median_ms(decode(ops.paged_decode_attention))
    print(f"decode attention, {args.seqs} seqs x {args.context} tokens, one layer, "
          f"{args.threads} thread(s), KV read {kv_bytes / 1e6:.1f} MB:")
    print(f"  reference {ref_ms:7.2f} ms   C++ {cpp_ms:7.2f} ms   x{ref_ms / cpp_ms:.2f}   "
          f"C++ reads KV at {kv_bytes / cpp_ms / 1e6:.1f} GB/s")

    # Forked samples: groups of --fork sequences share their first context - 36 tokens of
    # blocks. In batch order (samples of one prompt adjacent) the kernel loads each shared
    # block once per group; interleaving the groups makes every sequence load it itself.
    if args.fork > 1 and args.seqs % args.fork == 0:
        groups, shared = args.seqs // args.fork, (args.context - 36) // bs
        forked = tables.clone()
        for g in range(groups):
            forked[g * args.fork : (g + 1) * args.fork, :shared] = tables[g * args.fork, :shared]
        mixed_order = torch.arange(args.seqs).view(groups, args.fork).t().reshape(-1)
        adjacent = median_ms(lambda: ops.paged_decode_attention(
            q, k_cache, v_cache, forked, lens, d**-0.5))
        interleaved = median_ms(lambda: ops.paged_decode_attention(
            q, k_cache, v_cache, forked[mixed_order], lens, d**-0.5))
        print(f"forked decode, {groups} prompts x {args.fork} samples sharing {shared} blocks: "
              f"adjacent {adjacent:.2f} ms, interleaved {interleaved:.2f} ms, "
              f"x{interleaved / adjacent:.2f}")

    rows = 1024
    x = torch.randn(rows, 576).to(dt)
    weight = torch.randn(576).to(dt)
    gate_up = torch.randn(rows, 2 * 1536).to(dt)
    qk = torch.randn(rows, 12, d).to(dt)
    positions = torch.randint(0, 2048, (rows,))
    freqs = torch.outer(torch.arange(2048.0), torch.rand(d // 2))
    cos, sin = freqs.cos(), freqs.sin()
    cases = [
        ("rms_norm + residual", lambda: reference.rms_norm(x, x.clone(), weight, 1e-5),
         lambda: ops.rms_norm(x, x.clone(), weight, 1e-5)),
        ("rotary (q and k)", lambda: reference.rotary_(qk, positions, cos, sin),
         lambda: ops.rope_(qk, positions, cos, sin)),
        ("silu_and_mul", lambda: reference.silu_and_mul(gate_up),
         lambda: ops.silu_and_mul(gate_up)),
    ]
    logits = torch.randn(args.seqs, 49152).to(dt)  # one decode step's greedy pick
    cases.append((f"argmax ({args.seqs} rows)", lambda: reference.argmax_rows(logits),
                  lambda: ops.argmax_rows(logits)))
    print(f"element-wise, {rows} rows:")
    for name, ref, cpp in cases:
        ref_ms, cpp_ms = median_ms(ref), median_ms(cpp)
        print(f"  {name:20s} reference {ref_ms:6.3f} ms   C++ {cpp_ms:6.3f} ms   "
              f"x{ref_ms / cpp_ms:.2f}")


if __name__ == "__main__":
    main()
