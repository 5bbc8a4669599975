"""bench tooling: statistics, FLOP counting, arrivals, workloads, the throughput command on
tiny workloads (well-formed JSON, exact token counts; never a speed), and the README table.
The serve command: test_bench_serve*.py."""

import json
import math

import numpy as np
import pytest

from pagedserve.bench import report
from pagedserve.bench.roofline import EngineFlopCounter, FlopCount, linear_macs_per_token
from pagedserve.bench.serve_client import arrival_offsets
from pagedserve.bench.stats import percentile, summarize
from pagedserve.bench.workloads import build_workload, id_range, serve_dataset
from pagedserve.cli import main
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.models.config import ModelConfig

# ---- pure helpers --------------------------------------------------------------------------


def test_percentiles_match_numpy():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([4.0], 99) == 4.0
    assert math.isnan(percentile([], 50))
    s = summarize([0.001, 0.002, 0.003, 0.004], scale=1e3)
    assert s == pytest.approx({"mean": 2.5, "median": 2.5, "p90": 3.7, "p99": 3.97})
    assert summarize([]) == {"mean": None, "median": None, "p90": None, "p99": None}


TINY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=2)


def sequence_flops(cfg: ModelConfig, prompt_len: int, output_len: int,
                   cached: int = 0) -> FlopCount:
    """The analytic count of one sequence run alone: one prefill of the uncached prompt
    tokens (one logits row), then output_len - 1 decode steps (the last sampled token is
    never fed back)."""
    count = FlopCount()
    count.add_chunk(cfg, cached, prompt_len - cached, prompt_len)
    for i in range(output_len - 1):
        count.add_chunk(cfg, prompt_len + i, 1, prompt_len)
    return count


def test_flops_against_hand_computation():
    # Per layer: qkv 4*(4+2+2)=32, o 4*4=16, gate+up+down 3*4*8=96 -> 144 MACs; 2 layers.
    assert linear_macs_per_token(TINY) == 288
    c = sequence_flops(TINY, prompt_len=3, output_len=2)
    # Tokens processed: 3 prompt + 1 fed-back token (the last sampled one never is).
    assert (c.prefill_tokens, c.decode_tokens, c.logit_rows) == (3, 1, 2)
    assert c.linear == 4 * 2 * 288
    # Contexts 1+2+3 (prefill) + 4 (decode); 2*2*ctx*H*d per layer = 8*ctx per layer.
    assert c.attention == 2 * 2 * (1 + 2 + 3 + 4) * 2 * 2 * 2
    assert c.lm_head == 2 * (2 * 4 * 10)
    assert c.total == 2304 + 320 + 160
    cached = sequence_flops(TINY, prompt_len=3, output_len=1, cached=2)  # one token computed
    assert cached.as_dict() == {"linear": 576, "attention": 3 * 32, "lm_head": 80,
                                "prefill_tokens": 1, "decode_tokens": 0, "logit_rows": 1,
                                "total": 576 + 96 + 80}


def test_engine_flop_counter_matches_analytic_count(tiny_llama):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, dtype="float32"), loaded=tiny_llama)
    counter = EngineFlopCounter(engine, tiny_llama.config)
    engine.add_request(list(range(100, 137)),
                       SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    expected = sequence_flops(tiny_llama.config, 37, 5)
    assert counter.count == expected
    assert counter.forwards == 5 and counter.execute_s > 0
    assert engine.stats()["prefill_tokens_computed"] == expected.prefill_tokens


def test_arrival_statistics_with_fixed_seed():
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    for shape in (1.0, 0.25, 4.0):  # Poisson, bursty, regular
        offsets = arrival_offsets(20000, rate=10.0, burstiness=shape, seed=1)
        assert offsets[0] == 0.0 and offsets == sorted(offsets)
        gaps = np.diff(offsets)
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(shape), rel=0.05)
    assert arrival_offsets(50, 3.0, seed=7) == arrival_offsets(50, 3.0, seed=7)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_workloads_are_fixed_and_shaped_as_specified():
    mixed = build_workload("mixed", 49152)
    assert len(mixed.requests) == 64
    assert all(64 <= r.prompt_len <= 512 and r.output_len == 128 for r in mixed.requests)
    lo, hi = id_range(49152)
    assert all(lo <= t < hi for r in mixed.requests for t in r.prompt)
    assert build_workload("mixed", 49152).requests == mixed.requests  # fixed seed
    shared = build_workload("shared-prefix", 49152).requests
    assert len(shared) == 32 and all(len(r.prompt) == 1536 + 32 for r in shared)
    assert len({tuple(r.prompt[:1536]) for r in shared}) == 1
    assert len({tuple(r.prompt[1536:]) for r in shared}) == 32
    fork = build_workload("fork", 49152).requests
    assert [(len(r.prompt), r.n, r.output_len) for r in fork] == [(1024, 16, 64)] * 4
    decode = build_workload("decode-heavy", 49152, num_prompts=3, output_len=7).requests
    assert len(decode) == 3 and all(16 <= len(r.prompt) <= 64 and r.output_len == 7
                                    for r in decode)


