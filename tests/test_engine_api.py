"""Stop conditions, logprobs and request validation through the engine's public API."""

import dataclasses
import time

import pytest
from engine_utils import greedy, make_engine, run

from pagedserve.engine import InvalidRequest, OutputCollector, RequestOutputKind, SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def engine(embedded):
    return make_engine(embedded)


@pytest.fixture(scope="module")
def reference(engine):
    [out] = run(engine, [PROMPT], greedy(24))
    return out.outputs[0]


def test_stop_string_is_left_out(engine, reference):
    text = reference.text
    stop = text[10:14]
    [out] = run(engine, [PROMPT], greedy(24, stop=["zzzz-never", stop]))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == text[: text.index(stop)]


def test_stop_string_in_the_last_allowed_token_is_a_stop(engine, reference):
    # The stop string ends exactly at the max_tokens-th token: "stop" wins over "length".
    text_upto = engine.tokenizer.decode(reference.token_ids[:6])
    stop = text_upto[-3:]
    [out] = run(engine, [PROMPT], greedy(6, stop=[stop]))
    assert stop not in engine.tokenizer.decode(reference.token_ids[:5])  # the test's premise
    assert out.outputs[0].finish_reason == "stop"
    assert stop not in out.outputs[0].text


def test_stop_strings_wait_for_min_tokens(engine, reference):
    """As in vLLM, a stop string ends the text only in a token past min_tokens: one that
    ends in the first min_tokens tokens' text is text like any other."""
    m = 8
    # (the reference under min_tokens: its EOS masked too, under ignore_eos as without)
    [same] = run(engine, [PROMPT], greedy(24, min_tokens=m))
    text, ids = same.outputs[0].text, same.outputs[0].token_ids
    upto_m = len(engine.tokenizer.decode(ids[:m]))
    assert " " in text[: upto_m - 1] and " " in text[upto_m:]  # the test's premise
    [out] = run(engine, [PROMPT], greedy(24, stop=[" "], min_tokens=m))
    assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) > m
    assert out.outputs[0].text == text[: text.index(" ", upto_m)]
    [out] = run(engine, [PROMPT], greedy(24, stop=[" "]))
    assert out.outputs[0].text == reference.text[: reference.text.index(" ")]


def test_a_stop_string_kept_in_the_output(engine, reference):
    """vLLM's include_stop_str_in_output: the same stop, the text through the stop string."""
    text = reference.text
    stop = text[text.index(" ", 3) : text.index(" ", 3) + 3]  # spans a token boundary, likely
    [out] = run(engine, [PROMPT], greedy(24, stop=[stop], include_stop_str_in_output=True))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(engine, reference):
    target = reference.token_ids[5]
    [out] = run(engine, [PROMPT], greedy(24, stop_token_ids=[target]))
    first = reference.token_ids.index(target)
    assert out.outputs[0].token_ids == reference.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    [out] = run(engine, [PROMPT], greedy(3))
    assert out.outputs[0].token_ids == reference.token_ids[:3]
    assert out.outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(engine):
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    ids = engine.tokenizer.encode(chat, add_special_tokens=False)
    [out] = run(engine, [ids], SamplingParams(temperature=0, max_tokens=200))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in engine.tokenizer.eos_token_ids
    n = len(out.outputs[0].token_ids)
    [out] = run(engine, [ids], SamplingParams(temperature=0, max_tokens=n + 3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == n + 3
    [out] = run(engine, [ids], SamplingParams(temperature=0, max_tokens=n + 3, min_tokens=n + 2))
    assert len(out.outputs[0].token_ids) >= n + 2


def test_logprobs_and_text_consistency(engine, reference):
    [out] = run(engine, [PROMPT], greedy(24, logprobs=3))
    got = out.outputs[0]
    assert got.token_ids == reference.token_ids
    assert [lp.token_id for lp in got.logprobs] == got.token_ids
    for lp in got.logprobs:  # greedy picks the most likely token
        assert lp.top[0][0] == lp.token_id and lp.logprob <= 0
    assert got.text == engine.tokenizer.decode(got.token_ids)


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),  # OpenAI's [0, 2] (vLLM's)
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0, "prompt_logprobs": 1}, "max_tokens"),  # no forward
    ({"max_tokens": 0}, "max_tokens"),  # nothing to generate (vLLM's)
])
def test_bad_sampling_params_raise_where_they_are_written(fields, param):
    """As vLLM's SamplingParams: a value no model could take raises at construction."""
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**fields)
    assert e.value.param == param


