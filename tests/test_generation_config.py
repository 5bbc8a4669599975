"""vLLM's --generation-config: the sampling values a model's files recommend become the
defaults of the fields a request leaves out ("vllm": none; a directory: its file), with
--override-generation-config on top, whose max_new_tokens caps every request. Read from a
generation_config.json and from a GGUF's general.sampling keys; served over HTTP with the
engine loop in a thread and in a process of its own."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from engine_utils import make_engine
from test_server_utils import LOOP_FLAGS, RemoteServer

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.generation_config import SamplingDefaults, from_hf, read_gguf, resolve
from pagedserve.models.loader import load_model_files


def test_a_file_sets_what_differs_from_transformers_defaults():
    found = from_hf({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 50,
                     "repetition_penalty": 1.0, "max_new_tokens": 256, "eos_token_id": 2})
    assert found == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 256}  # top_k 50: HF's
    assert from_hf({"top_k": 20, "min_p": 0}) == {"top_k": 20, "min_p": 0.0}
    for bad in ({"temperature": "hot"}, {"top_k": 2.5}, {"top_p": float("nan")},
                {"max_new_tokens": True}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            from_hf(bad)
    # A GGUF stores float32: 0.6 must read back as 0.6. Its penalty_repeat (over the last n
    # tokens only) is not a repetition_penalty.
    gguf = {"general.sampling.temp": 0.6000000238418579, "general.sampling.top_k": 20,
            "general.sampling.penalty_repeat": 1.1}
    assert read_gguf(gguf.get) == {"temperature": 0.6, "top_k": 20}


def test_modes_and_the_override(tmp_path):
    model = {"temperature": 0.6, "max_tokens": 256}
    assert resolve("auto", model) == SamplingDefaults(model)
    assert resolve("vllm", model) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text('{"top_p": 0.5, "max_new_tokens": 8}')
    # A directory named on purpose: its max_new_tokens caps requests too (vLLM's rule).
    assert resolve(str(tmp_path), model) == SamplingDefaults({"top_p": 0.5, "max_tokens": 8}, 8)
    # The override restates a default to undo the model's, and its max_new_tokens is a cap.
    assert resolve("auto", model, {"temperature": 1.0, "max_new_tokens": 4}) == \
        SamplingDefaults({"temperature": 1.0, "max_tokens": 4}, 4)
    assert resolve("auto", model, {"temperature": None}) == SamplingDefaults({"max_tokens": 256})
    with pytest.raises(ValueError, match=r"unknown key\(s\) temprature"):
        resolve("auto", model, {"temprature": 1.0})
    with pytest.raises(ValueError, match="no generation_config.json"):
        resolve(str(tmp_path / "nowhere"), model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama with a generation config that samples greedily, 5 tokens at most."""
    path = tmp_path_factory.mktemp("generation-config")
    for file in tiny_llama_dir.iterdir():
        shutil.copy(file, path)
    file = path / "generation_config.json"
    config = json.loads(file.read_text()) if file.exists() else {}
    config |= {"do_sample": False, "temperature": 0.0, "max_new_tokens": 5}
    file.write_text(json.dumps(config))
    return path


def test_offline_calls_without_params_take_the_models_defaults(model_dir):
    # (the engine of the tests' kernels: LLM(path) would build the C++ kernels anew here)
    llm = LLM.from_engine(make_engine(load_model_files(str(model_dir)), num_kv_blocks=64))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    default = llm.generate(prompt)[0].outputs[0].token_ids
    assert default == llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0] \
        .outputs[0].token_ids
    vllm = LLM.from_engine(llm.engine)
    vllm.engine.sampling_defaults = SamplingDefaults()  # what --generation-config vllm leaves
    assert vllm.get_default_sampling_params() == SamplingParams()


HI = [{"role": "user", "content": "Hi there"}]


def chat(server: RemoteServer, **body) -> dict:
    body = {"messages": HI, "ignore_eos": True, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(response: dict) -> list[str]:
    return [t["token"] for t in response["choices"][0]["logprobs"]["content"]]


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["thread", "process"])
def test_served_requests_fall_back_to_the_models_defaults(model_dir, loop):
    with RemoteServer("--model", str(model_dir), LOOP_FLAGS[loop]) as server:
        greedy = chat(server, temperature=0, max_tokens=5, logprobs=True)
        omitted = chat(server, seed=7, logprobs=True)  # temperature 0 and 5 tokens, the model's
        assert tokens(omitted) == tokens(greedy)
        assert omitted["usage"]["completion_tokens"] == 5
        # A request's own values win: at temperature 1 a random model's tokens differ.
        assert tokens(chat(server, temperature=1.0, seed=7, max_tokens=5,
                           logprobs=True)) != tokens(greedy)
        # The model's max_new_tokens is a default, not a cap; completions keep OpenAI's 16.
        assert chat(server, max_tokens=8)["usage"]["completion_tokens"] == 8
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": "Hi there", "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.slow
def test_an_override_caps_every_request_and_vllm_mode_samples_as_openai(model_dir):
    with RemoteServer("--model", str(model_dir), "--generation-config", "vllm",
                      "--override-generation-config", '{"max_new_tokens": 3}',
                      LOOP_FLAGS["process"]) as server:
        greedy = chat(server, temperature=0, max_tokens=3, logprobs=True)
        assert chat(server, max_tokens=8)["usage"]["completion_tokens"] == 3
        # "vllm": the model's temperature 0 is not used, so a seeded request samples at 1.
        assert tokens(chat(server, seed=7, logprobs=True)) != tokens(greedy)


@pytest.mark.slow
def test_a_default_past_the_context_left_is_clipped(model_dir):
    """A default, a cap or a request's own max_tokens longer than what the context leaves
    after the prompt is clipped to it, as vLLM's get_max_tokens does; a request's own past
    the whole context is refused before any cap lowers it (vLLM's check too)."""
    with RemoteServer("--model", str(model_dir), "--max-model-len", "64",
                      "--override-generation-config", '{"max_new_tokens": 30}') as server:
        short = chat(server)
        assert short["usage"]["completion_tokens"] == 30  # the cap: the context has room
        long_talk = [{"role": "user", "content": " ".join(["Hi there"] * 12)}]
        out = chat(server, messages=long_talk)
        assert 64 - out["usage"]["prompt_tokens"] < 30  # (the test's own premise)
        assert out["usage"]["completion_tokens"] == 64 - out["usage"]["prompt_tokens"]
        for field in ("max_tokens", "max_completion_tokens"):
            past = chat(server, messages=long_talk, **{field: 40})  # more than fits
            assert past["usage"]["completion_tokens"] == out["usage"]["completion_tokens"]
            assert past["choices"][0]["finish_reason"] == "length"
            r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"messages": HI, field: 65})  # more than the context
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
        assert chat(server, max_tokens=64)["usage"]["completion_tokens"] == 30
