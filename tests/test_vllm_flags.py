"""A `vllm serve` command line runs here: the model as a positional argument, vLLM's dtype
aliases and human-readable counts, several API keys or VLLM_API_KEY's, --seed, and the
flags of what pagedserve always does."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from engine_utils import make_engine, run
from kubernetes_utils import parse_serve

from pagedserve.engine import SamplingParams
from pagedserve.engine.args import engine_config, human_int
from pagedserve.server.launch import server_config


def test_a_vllm_command_line_parses_to_the_same_settings(tmp_path):
    args = parse_serve([str(tmp_path), "--dtype", "half", "--max-model-len", "32k",
                        "--max-num-batched-tokens", "8K", "--trust-remote-code",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--seed", "3", "--api-key", "k1", "k2"])
    assert args.model_tag == str(tmp_path) and args.seed == 3
    config = engine_config(args)
    assert (config.dtype, config.max_model_len, config.max_num_batched_tokens) == \
        ("float16", 32_000, 8_192)
    assert server_config(args, engine_process=False).api_keys == ["k1", "k2"]
    assert parse_serve(["--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):  # a parser this server does not have is refused
        parse_serve(["--tool-call-parser", "mistral"])


@pytest.mark.parametrize("text, count", [("32768", 32768), ("32k", 32_000), ("32K", 32_768),
                                         ("1.5m", 1_500_000), ("1M", 2**20), ("2g", 2 * 10**9)])
def test_counts_as_vllm_reads_them(text, count):
    assert human_int(text) == count


@pytest.mark.parametrize("text", ["1.5", "k", "12x", "inf", "nan", ""])
def test_what_is_not_a_count(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_int(text)


def test_vllm_api_key_variable_is_the_default_key(monkeypatch):
    """A migrated deployment that sets only VLLM_API_KEY must not come up open."""
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert server_config(parse_serve([]), engine_process=False).api_keys == ["from-env"]
    given = parse_serve(["--api-key", "from-flag"])
    assert server_config(given, engine_process=False).api_keys == ["from-flag"]
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert server_config(parse_serve([]), engine_process=False).api_keys is None


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", *args, "--port", "1"],
                          capture_output=True, text=True, timeout=120)


def test_the_positional_model_is_the_model():
    p = serve("/no/such/model")
    assert p.returncode == 2 and "--model /no/such/model: no such file" in p.stderr, p.stderr
    p = serve("/one/model", "--model", "/another")
    assert p.returncode == 2 and "two models given" in p.stderr, p.stderr
    p = serve("--api-key", "")
    assert p.returncode == 2 and "--api-key must not be empty" in p.stderr, p.stderr


def test_seed_repeats_the_draws_of_unseeded_requests(tiny_llama):
    """--seed seeds the streams that requests without a seed draw from: the same seed, the
    same tokens at temperature 1; another seed, others."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def tokens(seed: int) -> list[int]:
        engine = make_engine(tiny_llama, seed=seed)
        return run(engine, [[1, 2, 3, 4]], params)[0].outputs[0].token_ids

    first = tokens(5)
    assert tokens(5) == first
    assert tokens(6) != first
