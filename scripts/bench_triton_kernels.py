"""The Triton kernels on a CUDA GPU, against this GPU's memory bandwidth measured in the
same run, and against PyTorch doing the same work.

    python scripts/bench_triton_kernels.py [--json OUT]
    TRITON_INTERPRET=1 python scripts/bench_triton_kernels.py --quick   # a CPU dry run

- copy bandwidth: one device-to-device copy of 4 GiB (bytes read + written per second). It
  is the ceiling the memory-bound kernels are measured against.
- decode attention reads every K/V byte of the batch once: GB/s and its fraction of the
  copy bandwidth, with the split-KV partition count the launcher chose; where it split,
  the unsplit kernel too (splits=1), so the split's gain is measured rather than assumed;
  and the time of the PyTorch reference on the same inputs (last case). A case with
  ``table_ctx`` has block tables that wide, as a decode graph's are (as wide as the longest
  context the engine admits): split by that width, each sequence's partitions cut from its
  own context; unsplit, what the kernel did there before it cut them so (2026-12-05).
- prefill attention (no cached prefix): TFLOP/s, against torch's SDPA (causal, GQA) on the
  same tokens laid out densely, which pays no block-table lookups.
- a mixed step's attention (decodes beside a prompt chunk), as a whole graph runs it
  (--full-graphs: every sequence through the prefill kernel's flat grid, padded to
  --max-num-seqs sequences in tables as wide as max_model_len; a decode gets no split-KV
  there), against the eager split (the decode kernel, split, then the prefill kernel) and
  a sketch of split-KV inside a whole graph (not built), with the largest difference
  between their outputs.
- the K/V store and the block copy: GB/s moved (read + written).
Each time is the median of repeated runs (on a GPU, triton.testing.do_bench's)."""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from pagedserve.engine.cuda_graphs import padded_size
from pagedserve.engine.piecewise_graphs import MAX_TOKENS, _SequenceBuffers, token_ladder
from pagedserve.kernels import AttentionMetadata, reference
from pagedserve.kernels.triton import basic
from pagedserve.kernels.triton import cache_ops as tk
from pagedserve.kernels.triton import decode as td
from pagedserve.kernels.triton import prefill as tp


