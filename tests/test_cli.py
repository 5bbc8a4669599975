"""The generate CLI: JSON output and clean refusals of bad input (serve's too)."""

import argparse
import json
import shutil
import subprocess
import sys

import pytest
from test_server_utils import free_port

import pagedserve
from pagedserve import cli
from pagedserve.engine.args import engine_config
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.models.generation_config import SamplingDefaults

CLI = [sys.executable, "-m", "pagedserve.cli", "generate"]


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n", "0", "hi"], "n must be at least 1"),
        (["--max-tokens", "-1", "hi"], "max_tokens must be at least 1, got -1"),
        (["--max-tokens", "0", "hi"], "max_tokens must be at least 1, got 0"),  # as vLLM
        ([""], "prompt must not be empty"),
        (["--model", "/no/such/model", "hi"], "/no/such/model"),
        (["--max-model-len", "8", "a prompt that is much longer than eight tokens for sure"],
         "maximum context length"),
        (["--device", "bogus", "hi"], "--device 'bogus'"),
        (["--device", "cuda:7", "hi"], "CUDA device"),
        (["--num-threads", "-1", "hi"], "--num-threads"),
        (["--kv-cache-memory-gib", "0", "hi"], "--kv-cache-memory-gib"),
        (["--kv-cache-memory-gib", "1e-9", "hi"], "holds no KV block"),
        (["--kv-cache-memory-gib", "1e9", "hi"], "GiB is available on cpu"),  # not MemoryError
        (["--chat-template", "no/such.jinja", "--chat", "hi"], "--chat-template no/such"),
        (["--generation-config", "/no/such/dir", "hi"], "--generation-config /no/such/dir"),
        (["--override-generation-config", "[1]", "hi"], "a JSON object is needed"),
        (["--override-generation-config", '{"temprature": 1}', "hi"], "unknown key(s) temp"),
        (["--override-generation-config", '{"temperature": -1}', "hi"],
         "generation config: temperature"),
        (["\udcff\udcfe bad"], "not valid UTF-8"),
        (["--chat", "\udcff\udcfe bad"], "not valid UTF-8"),
        (["--model", "/no/such/model", "\udcff bad"], "not valid UTF-8"),  # before loading
        (["--top-p", "0", "--model", "/no/such/model", "hi"], "top_p"),  # before loading
    ],
)
def test_bad_input_is_one_line_on_stderr(args, message):
    p = generate(*args)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], p.stderr


def test_serve_refuses_a_missing_model_before_it_starts():
    """Not a server that stays up answering 503 for a model that can never load."""
    p = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--model",
                        "/no/such/model", "--port", "1"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "--model /no/such/model: no such file" in p.stderr, p.stderr


@pytest.mark.slow
def test_serve_exits_when_the_model_fails_to_load():
    """A KV cache larger than the machine fails the load: as vLLM's, the server exits (1)
    with the reason in one line, rather than stay up answering 503 for good."""
    p = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--port",
                        str(free_port()), "--kv-cache-memory-gib", "1e9"],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "loading the model failed: a KV cache of" in p.stderr, p.stderr


def test_a_reader_that_goes_away_is_no_traceback():
    """`pagedserve generate ... | head -1`: the pipe closes before the output is written."""
    p = subprocess.Popen([*CLI, "--max-tokens", "2", "hi"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before the model has loaded, so every write meets a closed pipe
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 1 and "Traceback" not in stderr and "Error" not in stderr, stderr


@pytest.mark.slow
def test_json_output_and_stats():
    p = generate("--json", "--temperature", "0", "--max-tokens", "5", "--ignore-eos",
                 "--num-kv-blocks", "64", "--n", "2", "Hello there", "The weather")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert [line["prompt"] for line in lines[:2]] == ["Hello there", "The weather"]
    for line in lines[:2]:
        assert len(line["outputs"]) == 2
        # Greedy samples of one request are identical.
        assert line["outputs"][0]["token_ids"] == line["outputs"][1]["token_ids"]
        assert all(o["finish_reason"] == "length" for o in line["outputs"])
    stats = lines[-1]["stats"]
    assert stats["num_kv_blocks"] == 64 and stats["output_tokens"] == 20
    assert stats["prefill_tokens_computed"] == sum(len(x["prompt_token_ids"]) for x in lines[:2])


def test_a_closed_or_full_stdout_is_one_line(tiny_llama_dir):
    """Started with stdout closed (`>&-`): refused before the model loads; a full disk
    (/dev/full): the output's write fails in one line, not a traceback."""
    closed = subprocess.run(["bash", "-c", 'exec "$@" >&-', "_", *CLI, "hi"],
                            capture_output=True, text=True, timeout=600)
    assert closed.returncode == 2 and "Traceback" not in closed.stderr, closed.stderr
    assert "standard output is closed" in closed.stderr
    with open("/dev/full", "w") as full:
        p = subprocess.run([*CLI, "--model", str(tiny_llama_dir), "--max-tokens", "2", "hi"],
                           stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=600)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "writing the output failed" in p.stderr


def test_version_module_and_bench_flags_checked_at_once():
    run = [sys.executable, "-m", "pagedserve"]
    p = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"pagedserve {pagedserve.__version__}"
    p = subprocess.run([*run, "bench", "throughput", "--baseline", "hf", "--hf-batch-sizes",
                        "a,b"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--hf-batch-sizes" in p.stderr and "Traceback" not in p.stderr


def test_generate_takes_the_models_generation_config(tmp_path, tiny_llama_dir):
    """As vLLM's server does for a request: the flags given, then the model's generation
    config, then the CLI's own defaults; an override's max_new_tokens caps every output."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    p = generate("--model", str(model), "--json", "--ignore-eos", "hi", " ")
    assert p.returncode == 0, p.stderr  # (whitespace is a prompt of its own)
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert [len(line["outputs"][0]["token_ids"]) for line in lines[:2]] == [3, 3]
    assert lines[1]["prompt_token_ids"]
    capped = generate("--model", str(model), "--json", "--ignore-eos", "--max-tokens", "5",
                      "--override-generation-config", '{"max_new_tokens": 4}', "hi")
    assert capped.returncode == 0, capped.stderr
    assert len(json.loads(capped.stdout.splitlines()[0])["outputs"][0]["token_ids"]) == 4


def test_fields_from_flags_then_config_then_defaults():
    args = argparse.Namespace(n=2, seed=None, ignore_eos=False, max_tokens=None,
                              temperature=None, top_p=0.5, top_k=None, min_p=None)
    config = SamplingDefaults({"temperature": 0.7, "top_p": 0.9, "max_tokens": 300}, 100)
    p = cli._params(args, config)
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.top_k) == (2, 0.7, 0.5, 100, 0)
    p = cli._params(args, SamplingDefaults())
    assert (p.temperature, p.max_tokens) == (0.0, 64)


def test_a_chat_reply_is_printed_without_its_prompt(capsys):
    out = RequestOutput("r", "hi", [1], [CompletionOutput(0, " there", [2], "stop")],
                        finished=True)
    cli._print_output("hi", out, as_json=False, chat=True)
    cli._print_output("hi", out, as_json=False, chat=False)
    assert capsys.readouterr().out == " there\nhi there\n"


def test_model_paths_expand_the_home_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    args = cli.build_parser().parse_args(["generate", "--model", "~/m", "hi"])
    assert engine_config(args).model == str(tmp_path / "m")
