"""The side-by-side harness (scripts/ab_peer.sh, pagedserve/bench/peer.py) end to end: real
servers on loopback, the real `bench serve` client, the summary and the README table.

vLLM's CPU build is too heavy to install in CI, so the peer here is a second `pagedserve
serve` started through a stand-in for the peer tool: the harness, the alternation and the
summary are what is tested, not vLLM."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.bench import report
from pagedserve.bench.machine import describe, machine_facts
from pagedserve.bench.peer import PEER_WORKLOADS, serve_args
from pagedserve.bench.serve_client import add_serve_bench_args
from pagedserve.bench.workloads import SPECS, serve_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("workload", PEER_WORKLOADS)
def test_serve_args_reproduce_the_offline_workload(workload: str) -> None:
    """The flags, parsed by `bench serve` itself, draw requests of the offline spec's shape."""
    import argparse

    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    args = p.parse_args(["--base-url", "http://x", *serve_args(workload)])
    spec = SPECS[workload]
    requests = serve_dataset(args.dataset, args.num_prompts, args.input_len, args.output_len,
                             args.range_ratio, args.prefix_len, args.seed, args.vocab_size)
    lo, hi = spec.input_len
    lengths = [len(r.prompt) - spec.prefix_len for r in requests]
    assert len(requests) == spec.num_prompts == args.max_concurrency
    assert {r.output_len for r in requests} == {spec.output_len} and args.ignore_eos
    assert lo - 1 <= min(lengths) and max(lengths) <= hi
    assert max(lengths) - min(lengths) >= (hi - lo) * 0.8  # spans the range


def test_machine_facts_name_the_cpu_and_its_isa() -> None:
    facts = machine_facts()
    assert facts["cpu"] and facts["logical_cpus"] >= 1
    if sys.platform == "linux":
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
        assert ("avx2" in facts["isa"]) == (" avx2" in flags)
        if "cpu family" in Path("/proc/cpuinfo").read_text():  # x86: the generation too
            assert facts["family"] >= 1 and f"family {facts['family']}," in describe(facts)
    text = describe({"cpu": "X", "logical_cpus": 2, "isa": ["avx2", "fma"]})
    assert text == "X, 2 logical CPUs, avx2 fma (no AVX-512, no AMX)"
    text = describe({"cpu": "X", "family": 26, "model": 2, "logical_cpus": 2, "isa": ["avx2"]})
    assert text == "X (family 26, model 2), 2 logical CPUs, avx2 (no AVX-512, no AMX)"