@pytest.mark.parametrize(
    "prompt, params, param",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([10**9], SamplingParams(), "prompt"),
        ([5, 49152], SamplingParams(), "prompt"),  # the vocabulary's size: one past its ids
        ("hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),  # past the vocabulary
        ([5] * 8192, SamplingParams(max_tokens=None), "prompt"),  # fills the context
        # up to the context length, which cannot hold them
        ("hi", SamplingParams(max_tokens=None, min_tokens=10**9), "min_tokens"),
    ],
)
def test_bad_requests_are_refused_without_side_effects(engine, prompt, params, param):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request(prompt, params)
    assert e.value.param == param
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0


def test_a_max_tokens_past_the_context_ends_at_it(tiny_llama):
    """vLLM's: a max_tokens longer than the room the prompt leaves is no refusal; the
    sample ends at the context's end, "length"."""
    engine = make_engine(tiny_llama, max_model_len=64)
    [out] = run(engine, [list(range(1, 51))], greedy(100))
    assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks_at_once(engine):
    rid = engine.add_request(PROMPT, greedy(50, n=3))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request(rid)
    assert engine.block_manager.num_used_blocks == 0
    outs = engine.step()
    assert [o.finished for o in outs if o.request_id == rid] == [True]
    assert all(c.finish_reason == "abort" for o in outs for c in o.outputs)
    assert not engine.has_unfinished_requests()


def test_abort_many_at_once_leaves_the_others_as_they_were(embedded, reference):
    """One call aborts a list (a client leaving a request of many prompts): running and
    waiting requests alike, ids already gone ignored; the rest run on, unchanged."""
    engine = make_engine(embedded, max_num_seqs=4)
    whole = RequestOutputKind.FINAL_ONLY
    kept = engine.add_request(PROMPT, greedy(24, output_kind=whole))
    dropped = [engine.add_request(PROMPT, greedy(50, output_kind=whole)) for _ in range(40)]
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4 and engine.scheduler.waiting
    engine.abort_request([*dropped, "no-such-request"])
    assert [s.request_id for s in engine.scheduler.running + engine.scheduler.waiting] == [kept]
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert {done[r].outputs[0].finish_reason for r in dropped} == {"abort"}
    assert done[kept].outputs[0].token_ids == reference.token_ids
    assert engine.block_manager.num_used_blocks == 0


def test_stop_reason_says_what_ended_a_stop(engine, reference):
    """vLLM's stop_reason: the stop string, or the stop token id; None for EOS and length."""
    token, word = reference.token_ids[3], reference.text.split()[2]
    outs = run(engine, [PROMPT] * 3, [greedy(24, stop_token_ids=[token]), greedy(24, stop=[word]),
                                      greedy(24)])
    assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs] == \
        [("stop", token), ("stop", word), ("length", None)]
    eos = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=400))[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.stop_reason is None


def test_aborting_many_requests_is_one_pass(embedded):
    """A complexity guard, not a speed claim: 60,000 queued requests go in one pass over the
    queues (~0.1 s here); a pass each was quadratic (~50 s on the same 2-vCPU machine)."""
    engine = make_engine(embedded)
    ids = [engine.add_request([1], SamplingParams(max_tokens=1)) for _ in range(60_000)]
    start = time.perf_counter()
    engine.abort_request(ids)
    assert time.perf_counter() - start < 10
    engine.step()
    assert not engine.has_unfinished_requests()


def test_steps_count_every_forward(embedded):
    """stats()["steps"] (/metrics: pagedserve_engine_steps_total) counts the steps that ran a
    forward: a 40-token prompt in chunks of 16 is 3, then one a token after the first."""
    engine = make_engine(embedded, max_num_batched_tokens=16)
    prompt = list(range(100, 140))
    run(engine, [prompt], greedy(12))
    assert engine.stats()["steps"] == 3 + 11
    engine.step()  # nothing to run: no forward
    assert engine.stats()["steps"] == 3 + 11


def test_final_only_requests_get_one_output_with_everything(engine, reference):
    """Beside the same requests asking for deltas, each FINAL_ONLY one yields a single
    output, at its end, equal to its deltas joined: text (stop strings and the held-back
    text included), ids, finish reasons, logprobs and prompt logprobs, n samples each;
    an aborted one ends with one output too."""
    stop = reference.text[10:14]
    cases = [greedy(24, stop=[stop], logprobs=2), greedy(9, n=2, prompt_logprobs=1),
             SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=0)]
    final = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in cases]
    params = cases + final + [dataclasses.replace(final[0], max_tokens=50)]
    seen = stream(engine, params, abort_at_step=6)
    joined = [join(deltas) for deltas in seen]
    for want, got, deltas in zip(joined[:3], joined[3:6], seen[3:6], strict=True):
        assert [d.finished for d in deltas] == [True]
        assert got.outputs == want.outputs and got.prompt_logprobs == want.prompt_logprobs
        assert got.first_token_time is not None and len(got.token_times) > 1
    assert joined[0].outputs[0].finish_reason == "stop"
    assert len(seen[1]) > 1  # the delta requests did get a delta per step
    [aborted] = seen[-1]
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert 0 < len(aborted.outputs[0].token_ids) < 50


