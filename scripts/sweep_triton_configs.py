"""The Triton attention kernels over a grid of launch configs on a CUDA GPU: the measurement
the launchers' fixed configs (decode.py, prefill.py) are chosen from.

    python scripts/sweep_triton_configs.py --json OUT [--workers 12] [--budget-s 150]
    TRITON_INTERPRET=1 python scripts/sweep_triton_configs.py --quick   # a CPU dry run

- decode: (key tile, warps, stages) at the launcher's partition count, then the best of
  those at other partition counts; GB/s of K/V read against the device copy bandwidth
  measured in the same run;
- prefill: (query tile, key tile, warps, stages), each head alone or a query group packed
  per program; TFLOP/s against torch SDPA on the same tokens laid out densely.
Compiling is most of a sweep's time, so worker processes compile every config first (into
Triton's on-disk cache), then this process times them one by one, alone on the GPU.
Each time is triton.testing.do_bench's median (L2 flushed between runs). A config that
fails to compile or launch (shared memory, say) is recorded with its error."""

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_triton_kernels import median_ms, paged_caches  # noqa: E402

from pagedserve.kernels.triton import decode as td  # noqa: E402
from pagedserve.kernels.triton import prefill as tp  # noqa: E402

DECODE = [dict(seqs=64, ctx=300, heads=14, kv_heads=2, d=64),  # the profiled engine step
          dict(seqs=256, ctx=1024, heads=14, kv_heads=2, d=64),  # Qwen2.5-0.5B heads
          dict(seqs=256, ctx=2048, heads=32, kv_heads=8, d=128),  # Llama-3-8B heads
          dict(seqs=64, ctx=8192, heads=32, kv_heads=8, d=128),
          dict(seqs=8, ctx=8192, heads=32, kv_heads=8, d=128)]  # few programs: split-KV
PREFILL = [dict(seqs=16, tokens=512, heads=14, kv_heads=2, d=64),
           dict(seqs=4, tokens=2048, heads=32, kv_heads=8, d=128)]
DECODE_GRID = [dict(block_n=n, num_warps=w, num_stages=s)
               for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3))]
PREFILL_GRID = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                for (m, n), w, s in itertools.product(
                    ((64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128)),
                    (4, 8), (1, 2, 3, 4))]
# Query heads packed per program (prefill.py's pack_group): not yet timed on a GPU.
PREFILL_GRID += [dict(block_m=m, block_n=n, num_warps=w, num_stages=s, pack_group=True)
                 for m, n, w, s in itertools.product((64, 128), (32, 64), (4, 8), (2,))]
SPLITS = (1, 2, 4, 8, 16)
QUICK_DECODE = [dict(seqs=2, ctx=40, heads=4, kv_heads=2, d=32)]
QUICK_PREFILL = [dict(seqs=2, tokens=32, heads=4, kv_heads=2, d=32)]
QUICK_DECODE_GRID = [dict(block_n=16, num_warps=4, num_stages=2),
                     dict(block_n=32, num_warps=2, num_stages=1)]
QUICK_PREFILL_GRID = [dict(block_m=16, block_n=16, num_warps=4, num_stages=2),
                      dict(block_m=16, block_n=16, num_warps=4, num_stages=2, pack_group=True)]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _decode_call(case: dict, dtype: torch.dtype):
    b, ctx, h, hkv, d = case["seqs"], case["ctx"], case["heads"], case["kv_heads"], case["d"]
    device = _device()
    torch.manual_seed(0)
    k_cache, v_cache, tables, lens = paged_caches(b, ctx, 16, hkv, d, dtype, device)
    q = torch.randn(b, h, d, dtype=dtype, device=device)
    kv_bytes = 2 * b * ctx * hkv * d * k_cache.element_size()
    return (lambda **cfg: td.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                    d**-0.5, **cfg)), kv_bytes


def _prefill_call(case: dict, dtype: torch.dtype):
    b, n, h, hkv, d = case["seqs"], case["tokens"], case["heads"], case["kv_heads"], case["d"]
    device = _device()
    torch.manual_seed(0)
    k_cache, v_cache, tables, lens = paged_caches(b, n, 16, hkv, d, dtype, device)
    q = torch.randn(b * n, h, d, dtype=dtype, device=device)
    cu = torch.arange(0, b + 1, dtype=torch.int32, device=device) * n
    flops = 4 * b * h * d * n * (n + 1) / 2
    return (lambda **cfg: tp.paged_prefill_attention(
        q, k_cache, v_cache, tables, cu, lens, d**-0.5, max_query_len=n, **cfg)), flops, (q, tables)


def _compile(job: tuple[str, dict, list[dict]]) -> list[str | None]:
    """In a worker: launches each config once (compiling it into Triton's cache)."""
    kind, case, configs = job
    call = (_decode_call if kind == "decode" else _prefill_call)(case, torch.bfloat16)[0]
    errors = []
    for cfg in configs:
        try:
            call(**cfg)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 (recorded, and the sweep goes on)
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return errors


def _time_ms(fn) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
    return median_ms(fn, torch.device("cpu"), 3)


