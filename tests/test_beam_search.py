"""Beam search (engine/beam_search.py), vLLM 0.32's algorithm: the paged engine's beams equal
the same search run plainly on transformers' model of the same weights; a width of one is
greedy decoding; and the server answers `use_beam_search` as vLLM's does."""

from __future__ import annotations

import copy
import json
import threading
import time

import httpx
import pytest
import torch
from engine_utils import make_engine
from test_server_utils import assert_alive_and_idle, metrics, openai_error, tiny_server

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.beam_search import BeamSearch, BeamSearchParams, BeamSequence
from pagedserve.scheduler import InvalidRequest

PROMPTS = [[1, 504, 3570, 314, 260], [1, 28120, 28, 2030]]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_next_logprobs(model, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)


@torch.no_grad()
def _plain_beam_search(model, prompt: list[int], width: int, steps: int, eos: int,
                       length_penalty: float) -> list[tuple[list[int], float]]:
    """The search read plainly off vLLM's description, each beam recomputed whole: every
    beam's 2k most likely next tokens are candidates, an EOS one completes, the k best
    sums go on; at the end the k best by sum / length ** length_penalty (the prompt
    counted, an ending EOS not)."""
    beams, done = [(prompt, 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, total in beams:
            values, ids = _hf_next_logprobs(model, tokens).topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                (done if token == eos else grown).append(([*tokens, token], total + value))
        beams = sorted(grown, key=lambda b: -b[1])[:width]

    def score(beam: tuple[list[int], float]) -> float:
        tokens, total = beam
        return total / (len(tokens) - (tokens[-1] == eos)) ** length_penalty

    return sorted([*done, *beams], key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM.from_engine(make_engine(tiny_llama))


def test_the_beams_are_the_plain_search_on_transformers(tiny_llama, hf_model):
    """The EOS is made a token the search meets (the second most likely first token of the
    first prompt), so that beams complete on the way, as a trained model's do."""
    eos = _hf_next_logprobs(hf_model, PROMPTS[0]).topk(2).indices[1].item()
    llm = LLM.from_engine(make_engine(tiny_llama))
    llm.tokenizer = copy.copy(llm.tokenizer)
    llm.tokenizer.eos_token_ids = [eos]
    for width, penalty in ((3, 1.0), (2, 0.5)):
        params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=penalty)
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            want = _plain_beam_search(hf_model, prompt, width, 5, eos, penalty)
            assert [b.tokens for b in out.sequences] == [tokens for tokens, _ in want]
            for beam, (_, total) in zip(out.sequences, want, strict=True):
                assert beam.cum_logprob == pytest.approx(total, abs=1e-4)
                assert beam.finish_reason == ("stop" if beam.tokens[-1] == eos else "length")
                assert beam.text == llm.tokenizer.decode(beam.tokens)
        assert any(b.finish_reason == "stop" for o in outputs for b in o.sequences), \
            "an EOS ended no beam: the test did not reach that path"
    assert llm.engine.block_manager.num_used_blocks == 0


def test_ignore_eos_makes_the_eos_a_token_like_any_other(tiny_llama, hf_model):
    eos = _hf_next_logprobs(hf_model, PROMPTS[0]).topk(2).indices[1].item()
    llm = LLM.from_engine(make_engine(tiny_llama))
    llm.tokenizer = copy.copy(llm.tokenizer)
    llm.tokenizer.eos_token_ids = [eos]
    [out] = llm.beam_search(PROMPTS[0], BeamSearchParams(3, 4, ignore_eos=True))
    want = _plain_beam_search(hf_model, PROMPTS[0], 3, 4, -1, 1.0)
    assert [b.tokens for b in out.sequences] == [tokens for tokens, _ in want]
    assert any(eos in b.tokens for b in out.sequences)  # (it was met, and went on)
    assert all(b.finish_reason == "length" for b in out.sequences)


def test_the_rank_is_the_sum_over_the_length_to_the_penalty():
    """vLLM's score, cum / length ** length_penalty (the prompt counted, an ending EOS not),
    compared in logs: penalties that overflow a float still rank."""
    eos = 9
    for penalty in (0.0, 0.5, 1.0, 2.0, -1.0):
        search = BeamSearch([1, 2], BeamSearchParams(2, 4, length_penalty=penalty), eos, 64)
        beams = [BeamSequence([1, 2, 3], [], -1.0), BeamSequence([1, 2, 3, 4, 5, 6], [], -1.5),
                 BeamSequence([1, 2, 3, 4, eos], [], -1.2, "stop"), BeamSequence([1, 2], [], 0.0)]
        lengths = [3, 6, 4, 2]  # (the EOS not counted)
        by_score = sorted(range(4), key=lambda i: beams[i].cum_logprob / lengths[i] ** penalty,
                          reverse=True)
        assert sorted(range(4), key=lambda i: search.rank(beams[i]), reverse=True) == by_score
    for penalty in (400.0, -400.0):  # (2 ** 400 is past a float's range)
        search = BeamSearch([1], BeamSearchParams(2, 4, length_penalty=penalty), eos, 64)
        short, long = BeamSequence([1, 2], [], -1.0), BeamSequence([1, 2, 3, 4], [], -1.0)
        assert (search.rank(long) > search.rank(short)) == (penalty > 0)


def test_an_eos_ended_beam_shows_its_eos_only_where_asked():
    ended = BeamSequence([1, 2, 3, 9], [], -1.0, "stop", 9)
    for keep in (False, True):
        search = BeamSearch([1], BeamSearchParams(2, 4, include_stop_str_in_output=keep), 9, 64)
        assert search.output_tokens(ended) == ([2, 3, 9] if keep else [2, 3])
        assert search.text_tokens(ended) == [2, 3]  # (vLLM's text never shows it)
    live = BeamSequence([1, 2, 9], [], -1.0, "length")  # (ignore_eos: an ordinary token)
    assert search.output_tokens(live) == search.text_tokens(live) == [2, 9]


def test_a_width_of_one_is_greedy_decoding(llm):
    params = BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True)
    [beams] = llm.beam_search(PROMPTS[1], params)
    greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True))[0].outputs[0]
    assert beams.sequences[0].tokens == PROMPTS[1] + greedy.token_ids