def stream(engine, params: list[SamplingParams], abort_at_step: int) -> list[list]:
    """Each request's deltas, the prompt the same for all; the last request is aborted
    before step ``abort_at_step``."""
    ids = [engine.add_request(PROMPT, p) for p in params]
    seen: dict[str, list] = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == abort_at_step:
            engine.abort_request(ids[-1])
        for delta in engine.step():
            seen[delta.request_id].append(delta)
    assert engine.block_manager.num_used_blocks == 0
    return [seen[i] for i in ids]


def join(deltas: list) -> object:
    collector = OutputCollector()
    outs = [o for d in deltas if (o := collector.add(d)) is not None]
    assert len(outs) == 1
    return outs[0]


def test_stream_interval_sends_fewer_deltas_that_join_to_the_same_outputs(engine, embedded,
                                                                         reference):
    """stream_interval=4: each streamed request's first token goes at once, then a delta
    waits until a sample holds 4 new tokens, and the last goes when it finishes; joined,
    the deltas equal those of stream_interval=1 (text with its stop string, ids, logprobs,
    prompt logprobs, n samples), and an abort still ends with everything held."""
    stop = reference.text[10:14]
    params = [greedy(24, stop=[stop], logprobs=2), greedy(9, n=2, prompt_logprobs=1),
              SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=0),
              greedy(50)]
    seen = [stream(eng, params, abort_at_step=11)
            for eng in (engine, make_engine(embedded, stream_interval=4))]
    for every, spaced_out in zip(*seen, strict=True):
        want, got = join(every), join(spaced_out)
        assert got.outputs == want.outputs and got.prompt_logprobs == want.prompt_logprobs
        counts = [max(len(c.token_ids) for c in d.outputs) for d in spaced_out]
        assert counts[0] == 1 and all(c >= 4 for c in counts[1:-1]), counts
        assert len(spaced_out) < len(every)
    assert join(seen[1][-1]).outputs[0].finish_reason == "abort"


def test_detokenize_off_sends_the_same_tokens_without_text(engine, reference):
    """vLLM's detokenize=False (the server decodes such requests itself): the same ids,
    finish reasons and logprobs in every delta, every text empty; with stop strings, which
    are matched in the text, it is refused."""
    cases = [greedy(24, logprobs=2), greedy(9, n=2),
             SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=0)]
    quiet = [dataclasses.replace(p, detokenize=False) for p in cases]
    seen = stream(engine, cases + quiet + [dataclasses.replace(quiet[0], max_tokens=50)],
                  abort_at_step=6)
    for with_text, without in zip(seen[:3], seen[3:6], strict=True):
        assert [len(d.outputs) for d in with_text] == [len(d.outputs) for d in without]
        assert all(c.text == "" for d in without for c in d.outputs)
        want = [dataclasses.replace(c, text="") for c in join(with_text).outputs]
        assert join(without).outputs == want
    assert join(seen[0]).outputs[0].token_ids == reference.token_ids
    assert join(seen[0]).outputs[0].text == reference.text != ""
    assert join(seen[-1]).outputs[0].finish_reason == "abort"
    with pytest.raises(InvalidRequest) as e:
        engine.add_request(PROMPT, greedy(5, stop=["x"], detokenize=False))
    assert e.value.param == "stop" and not engine.has_unfinished_requests()