def median_ms(fn, device: torch.device, reps: int) -> float:
    fn()  # compile and warm up
    if device.type == "cuda":
        # Triton's do_bench: L2 flushed before each run, whose kernel also hides the host's
        # launch cost (timing bare back-to-back launches of a 50 us kernel measured the
        # Python launcher: 0.129 ms where do_bench saw 0.049 on the same inputs).
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=max(20, reps), return_mode="median")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def paged_caches(num_seqs: int, ctx: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
    """Random K/V for num_seqs sequences of ctx tokens in shuffled physical blocks."""
    per_seq = math.ceil(ctx / block_size)
    num_blocks = num_seqs * per_seq + 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, device=device)[: num_seqs * per_seq]
    tables = order.to(torch.int32).view(num_seqs, per_seq)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def bench_decode(case: dict, dtype, device, reps: int, with_reference: bool) -> dict:
    b, ctx, h, hkv, d = case["seqs"], case["ctx"], case["heads"], case["kv_heads"], case["d"]
    k_cache, v_cache, tables, lens = paged_caches(b, ctx, 16, hkv, d, dtype, device)
    if case.get("table_ctx"):  # a decode graph's width; the entries past a context unread
        wide = torch.zeros(b, math.ceil(case["table_ctx"] / 16), dtype=torch.int32,
                           device=device)
        wide[:, : tables.shape[1]] = tables
        tables = wide
    q = torch.randn(b, h, d, dtype=dtype, device=device)
    scale = d**-0.5
    ms = median_ms(lambda: td.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale),
                   device, reps)
    kv_bytes = 2 * b * ctx * hkv * d * k_cache.element_size()
    splits = td.num_splits(b, hkv, tables.shape[1] * 16, device)
    row = {**case, "splits": splits, "triton_ms": ms, "kv_gb": kv_bytes / 1e9,
           "gb_per_s": kv_bytes / ms / 1e6}
    # The GPU-verified "basic" kernel, the baseline measured in the same run.
    row["basic_ms"] = median_ms(lambda: basic.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale), device, reps)
    row["basic_gb_per_s"] = kv_bytes / row["basic_ms"] / 1e6
    if splits > 1:
        row["no_split_ms"] = median_ms(lambda: td.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, splits=1), device, reps)
        row["no_split_gb_per_s"] = kv_bytes / row["no_split_ms"] / 1e6
    if with_reference:
        row["reference_ms"] = median_ms(
            lambda: reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale),
            device, max(3, reps // 5))
    return row


def bench_prefill(case: dict, dtype, device, reps: int) -> dict:
    b, n, h, hkv, d = case["seqs"], case["tokens"], case["heads"], case["kv_heads"], case["d"]
    k_cache, v_cache, tables, lens = paged_caches(b, n, 16, hkv, d, dtype, device)
    q = torch.randn(b * n, h, d, dtype=dtype, device=device)
    cu = torch.arange(0, b + 1, dtype=torch.int32, device=device) * n
    scale = d**-0.5
    ms = median_ms(
        lambda: tp.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale,
                                           max_query_len=n),  # as the engine passes it
        device, reps)
    # The same tokens densely: [b, heads, n, d], keys and values gathered out of the blocks.
    dense_q = q.view(b, n, h, d).transpose(1, 2)
    offsets = torch.arange(n, device=device) % 16
    gather = tables.long().repeat_interleave(16, dim=1)[:, :n] * 16 + offsets
    dense_k = k_cache.view(-1, hkv, d)[gather].transpose(1, 2)
    dense_v = v_cache.view(-1, hkv, d)[gather].transpose(1, 2)
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(
        dense_q, dense_k, dense_v, is_causal=True, scale=scale, enable_gqa=True), device, reps)
    basic_ms = median_ms(lambda: basic.paged_prefill_attention(
        q, k_cache, v_cache, tables, cu, lens, scale, max_query_len=n), device,
        max(3, reps // 5))
    flops = 4 * b * h * d * n * (n + 1) / 2  # QK^T and PV over the causal triangle
    return {**case, "triton_ms": ms, "sdpa_ms": sdpa_ms, "basic_ms": basic_ms,
            "triton_tflops": flops / ms / 1e9, "sdpa_tflops": flops / sdpa_ms / 1e9,
            "basic_tflops": flops / basic_ms / 1e9}


IN_GRAPH_SPLITS = 16  # bench_mixed's sketch: a 16k context in partitions of 1,000 tokens


def bench_mixed(case: dict, dtype, device, reps: int) -> dict:
    """``seqs`` decodes of ``ctx`` tokens and one new prompt of ``prompt`` tokens."""
    b, ctx, p = case["seqs"], case["ctx"], case["prompt"]
    h, hkv, d, max_seqs = case["heads"], case["kv_heads"], case["d"], case["max_seqs"]
    k_cache, v_cache, tables, lens = paged_caches(b + 1, max(ctx, p), 16, hkv, d, dtype, device)
    lens[:b], lens[b] = ctx, p  # (the caches hold the longer of the two for each)
    total = b + p
    padded = padded_size(token_ladder(MAX_TOKENS), total)  # the whole graph's size
    q = torch.randn(padded, h, d, dtype=dtype, device=device)
    scale = d**-0.5
    # The step as the eager path gets it: tables as wide as the longest context.
    meta = AttentionMetadata(
        slot_mapping=tables[:0, 0].long(), num_decode_tokens=b,
        decode_block_tables=tables[:b], decode_context_lens=lens[:b],
        prefill_block_tables=tables[b:], prefill_context_lens=lens[b:],
        prefill_cu_seqlens_q=torch.tensor([0, p], dtype=torch.int32, device=device),
        prefill_max_query_len=p)

    def split(out: torch.Tensor) -> None:
        td.paged_decode_attention(q[:b], k_cache, v_cache, meta.decode_block_tables,
                                  meta.decode_context_lens, scale, out=out[:b])
        tp.paged_prefill_attention(q[b:total], k_cache, v_cache, meta.prefill_block_tables,
                                   meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                                   scale, max_query_len=p, out=out[b:total])

    # The same step in a whole graph's metadata, filled as the engine fills it: every
    # sequence a chunk, padded to max_seqs, tables as wide as max_model_len.
    whole = _SequenceBuffers.allocate(max_seqs, math.ceil(case["table_ctx"] / 16), device)
    whole.fill(meta, total)

    def flat(out: torch.Tensor) -> None:
        tp.paged_prefill_attention(q, k_cache, v_cache, whole.block_tables,
                                   whole.cu_seqlens_q, whole.context_lens, scale, out=out)

    # A design not built: split-KV inside the whole graph. The decode kernel over the
    # graph's first rows (every row a sequence could be), with a fixed partition count and
    # no context past the step's decodes, into a scratch output; the flat grid with the
    # decodes' contexts emptied; then the decodes' rows taken from the scratch. Every
    # launch has the graph's shape, whatever the step's lengths.
    rows = min(padded, max_seqs)
    is_decode = torch.arange(max_seqs, device=device) < b
    decode_lens = torch.where(is_decode, whole.context_lens, 0)[:rows]
    prompt_lens = torch.where(is_decode, 0, whole.context_lens)
    scratch = torch.empty_like(q[:rows])

    def in_graph_split(out: torch.Tensor) -> None:
        td.paged_decode_attention(q[:rows], k_cache, v_cache, whole.block_tables[:rows],
                                  decode_lens, scale, splits=IN_GRAPH_SPLITS, out=scratch)
        tp.paged_prefill_attention(q, k_cache, v_cache, whole.block_tables,
                                   whole.cu_seqlens_q, prompt_lens, scale, out=out)
        torch.where(is_decode[:rows, None, None], scratch, out[:rows], out=out[:rows])

    outs = [torch.zeros_like(q) for _ in range(3)]
    split(outs[0])
    flat(outs[1])
    in_graph_split(outs[2])
    diff = max((outs[0][:total].float() - other[:total].float()).abs().max().item()
               for other in outs[1:])
    return {**case, "split_ms": median_ms(lambda: split(outs[0]), device, reps),
            "flat_ms": median_ms(lambda: flat(outs[1]), device, reps),
            "in_graph_split_ms": median_ms(lambda: in_graph_split(outs[2]), device, reps),
            "max_abs_diff": diff}


def bench_store(tokens: int, hkv: int, d: int, dtype, device, reps: int) -> dict:
    k_cache, v_cache, _, _ = paged_caches(1, tokens * 2, 16, hkv, d, dtype, device)
    key = torch.randn(tokens, hkv, d, dtype=dtype, device=device)
    value = torch.randn(tokens, hkv, d, dtype=dtype, device=device)
    slots = torch.randperm(k_cache.shape[0] * 16, device=device)[:tokens]
    ms = median_ms(lambda: tk.store_kvcache(key, value, k_cache, v_cache, slots), device, reps)
    moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
    return {"tokens": tokens, "kv_heads": hkv, "d": d, "ms": ms, "gb_per_s": moved / ms / 1e6}


def bench_copy_blocks(layers: int, pairs: int, hkv: int, d: int, dtype, device, reps: int):
    shape = (layers, 2 * pairs + 8, 16, hkv, d)
    k_caches = torch.randn(shape, dtype=dtype, device=device)
    v_caches = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(shape[1], device=device)
    src, dst = order[:pairs], order[pairs : 2 * pairs]
    ms = median_ms(lambda: tk.copy_blocks(k_caches, v_caches, src, dst), device, reps)
    moved = 2 * 2 * layers * pairs * k_caches[0, 0].numel() * k_caches.element_size()
    return {"layers": layers, "pairs": pairs, "ms": ms, "gb_per_s": moved / ms / 1e6}


def mixed_cases() -> list[dict]:
    """gpu-check step 4's mixed step (64 decodes of ~300 tokens and a 400-token prompt), the
    same at 4,000-token contexts, and 4 decodes of 16k, on Qwen2.5-0.5B's heads (a 32k
    max_model_len); 64 x 4,000 on Llama-3-8B's (8k). 128 sequences: --max-num-seqs'
    default."""
    small, large = dict(heads=14, kv_heads=2, d=64), dict(heads=32, kv_heads=8, d=128)
    return [dict(seqs=64, ctx=300, prompt=400, **small, max_seqs=128, table_ctx=32768),
            dict(seqs=64, ctx=4000, prompt=400, **small, max_seqs=128, table_ctx=32768),
            dict(seqs=4, ctx=16000, prompt=400, **small, max_seqs=128, table_ctx=32768),
            dict(seqs=64, ctx=4000, prompt=400, **large, max_seqs=128, table_ctx=8192)]


def print_mixed(row: dict) -> dict:
    print(f"mixed {row['seqs']} x {row['ctx']} + {row['prompt']}, {row['heads']}/"
          f"{row['kv_heads']} heads, d={row['d']}: whole graph's flat grid "
          f"{row['flat_ms']:.3f} ms, eager split {row['split_ms']:.3f} ms "
          f"({row['flat_ms'] / row['split_ms']:.2f}x); split inside the whole graph "
          f"(not built) {row['in_graph_split_ms']:.3f} ms; outputs differ by at most "
          f"{row['max_abs_diff']:.2g}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a dry run, on CPU too")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    if args.quick:
        decode = [dict(seqs=4, ctx=40, heads=4, kv_heads=2, d=32),
                  dict(seqs=1, ctx=600, heads=4, kv_heads=2, d=32),  # splits in two
                  dict(seqs=2, ctx=300, heads=4, kv_heads=2, d=32, table_ctx=4096)]
        prefill = [dict(seqs=2, tokens=32, heads=4, kv_heads=2, d=32)]
        mixed = [dict(seqs=3, ctx=300, prompt=40, heads=4, kv_heads=2, d=32, max_seqs=8,
                      table_ctx=1024)]
        copy_bytes, store, blocks, reps = 1 << 20, (64, 2, 32), (2, 8, 2, 32), 3
    else:
        decode = [dict(seqs=256, ctx=2048, heads=32, kv_heads=8, d=128),  # Llama-3-8B heads
                  dict(seqs=64, ctx=8192, heads=32, kv_heads=8, d=128),
                  # gpu-check step 4's long decode step, as its decode graph calls it
                  dict(seqs=64, ctx=4000, heads=14, kv_heads=2, d=64, table_ctx=32768),
                  dict(seqs=256, ctx=1024, heads=14, kv_heads=2, d=64)]  # Qwen2.5-0.5B heads
        prefill = [dict(seqs=4, tokens=2048, heads=32, kv_heads=8, d=128),
                   dict(seqs=16, tokens=512, heads=14, kv_heads=2, d=64)]
        mixed = mixed_cases()
        copy_bytes, store, blocks, reps = 4 << 30, (16384, 8, 128), (32, 512, 8, 128), args.reps

    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), device, reps)
    copy_gbps = 2 * copy_bytes / copy_ms / 1e6
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "copy_gb_per_s": copy_gbps, "decode": [],
               "prefill": []}
    print(f"{results['device']}: device copy {copy_gbps:,.0f} GB/s (read + write)")
    for i, case in enumerate(decode):
        row = bench_decode(case, dtype, device, reps, with_reference=i == len(decode) - 1)
        row["fraction_of_copy"] = row["gb_per_s"] / copy_gbps
        results["decode"].append(row)
        ref = f", reference {row['reference_ms']:.2f} ms" if "reference_ms" in row else ""
        if "no_split_ms" in row:
            ref += (f"; unsplit {row['no_split_ms']:.3f} ms = "
                    f"{row['no_split_gb_per_s'] / copy_gbps:.0%} of copy")
        print(f"decode {case}, {row['splits']} partition(s): {row['triton_ms']:.3f} ms, "
              f"{row['kv_gb']:.2f} GB K/V, {row['gb_per_s']:,.0f} GB/s = "
              f"{row['fraction_of_copy']:.0%} of copy{ref}")
    for case in prefill:
        row = bench_prefill(case, dtype, device, reps)
        results["prefill"].append(row)
        print(f"prefill {case}: {row['triton_ms']:.3f} ms = {row['triton_tflops']:.1f} TFLOP/s;"
              f" SDPA {row['sdpa_ms']:.3f} ms = {row['sdpa_tflops']:.1f} TFLOP/s")
    for case in mixed:
        results.setdefault("mixed", []).append(print_mixed(bench_mixed(case, dtype, device,
                                                                       reps)))
    results["store"] = bench_store(*store, dtype, device, reps)
    results["copy_blocks"] = bench_copy_blocks(*blocks, dtype, device, reps)
    for name in ("store", "copy_blocks"):
        row = results[name]
        print(f"{name}: {row['ms']:.3f} ms, {row['gb_per_s']:,.0f} GB/s "
              f"= {row['gb_per_s'] / copy_gbps:.0%} of copy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