def test_the_search_stops_at_the_context_end(tiny_llama):
    llm = LLM.from_engine(make_engine(tiny_llama, max_model_len=8))
    [out] = llm.beam_search([PROMPTS[0]], BeamSearchParams(2, 10, ignore_eos=True))
    assert [len(b.tokens) for b in out.sequences] == [8, 8]
    with pytest.raises(InvalidRequest, match="maximum context length"):
        llm.beam_search([[5] * 8], BeamSearchParams(2, 10))


def test_its_values_are_checked():
    for fields, param in (({"beam_width": 0}, "n"), ({"beam_width": 11}, "n"),
                          ({"max_tokens": 0}, "max_tokens"),
                          ({"temperature": 3.0}, "temperature"),
                          ({"length_penalty": float("nan")}, "length_penalty")):
        with pytest.raises(InvalidRequest) as e:
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})
        assert e.value.param == param, fields


@pytest.mark.slow
def test_over_http_as_vllm_answers(tiny_llama_dir, llm):
    """Both endpoints: the n best beams as the choices, best first (the offline search's),
    each token's logprob with the most likely of its step's candidates; what a beam search
    does not read is a 400 naming the field, as a stream is in vLLM."""
    with tiny_server(tiny_llama_dir, "--max-queue", "8") as server:
        url = server.url

        def post(path: str, **body) -> httpx.Response:
            return httpx.post(url + path, timeout=60, json={"use_beam_search": True, **body})

        want = llm.beam_search(PROMPTS[0], BeamSearchParams(3, 6))[0].sequences
        r = post("/v1/completions", prompt=PROMPTS[0], n=3, max_tokens=6, logprobs=2)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        for choice, beam in zip(choices, want, strict=True):
            output = beam.tokens[len(PROMPTS[0]):]
            assert choice["text"] == llm.tokenizer.decode(output)
            assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
            lps = choice["logprobs"]
            assert sum(lps["token_logprobs"]) == pytest.approx(beam.cum_logprob, abs=1e-4)
            assert all(len(top) <= 2 for top in lps["top_logprobs"])
        assert r.json()["usage"]["completion_tokens"] == 18
        # several prompts: each one's beams, in prompt order
        both = post("/v1/completions", prompt=PROMPTS, n=2, max_tokens=3).json()["choices"]
        offline = llm.beam_search(PROMPTS, BeamSearchParams(2, 3))
        assert [c["text"] for c in sorted(both, key=lambda c: c["index"])] == [
            llm.tokenizer.decode(b.tokens[len(p):])
            for p, out in zip(PROMPTS, offline, strict=True) for b in out.sequences]
        # chat: the same search over the rendered conversation
        hi = [{"role": "user", "content": "hi"}]
        chat = post("/v1/chat/completions", messages=hi, n=2, max_tokens=4).json()
        prompt = llm.chat_prompt(hi)
        beams = llm.beam_search(prompt, BeamSearchParams(2, 4))[0].sequences
        assert [c["message"]["content"] for c in chat["choices"]] == [
            llm.tokenizer.decode(b.tokens[len(prompt):]) for b in beams]
        # a field chat does not know is dropped and logged, as without beams (it was a 500)
        assert post("/v1/chat/completions", messages=hi, n=2, max_tokens=2,
                    best_of=3).status_code == 200
        # a chat may be streamed (vLLM's): the whole answer at the end
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "use_beam_search": True, "messages": hi, "n": 2, "max_tokens": 4,
                "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        streamed = ["".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                            if c["choices"] and c["choices"][0]["index"] == k) for k in (0, 1)]
        assert streamed == [c["message"]["content"] for c in chat["choices"]]
        for field, value in (("stream", True), ("top_p", 0.5), ("stop", ["x"]),
                             ("n", 11), ("seed", 3), ("best_of", 3),
                             ("repetition_detection", {"max_pattern_size": 2, "min_count": 2})):
            err = openai_error(post("/v1/completions", prompt="a", max_tokens=3,
                                    **{field: value}), 400)
            assert err["param"] == field, (field, err)
        err = openai_error(post("/v1/chat/completions", messages=hi,
                                max_completion_tokens=0), 400)
        assert err["param"] == "max_completion_tokens"  # (the field the client sent)
        err = openai_error(post("/v1/completions", prompt="a", echo=True, logprobs=1), 400)
        assert err["param"] == "echo"
        err = openai_error(post("/v1/chat/completions", messages=hi, response_format={
            "type": "json_object"}), 400)
        assert "structured-output" in err["message"]
        # more beams a step than the queue takes: refused before any step runs
        err = openai_error(post("/v1/completions", prompt=[[5, 6]] * 3, n=3, max_tokens=2), 400)
        assert err["param"] == "n" and "--max-queue" in err["message"]
        # a step's requests carry the request's cache_salt: a prompt cached without a salt
        # is no hit for a salted search, and one for a search without
        hits = "pagedserve_prefix_cache_hit_tokens_total"
        long_prompt = list(range(20, 120))
        assert post("/v1/completions", prompt=long_prompt, max_tokens=1,
                    use_beam_search=False).status_code == 200
        for salt, hit in (("beams", False), (None, True)):
            before = metrics(url)[hits]
            assert post("/v1/completions", prompt=long_prompt, n=1, max_tokens=1,
                        cache_salt=salt).status_code == 200
            assert (metrics(url)[hits] > before) is hit, salt
        # no max_tokens (chat): as many steps as the context leaves
        rest = post("/v1/chat/completions", messages=hi, n=1).json()
        assert rest["choices"][0]["finish_reason"] == "length"
        assert rest["usage"]["completion_tokens"] == 256 - len(prompt)
        # a prompt the engine refuses is refused as without beams
        for prompt in ([5] * 256, [10**6]):
            err = openai_error(post("/v1/completions", prompt=prompt, max_tokens=2), 400)
            assert err["param"] == "prompt", err
        # a client that leaves mid-search stops it: its step is aborted, no later one runs
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", timeout=0.5, json={
                "use_beam_search": True, "prompt": "a", "n": 4, "max_tokens": 250,
                "ignore_eos": True})
        assert_alive_and_idle(url)
        finished = "pagedserve_requests_finished_total"
        time.sleep(0.5)  # (a step in flight when the client left may still end)
        done = metrics(url)[finished]
        time.sleep(0.5)
        assert metrics(url)[finished] == done