def test_a_max_model_len_past_the_pool_or_the_context_is_lowered_and_said(tiny_llama, caplog):
    """vLLM refuses it; here the pool is sized by memory, so it is a cap, but never a silent
    one: the log names the length taken and why."""
    context = tiny_llama.config.max_position_embeddings
    with caplog.at_level("WARNING", logger="pagedserve.engine"):
        assert make_engine(tiny_llama, num_kv_blocks=4, max_model_len=1000).max_model_len == 64
        assert make_engine(tiny_llama, max_model_len=context + 1).max_model_len == context
        assert make_engine(tiny_llama, max_model_len=48).max_model_len == 48
    said = [r.getMessage() for r in caplog.records]
    assert said == ["max_model_len 1000 lowered to 64: what the KV pool holds (64 tokens)",
                    f"max_model_len {context + 1} lowered to {context}: the model's context"]


@pytest.fixture(scope="module")
def short_engine(tiny_llama):
    return make_engine(tiny_llama, max_model_len=64)


def test_min_tokens_up_to_the_room_left_is_kept(short_engine):
    """A prompt of 60 tokens leaves 4: min_tokens 4 is a promise the context keeps (four
    tokens, EOS or not), min_tokens 5 one it cannot (refused)."""
    prompt = list(range(1, 61))
    [out] = run(short_engine, [prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=4))
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(InvalidRequest) as e:
        short_engine.add_request(prompt, SamplingParams(max_tokens=10, min_tokens=5))
    assert e.value.param == "min_tokens"
    assert not short_engine.has_unfinished_requests()


def test_a_request_id_already_running_is_refused(short_engine):
    """A second request under the id of one still running is refused (nothing queued); the
    first runs on as it was."""
    short_engine.add_request([1, 2, 3], greedy(5), request_id="same")
    with pytest.raises(InvalidRequest) as e:
        short_engine.add_request([4, 5, 6], greedy(7), request_id="same")
    assert e.value.param == "request_id"
    outs, collector = [], OutputCollector()
    while short_engine.has_unfinished_requests():
        outs += [o for d in short_engine.step() if (o := collector.add(d)) is not None]
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outs] == [("same", 5)]
    assert short_engine.block_manager.num_used_blocks == 0


def test_an_engines_chat_template_leaves_the_shared_model_as_it_was(tiny_llama):
    """EngineConfig.chat_template is the engine's own: another engine over the same loaded
    model (the tests share one; LLMEngine(loaded=...)) renders with the model's."""
    model_template = tiny_llama.tokenizer.chat_template
    hi = [{"role": "user", "content": "hi"}]
    mine = make_engine(tiny_llama, max_model_len=64,
                       chat_template="{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    assert mine.tokenizer.apply_chat_template(hi, add_generation_prompt=False) == "<<hi>>"
    assert tiny_llama.tokenizer.chat_template == model_template
    other = make_engine(tiny_llama, max_model_len=64)
    assert other.tokenizer.apply_chat_template(hi) != "<<hi>>"


def test_the_last_id_is_a_prompt_token_and_requests_count_once_in_stats(engine):
    """The vocabulary's last id is a valid prompt token; a request of two samples counts as
    one running request (vLLM's num_requests_running), not as its two sequences."""
    assert engine.vocab_size == 49152
    request_id = engine.add_request([5, 49151], SamplingParams(n=2, max_tokens=4, seed=0))
    engine.step()
    assert len(engine.scheduler.running) == 2
    assert engine.stats()["num_requests_running"] == 1
    engine.abort_request(request_id)
    engine.step()
    assert not engine.has_unfinished_requests()