def precompile(jobs: list[tuple[str, dict, list[dict]]], workers: int) -> None:
    start = time.perf_counter()
    chunks = [(kind, case, configs[i::workers]) for kind, case, configs in jobs
              for i in range(workers) if configs[i::workers]]
    if workers <= 1:
        list(map(_compile, chunks))
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            list(pool.map(_compile, chunks))
    print(f"compiled {sum(len(c) for _, _, c in chunks)} configs in "
          f"{time.perf_counter() - start:.0f} s with {workers} workers", flush=True)


def measure(fn, **cfg) -> tuple[float | None, str | None]:
    try:
        return _time_ms(lambda: fn(**cfg)), None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def sweep_decode(case: dict, grid: list[dict], copy_gbps: float, out) -> None:
    fn, kv_bytes = _decode_call(case, torch.bfloat16)
    rows = []
    for cfg in grid:
        ms, err = measure(fn, **cfg)
        rows.append({"kind": "decode", **case, **cfg, "splits": None, "ms": ms, "error": err})
    for splits in SPLITS:  # the best tile config at each forced partition count
        best = min((r for r in rows if r["ms"] and r["splits"] is None), key=lambda r: r["ms"])
        cfg = {k: best[k] for k in ("block_n", "num_warps", "num_stages")}
        ms, err = measure(fn, **cfg, splits=splits)
        rows.append({"kind": "decode", **case, **cfg, "splits": splits, "ms": ms, "error": err})
    for r in rows:
        if r["ms"]:
            r["gb_per_s"] = kv_bytes / r["ms"] / 1e6
            r["fraction_of_copy"] = r["gb_per_s"] / copy_gbps
        out.write(json.dumps(r) + "\n")
    _report(case, rows, "fraction_of_copy", "of copy")


def sweep_prefill(case: dict, grid: list[dict], out) -> None:
    fn, flops, (q, _) = _prefill_call(case, torch.bfloat16)
    b, n, h, hkv, d = case["seqs"], case["tokens"], case["heads"], case["kv_heads"], case["d"]
    dense_q = q.view(b, n, h, d).transpose(1, 2).contiguous()
    dense_kv = torch.randn(b, hkv, n, d, dtype=q.dtype, device=q.device)
    sdpa_ms = _time_ms(lambda: F.scaled_dot_product_attention(
        dense_q, dense_kv, dense_kv, is_causal=True, enable_gqa=True))
    rows = []
    for cfg in grid:
        ms, err = measure(fn, **cfg)
        row = {"kind": "prefill", **case, **cfg, "ms": ms, "error": err, "sdpa_ms": sdpa_ms}
        if ms:
            row["tflops"] = flops / ms / 1e9
            row["fraction_of_sdpa"] = sdpa_ms / ms
        rows.append(row)
        out.write(json.dumps(row) + "\n")
    print(f"  SDPA {sdpa_ms:.3f} ms = {flops / sdpa_ms / 1e9:.0f} TFLOP/s")
    _report(case, rows, "fraction_of_sdpa", "of SDPA")


def _report(case: dict, rows: list[dict], key: str, unit: str) -> None:
    ok = sorted((r for r in rows if r["ms"]), key=lambda r: r["ms"])
    failed = sum(1 for r in rows if not r["ms"])
    print(f"{case}: {len(ok)} configs timed, {failed} failed", flush=True)
    for r in ok[:5]:
        cfg = {k: r[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "splits",
                                 "pack_group")
               if k in r}
        print(f"  {r['ms']:.4f} ms = {r[key]:.0%} {unit}  {cfg}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="sweep.jsonl", help="rows appended here, one per line")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true", help="tiny shapes and grid: a dry run")
    ap.add_argument("--compile-only", action="store_true",
                    help="fill Triton's cache and stop (runs alongside other work)")
    ap.add_argument("--no-compile", action="store_true", help="the cache is already filled")
    args = ap.parse_args()
    device = _device()
    decode, prefill = (QUICK_DECODE, QUICK_PREFILL) if args.quick else (DECODE, PREFILL)
    dgrid, pgrid = ((QUICK_DECODE_GRID, QUICK_PREFILL_GRID) if args.quick
                    else (DECODE_GRID, PREFILL_GRID))
    workers = 1 if device.type == "cpu" else args.workers
    if not args.no_compile:
        precompile([("decode", c, dgrid) for c in decode]
                   + [("prefill", c, pgrid) for c in prefill], workers)
    if args.compile_only:
        return
    src = torch.empty((1 << 20) if args.quick else (4 << 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() / _time_ms(lambda: dst.copy_(src)) / 1e6
    print(f"device copy {copy_gbps:,.0f} GB/s (read + write)", flush=True)
    with open(args.json, "a") as out:
        out.write(json.dumps({"kind": "copy", "copy_gb_per_s": copy_gbps,
                              "device": torch.cuda.get_device_name() if device.type == "cuda"
                              else "cpu"}) + "\n")
        for case in prefill:
            sweep_prefill(case, pgrid, out)
            out.flush()
        for case in decode:
            sweep_decode(case, dgrid, copy_gbps, out)
            out.flush()


if __name__ == "__main__":
    main()