def test_a_steps_requests_carry_the_searchs_priority(tiny_llama_dir):
    """Under --scheduling-policy priority with one seat, a search of priority -5 and a plain
    request of -1 wait for a running one: the search's step goes first (its requests carry
    -5; at the default 0 the plain one's 60 tokens would run before it)."""
    with tiny_server(tiny_llama_dir, "--scheduling-policy", "priority",
                     "--max-num-seqs", "1") as server:
        url, done = server.url, []

        def send(name: str, **body) -> None:
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": [5, 6], "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
            done.append(name)

        running = {"prompt": [5, 6], "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=running, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            waiting = [threading.Thread(target=send, args=("plain",),
                                        kwargs={"max_tokens": 60, "priority": -1}),
                       threading.Thread(target=send, args=("beams",), kwargs={
                           "max_tokens": 1, "priority": -5, "use_beam_search": True})]
            for thread in waiting:
                thread.start()
            deadline = time.monotonic() + 30  # (the running one has 249 tokens to go)
            while metrics(url)["pagedserve_num_requests_waiting"] < 2:
                assert time.monotonic() < deadline, "both never waited"
                time.sleep(0.01)
            assert [line for line in lines if line][-1] == "data: [DONE]"
        for thread in waiting:
            thread.join(60)
        assert done == ["beams", "plain"]
