"""What a request's sampling parameters cost a decode step: the embedded model in-process,
64 chat prompts decoding together, the median step once all of them run, for each case in
turn (greedy, temperature 1, top_p, penalties, logprobs), the cases alternated over passes.
Greedy is the baseline of the same run.

    python scripts/bench_sampling.py [--seqs 64] [--tokens 48] [--passes 2]
"""

import argparse
import statistics
import time

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
# isort: on

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "temperature 1, top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "temperature 1, top_k 50 + top_p 0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
    "temperature 1, min_p 0.05 + top_p 0.9": dict(temperature=1.0, min_p=0.05, top_p=0.9),
    "temperature 1, presence 0.5 + frequency 0.3": dict(
        temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3),
    "greedy, repetition 1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "greedy, logprobs 5": dict(temperature=0.0, logprobs=5),
}
TOPICS = ["the ocean", "a robot who learns to paint", "the history of Rome", "how to bake bread",
          "quantum computing", "a dragon and a knight", "the stock market", "climate change"]


def decode_steps(engine: LLMEngine, prompts: list[list[int]], params: dict, tokens: int
                 ) -> list[float]:
    """Seconds of each step in which every sequence decodes."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i,
                                                  **params))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        running = engine.scheduler.running
        if len(running) == len(prompts) and all(s.num_output_tokens > 1 for s in running):
            steps.append(elapsed)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(max_num_seqs=args.seqs, max_num_batched_tokens=4096))
    prompts = [engine.tokenizer.apply_chat_template([{
        "role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}, "
                                   f"part {i}."}]) for i in range(args.seqs)]
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.passes):
        for name, params in CASES.items():
            times[name] += decode_steps(engine, prompts, params, args.tokens)
    greedy = statistics.median(times["greedy"])
    for name, steps in times.items():
        median = statistics.median(steps)
        print(f"{name:45s} median decode step {median * 1e3:6.1f} ms "
              f"({median / greedy:.2f}x greedy, {len(steps)} steps)")


if __name__ == "__main__":
    main()