STAND_IN = """#!/usr/bin/env bash
# The peer tool's interface (serve PORT WEIGHTS [args] | stop | name WEIGHTS), serving
# pagedserve instead; it names itself only where PEER_LABEL is set (as vLLM's tool does not).
set -euo pipefail
case "$1" in
  serve)
    # What vLLM would read to pick its kernels, and the cap it would run under.
    "$PYTHON" -c "import os, torch; print(torch.cpu._is_avx512_supported(), \\
        torch.cpu._is_amx_tile_supported(), os.environ.get('ONEDNN_MAX_CPU_ISA'))" \\
        > "$STATE/peer-isa.txt"
    echo "$3" >> "$STATE/peer-isa.txt"
    "$PAGEDSERVE" serve --port "$2" --dtype "$3" --model "$MODEL" --log-level warning \\
        > "$STATE/peer.log" 2>&1 &
    echo $! > "$STATE/peer.pid"
    for _ in $(seq 600); do
      "$PYTHON" -c "import httpx; httpx.get('http://127.0.0.1:$2/health').raise_for_status()" \\
          2> /dev/null && exit 0
      sleep 0.2
    done
    exit 1 ;;
  stop) kill "$(cat "$STATE/peer.pid")"; while kill -0 "$(cat "$STATE/peer.pid")" 2> /dev/null;
        do sleep 0.1; done ;;
  name) [[ -n ${PEER_LABEL:-} ]] && echo "$PEER_LABEL, $2 weights" || exit 2 ;;
esac
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_harness(tmp_path: Path, model_dir: Path, out: str, **knobs: str) -> str:
    """scripts/ab_peer.sh on the shared-prefix workload, the stand-in as the peer and this
    checkout's CLI as pagedserve; its stderr."""
    tool = tmp_path / "peer-tool.sh"
    tool.write_text(STAND_IN)
    bindir = Path(sys.executable).parent
    pagedserve = tmp_path / "pagedserve"  # the CLI of this checkout, whatever is installed
    pagedserve.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pagedserve.cli "$@"\n')
    pagedserve.chmod(0o755)
    env = {**os.environ, "PYTHON": sys.executable, "PAGEDSERVE": str(pagedserve),
           "PEER_TOOL": str(tool), "STATE": str(tmp_path), "MODEL": str(model_dir),
           "AB_OUT": str(tmp_path / "results" / out), "AB_PORT": str(_free_port()),
           "AB_WORKLOADS": "shared-prefix", "AB_SERVER_ARGS": f"--model {model_dir}",
           "PEER_DIR": str(tmp_path),
           # The harness is what is tested, not the servers: a short load.
           "AB_BENCH_ARGS": "--num-prompts 8 --output-len 8",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", **knobs}
    result = subprocess.run(["bash", str(REPO / "scripts/ab_peer.sh")], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.slow
def test_ab_harness_alternates_servers_and_summarizes(tmp_path, tiny_llama_dir) -> None:
    summary_path = tmp_path / "results" / "12-peer.json"  # AB_SUMMARY: not 10-peer.json
    stderr = _run_harness(tmp_path, tiny_llama_dir, "peer", AB_ROUNDS="2", AB_DTYPE="float32",
                          AB_SUMMARY=str(summary_path))
    # Round 1 runs pagedserve first, round 2 the peer first.
    order = [line.split(": ")[-1] for line in stderr.splitlines()
             if line.startswith("== shared-prefix, round")]
    assert order == ["pagedserve", "peer", "peer", "pagedserve"]
    assert not (tmp_path / "results" / "10-peer.json").exists()
    summary = json.loads(summary_path.read_text())
    [row] = summary["workloads"]
    assert row["workload"] == "shared-prefix" and row["rounds"] == 2
    for side in ("pagedserve", "peer"):
        assert row[side]["failed"] == 0 and len(row[side]["output_throughput"]) == 2
    assert row["ratio"] == pytest.approx(row["pagedserve"]["median_output_throughput"]
                                         / row["peer"]["median_output_throughput"])
    assert summary["machine"] == machine_facts()
    section = report.performance_section([summary])
    assert "Side by side with vLLM" in section and describe(machine_facts()) in section
    assert f"{row['ratio']:.2f}x" in section


def test_avx2_host_hides_wide_vectors_from_torch() -> None:
    """scripts/avx2_host on PYTHONPATH: torch.cpu reports no AVX-512 and no AMX (what vLLM's
    CPU build reads to load its AVX2 kernels); AVX2 itself is still reported as it is."""
    probe = ("import torch; c = torch.cpu; print(c._is_avx512_supported(), "
             "c._is_avx512_bf16_supported(), c._is_amx_tile_supported(), c._is_avx2_supported())")
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts" / "avx2_host")}
    held = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, check=True).stdout.split()
    import torch

    assert held == ["False", "False", "False", str(torch.cpu._is_avx2_supported())]


@pytest.mark.slow
def test_ab_harness_holds_both_servers_to_avx2(tmp_path, tiny_llama_dir) -> None:
    """AB_HOLD_AVX2=1: float32, the caps exported to both servers, the peer shown no
    AVX-512, and a summary of its own that the README table marks as held. The peer here
    is one that names itself (as the llama-server tool does) and gets AB_PEER_WEIGHTS,
    not pagedserve's dtype."""
    # No x86-64-v3 build here (PAGEDSERVE_CPU_KERNELS=0): the references serve.
    _run_harness(tmp_path, tiny_llama_dir, "peer-avx2", AB_ROUNDS="1", AB_HOLD_AVX2="1",
                 PAGEDSERVE_CPU_KERNELS="0", AB_PEER_WEIGHTS="auto",
                 PEER_LABEL="stand-in llama-server")
    assert (tmp_path / "peer-isa.txt").read_text().split() == ["False", "False", "AVX2", "auto"]
    summary = json.loads((tmp_path / "results" / "11-peer-avx2.json").read_text())
    assert summary["held_to"] == "AVX2, float32"
    assert summary["peer"] == "stand-in llama-server, auto weights"
    assert not (tmp_path / "results" / "10-peer.json").exists()
    section = report.performance_section([summary])
    assert "both held to AVX2, float32 (`AB_HOLD_AVX2=1`" in section
    assert "Side by side with stand-in llama-server, auto weights" in section



def _serve_result(throughput: float, ttft_p50: float | None, completed: int = 4) -> dict:
    ttft = {"mean": ttft_p50, "median": ttft_p50, "p90": ttft_p50, "p99": ttft_p50}
    return {"bench": "serve", "completed": completed, "failed": 4 - completed,
            "output_throughput": throughput, "ttft_ms": ttft}


def test_summarize_skips_what_cannot_count_and_summarizes_the_rest(tmp_path, capsys) -> None:
    """A run in which nothing completed (0 tok/s, no TTFT), a run without a TTFT, a file not
    named WORKLOAD--SERVER--rK.json and a workload run on one server only: each skipped in
    one line (or left out of the TTFT median), not a traceback."""
    from pagedserve.bench import peer

    files = {"mixed--pagedserve--r1.json": _serve_result(100.0, 10.0),
             "mixed--pagedserve--r2.json": _serve_result(120.0, None),
             "mixed--peer--r1.json": _serve_result(50.0, 20.0),
             "mixed--peer--r2.json": _serve_result(0.0, None, completed=0),
             "notes.json": _serve_result(1.0, 1.0),
             "decode-heavy--pagedserve--r1.json": _serve_result(9.0, 9.0)}
    for name, result in files.items():
        (tmp_path / name).write_text(json.dumps(result))
    out = tmp_path / "summary.json"
    assert peer.main(["summarize", "--json", str(out), *map(str, tmp_path.glob("*.json"))]) == 0
    [row] = json.loads(out.read_text())["workloads"]
    assert row["workload"] == "mixed" and row["rounds"] == 1
    assert row["ratio"] == pytest.approx(110.0 / 50.0)
    assert row["ttft_ratio"] == pytest.approx(10.0 / 20.0)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("skipped ") for line in err)
    assert any("mixed--peer--r2.json: no request completed" in line for line in err)
    assert any("notes.json: not named WORKLOAD--SERVER--rK.json" in line for line in err)
    assert any("decode-heavy: no peer result" in line for line in err)

    assert peer.main(["summarize", "--json", str(out), str(tmp_path / "notes.json")]) == 2
    assert "error: no result file to summarize" in capsys.readouterr().err
