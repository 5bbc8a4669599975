"""The host cost per token of one long stream: each engine step's time outside the model's
forward (scheduling, sampling, postprocess, outputs), early in the stream and late in it.
A per-step cost that grows with the stream's length shows as a late/early ratio above 1.

    python scripts/stream_cost.py [--tokens 4000] [--window 500] [--no-native-kernels]
"""

import argparse
import statistics
import time

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.models.loader import load_model_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--native-kernels", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model_files(None, torch.float32)
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=512,
                                    native_kernels=args.native_kernels), loaded=loaded)
    forward_s: list[float] = []
    execute = engine.runner.execute

    def timed_execute(batch, carried=None):
        start = time.perf_counter()
        logits = execute(batch, carried)
        forward_s.append(time.perf_counter() - start)
        return logits

    engine.runner.execute = timed_execute
    # Logprobs and a stop string that never matches: every per-token path is exercised.
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True,
                            logprobs=1, stop=["@@@@ never @@@@"])
    engine.add_request(loaded.tokenizer.encode("Tell me a very long story."), params)
    host_s: list[float] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        host_s.append(time.perf_counter() - start - forward_s[-1])
    early = statistics.median(host_s[1 : 1 + args.window]) * 1e6
    late = statistics.median(host_s[-args.window :]) * 1e6
    print(f"{len(host_s)} steps; host time per step (median) over the first {args.window} "
          f"tokens: {early:.0f} us, over the last {args.window}: {late:.0f} us; "
          f"late/early {late / early:.2f}")


if __name__ == "__main__":
    main()
