"""The generate CLI: JSON output and clean refusals of bad input (serve's too)."""

import json
import subprocess
import sys

import pytest
from test_server_utils import free_port

CLI = [sys.executable, "-m", "pagedserve.cli", "generate"]


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n", "0", "hi"], "n must be at least 1"),
        (["--max-tokens", "-1", "hi"], "max_tokens must be at least 0"),
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