def test_serve_datasets(tmp_path):
    rand = serve_dataset("random", 200, 100, 8, range_ratio=0.5, vocab_size=1000)
    lengths = [len(r.prompt) for r in rand]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 20
    shared = serve_dataset("shared-prefix", 3, 5, 8, prefix_len=10, as_text=True)
    assert all(len(r.prompt.split()) == 15 for r in shared)
    assert len({" ".join(r.prompt.split()[:10]) for r in shared}) == 1
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 3}\n\n{"prompt": [1, 2, 3]}\n')
    rows = serve_dataset(str(path), 10, 1, 9)
    assert [(r.prompt, r.output_len) for r in rows] == [("hello there", 3), ([1, 2, 3], 9)]
    with pytest.raises(ValueError, match="chat endpoint"):
        serve_dataset(str(path), 10, 1, 9, as_text=True)
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=":1:"):
        serve_dataset(str(path), 10, 1, 9)


# ---- bench throughput ----------------------------------------------------------------------


def _throughput(tmp_path, model_dir, *args: str) -> dict:
    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--model", str(model_dir), "--num-kv-blocks", "128",
               "--dtype", "float32",
               "--probe-reps", "1", "--json", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


def test_throughput_tiny_with_hf_baseline(tmp_path, tiny_llama_dir, capsys):
    r = _throughput(tmp_path, tiny_llama_dir, "--workload", "mixed", "--num-prompts", "2",
                    "--input-len", "8", "--output-len", "4", "--baseline", "hf",
                    "--hf-batch-sizes", "1,2")
    assert "pagedserve / HF" in capsys.readouterr().out
    (run,) = r["runs"]
    assert (run["num_requests"], run["prompt_tokens"], run["output_tokens"]) == (2, 16, 8)
    assert run["stats"]["prefill_tokens_computed"] == 16
    assert run["stats"]["output_tokens"] == 8
    flops = run["roofline"]["flops"]
    assert (flops["prefill_tokens"], flops["decode_tokens"], flops["logit_rows"]) == (16, 6, 8)
    assert 0 < run["roofline"]["achieved_fraction"] < math.inf
    assert run["wall_s"] > 0 and run["ttft_ms"]["median"] > 0
    assert r["probe"]["peak_gflops"] > 0
    hf = r["hf_baseline"]
    assert [h["batch_size"] for h in hf["runs"]] == [1, 2]
    assert all(h["rows"] == 2 and h["output_tokens"] == 8 for h in hf["runs"])
    assert hf["ratio_output_tokens_per_s"] > 0
    bound = r["runs"][0]["roofline"]["bound_s"]
    assert hf["best_roofline_fraction"] == pytest.approx(
        bound / hf["best"]["estimated_full_wall_s"])
    assert hf["first_row_agrees"] is True  # the same weights in transformers' model


def test_throughput_repeats_take_fresh_prompts_on_one_engine(tmp_path, tiny_llama_dir):
    """--repeats 3: three timed parts, each with prompts of its own seed (none served from
    the prefix cache, though each prompt fills whole blocks), counted per part; the run
    reports the median one, and HF's first row is still checked against the --seed set."""
    r = _throughput(tmp_path, tiny_llama_dir, "--workload", "mixed", "--num-prompts", "2",
                    "--input-len", "40", "--output-len", "4", "--repeats", "3",
                    "--baseline", "hf", "--hf-batch-sizes", "1")
    (run,) = r["runs"]
    assert len(run["repeats"]) == 3
    assert run["output_tokens_per_s"] == sorted(run["repeats"])[1]
    assert run["stats"]["prefix_cache_hit_tokens"] == 0
    assert (run["stats"]["prefill_tokens_computed"], run["stats"]["output_tokens"]) == (80, 8)
    assert run["roofline"]["flops"]["prefill_tokens"] == 80
    assert r["hf_baseline"]["first_row_agrees"] is True


def test_hf_agreement_is_only_claimed_from_an_unpadded_row(tmp_path, tiny_llama_dir, capsys):
    """Without batch size 1 the first row is generated inside a padded batch, where bf16
    rounding alone can flip a greedy token: the check reports itself as not made."""
    r = _throughput(tmp_path, tiny_llama_dir, "--workload", "mixed", "--num-prompts", "2",
                    "--input-len", "8", "--output-len", "4", "--baseline", "hf",
                    "--hf-batch-sizes", "2")
    assert r["hf_baseline"]["first_row_agrees"] is None
    assert "first row tokens agree: not checked" in capsys.readouterr().out


