"""What aborting N queued requests costs: one abort_request call per request (what the server
did when a client left a request of N prompts) against one call with the list (what it does
now). Both in the same run, on the embedded model's engine; nothing is stepped.

    .venv/bin/python scripts/bench_abort.py --requests 10000 30000
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.models.loader import load_model_files


def timed_abort(engine: LLMEngine, n: int, one_call: bool) -> float:
    params = SamplingParams(max_tokens=1)
    ids = [engine.add_request([1], params) for _ in range(n)]
    start = time.perf_counter()
    if one_call:
        engine.abort_request(ids)
    else:
        for request_id in ids:
            engine.abort_request(request_id)
    elapsed = time.perf_counter() - start
    engine.step()  # takes the aborted requests' final outputs
    assert not engine.has_unfinished_requests()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[10_000, 30_000])
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, block_size=16),
                       loaded=load_model_files(None, torch.float32))
    for n in args.requests:
        each = timed_abort(engine, n, one_call=False)
        once = timed_abort(engine, n, one_call=True)
        print(f"{n:>7} requests: a call each {each:8.3f} s, one call {once:8.3f} s "
              f"({each / once:,.0f}x)")


if __name__ == "__main__":
    main()
