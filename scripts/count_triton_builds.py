"""The Triton kernel builds a `bench throughput` run on CUDA would meet, phase by phase,
counted on a CPU: the engine runs the Triton "flash" set under the interpreter with CUDA's
settings (16-token blocks; at start, the forwards the decode graphs run before capture, and
the engine's warm-up), then the bench's warm-up request, then the workload
(kernels/triton/specializations.py keys each launch as Triton's JIT keys a CUDA launch).

A build on the GPU takes seconds of CPU, paid by the step that needs it, so the "timed"
phase should count none (docs/performance-gpu.md). A 1-layer model with Qwen2.5-0.5B's KV
head count (what the split-KV choice reads) stands in for the real one: the keys depend on
the step's sizes and the KV head count, not on the widths.

    python scripts/count_triton_builds.py --workload mixed   # 10-30 min on 2 vCPUs
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from engine_utils import tiny_llama_with_embedded_tokenizer  # noqa: E402

from pagedserve.bench.workloads import WORKLOADS, build_workload  # noqa: E402
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedserve.engine.device_setup import default_max_num_batched_tokens  # noqa: E402
from pagedserve.kernels.triton import kernel_set  # noqa: E402
from pagedserve.kernels.triton.specializations import SpecializationRecorder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mixed", choices=[w for w in WORKLOADS if w != "custom"])
    p.add_argument("--no-warm-up", action="store_true", help="skip the engine's warm-up")
    args = p.parse_args()
    torch.set_num_threads(1)

    loaded = tiny_llama_with_embedded_tokenizer(num_layers=1, max_positions=32768)

    recorder = SpecializationRecorder()
    phases = {}
    with recorder.recording():
        engine = LLMEngine(EngineConfig(block_size=16, dtype="float32", enforce_eager=False,
                                        num_kv_blocks=4096, device="cpu",
                                        max_num_batched_tokens=default_max_num_batched_tokens(
                                            torch.device("cuda"))),
                           loaded=loaded, kernels=kernel_set("flash"))
        engine.runner.graphs.run_each_size()  # what DecodeGraphs runs before its captures
        if not args.no_warm_up:  # what LLMEngine runs on CUDA
            engine.runner.warm_up(engine.config.max_num_batched_tokens, engine.max_model_len)
        phases["start"], before = recorder.new_since({}), recorder.snapshot()

        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.add_request([loaded.config.vocab_size // 2] * 8, warm)  # the bench's warm-up
        while engine.has_unfinished_requests():
            engine.step()
        phases["bench warm-up"], before = recorder.new_since(before), recorder.snapshot()

        for r in build_workload(args.workload, loaded.config.vocab_size).requests:
            engine.add_request(r.prompt, SamplingParams(
                n=r.n, max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        phases["timed"] = recorder.new_since(before)
    print(json.dumps({"workload": args.workload, "steps": steps, "warm_up": not args.no_warm_up,
                      "builds": phases}, indent=1))


if __name__ == "__main__":
    main()