def test_throughput_shared_prefix_and_fork_token_counts(tmp_path, tiny_llama_dir):
    r = _throughput(tmp_path, tiny_llama_dir, "--workload", "shared-prefix", "--num-prompts",
                    "3", "--prefix-len", "32", "--input-len", "4", "--output-len", "2")
    on, off = r["runs"]
    assert (on["enable_prefix_caching"], off["enable_prefix_caching"]) == (True, False)
    assert off["stats"]["prefill_tokens_computed"] == 3 * 36
    assert on["stats"]["prefill_tokens_computed"] < off["stats"]["prefill_tokens_computed"]
    ratio = r["comparison"]["prefill_tokens_computed"]["ratio"]
    assert ratio == off["stats"]["prefill_tokens_computed"] / on["stats"][
        "prefill_tokens_computed"]
    assert r["comparison"]["ttft_p50_ms"]["ratio"] > 0

    r = _throughput(tmp_path, tiny_llama_dir, "--workload", "fork", "--num-prompts", "2",
                    "--input-len", "20", "--n", "3", "--output-len", "2")
    fork, single = r["runs"]
    assert (fork["num_requests"], single["num_requests"]) == (2, 6)
    assert fork["output_tokens"] == single["output_tokens"] == 12
    assert fork["stats"]["prefill_tokens_computed"] == 40
    assert single["stats"]["prefill_tokens_computed"] == 120
    assert r["comparison"]["prefill_tokens_computed"]["ratio"] == 3.0


# ---- README table --------------------------------------------------------------------------


def test_report_writes_readme_table_between_markers(tmp_path):
    thr = tmp_path / "01-thr.json"
    srv = tmp_path / "02-serve.json"
    fake_run = {"label": "pagedserve", "num_requests": 2, "wall_s": 1.5,
                "output_tokens_per_s": 10.0, "total_tokens_per_s": 20.0,
                "ttft_ms": {"median": 3.0}, "stats": {"prefill_tokens_computed": 16},
                "roofline": {"achieved_fraction": 0.25}}
    thr.write_text(json.dumps({
        "bench": "throughput", "workload": "mixed", "model": "m", "dtype": "float32",
        "device": "cpu", "threads": 1, "runs": [fake_run],
        "hf_baseline": {"ratio_output_tokens_per_s": 2.0,
                        "best": {"batch_size": 8, "output_tokens_per_s": 5.0}}}))
    stats = {"mean": 1.0, "median": 2.0, "p90": 3.0, "p99": 4.0}
    srv.write_text(json.dumps({
        "bench": "serve", "dataset": "random", "completed": 4, "num_prompts": 4,
        "max_concurrency": 64, "request_throughput": 1.0, "output_throughput": 9.0,
        "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats, "e2el_ms": stats}))
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nintro\n")
    report.main(["--readme", str(readme), str(thr), str(srv)])
    text = readme.read_text()
    assert text.startswith("# title\n\nintro\n\n## Performance\n\n<!-- perf:start -->\n")
    assert text.endswith("<!-- perf:end -->\n")
    assert "| mixed | pagedserve | 2 | 1.5 | 10.0 | 20.0 | 3.0 | 16 | 25.0% | 2.00x" in text
    # 9.0 online over 10.0 offline (mixed): the serving ratio
    assert "| random | 4/4 | 64 | 1.00 | 9.0 | 90% | 2.0 | 4.0 | 2.0 | 4.0 | 2.0 |" in text

    readme.write_text("# t\n\n## Performance\n\n<!-- perf:start -->\nold\n<!-- perf:end -->\n"
                      "\n## After\n")
    report.main(["--readme", str(readme), str(thr)])
    report.main(["--readme", str(readme), str(thr)])  # idempotent
    text = readme.read_text()
    assert "old" not in text and text.count("## Performance") == 1
    assert text.count("<!-- perf:start -->") == 1
    assert text.endswith("<!-- perf:end -->\n\n## After\n")
    assert "| mixed | pagedserve |" in text and "| random |" not in text



def test_the_readme_section_is_dated_by_its_results_not_by_today(tmp_path):
    """A regenerated section keeps the dates its results were measured on (each result file
    carries the day it was written); a section from results of no date gives none."""
    import datetime

    def thr(date: str | None) -> dict:
        result = {"bench": "throughput", "workload": "mixed", "model": "m", "dtype": "float32",
                  "device": "cpu", "threads": 1, "runs": []}
        return result if date is None else {**result, "date": date}

    assert "(2026-01-02)" in report.performance_section([thr("2026-01-02"), thr("2026-01-02")])
    assert "(2026-01-02 to 2026-02-03)" in report.performance_section(
        [thr("2026-02-03"), thr("2026-01-02")])
    assert "Generated by `make bench`; regenerate" in report.performance_section([thr(None)])
    path = tmp_path / "result.json"
    report.write_json(str(path), thr(None))
    assert json.loads(path.read_text())["date"] == datetime.date.today().isoformat()
