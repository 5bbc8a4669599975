"""float32 GEMM rate at the model's linear shapes, per batch size: PyTorch's BLAS (MKL in
the CPU wheels), oneDNN with a packed weight, and numpy's bundled OpenBLAS, in one process,
best of N each. Where a decode step's time goes on CPUs without bf16 (docs/performance.md).

    .venv/bin/python scripts/bench_sgemm.py --threads 1

Shapes: SmolLM2-135M's qkv, o, gate_up and down projections (hidden 576, intermediate
1,536). Run it on an otherwise idle machine: with 2 threads on 2 shared vCPUs, a preempted
thread stalls every parallel region and the figures mean nothing."""

import argparse
import os
import time

from pagedserve.bench.machine import describe, machine_facts

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,32,64,128,256,1024")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # before numpy loads OpenBLAS
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    print(describe(machine_facts()), f"| {args.threads} thread(s) | GFLOP/s over one layer")

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    print(f"{'rows':>5} {'torch (MKL)':>12} {'oneDNN packed':>14} {'numpy (OpenBLAS)':>17}")
    for m in (int(r) for r in args.rows.split(",")):
        flops, t_mkl, t_dnn, t_obl = 0, 0.0, 0.0, 0.0
        for n, k in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            out = torch.empty(m, n)
            xn, wt, on = x.numpy(), w.numpy().T, out.numpy()
            flops += 2 * m * n * k
            t_mkl += best(lambda: torch.nn.functional.linear(x, w))  # noqa: B023
            t_dnn += best(lambda: torch.ops.mkldnn._linear_pointwise(  # noqa: B023
                x, packed, None, "none", [], ""))  # noqa: B023
            t_obl += best(lambda: np.matmul(xn, wt, out=on))  # noqa: B023
        print(f"{m:>5} {flops / t_mkl / 1e9:>12.0f} {flops / t_dnn / 1e9:>14.0f} "
              f"{flops / t_obl / 1e9:>17.0f}")


if __name__ == "__main__":
    main()
