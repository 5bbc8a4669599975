"""The offline API (engine/llm.py) as vLLM's LLM is called: its prompt forms, its keyword
names, one conversation or several, and all-or-nothing queueing."""

import json

import pytest
from engine_utils import greedy, make_engine

from pagedserve.engine import LLM, InvalidRequest, SamplingParams, StructuredOutputsParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(embedded):
    return LLM.from_engine(make_engine(embedded))


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_every_prompt_form_gives_the_same_output(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    want = texts(llm.generate(PROMPT, greedy(6)))
    assert want[0]
    forms = [[PROMPT], ids, [ids], {"prompt": PROMPT}, [{"prompt_token_ids": ids}]]
    for form in forms:
        assert texts(llm.generate(form, sampling_params=greedy(6))) == want, form
    both = llm.generate([PROMPT, {"prompt_token_ids": ids}], [greedy(6), greedy(3)])
    assert [len(o.outputs[0].token_ids) for o in both] == [6, 3]


def test_chat_takes_one_conversation_or_several(llm):
    hi = [{"role": "user", "content": "Say hi."}]
    one = texts(llm.chat(hi, greedy(5)))
    assert one == texts(llm.chat([hi, hi], greedy(5)))[:1] == texts(
        llm.generate(llm.chat_prompt(hi), greedy(5)))
    opened = [*hi, {"role": "assistant", "content": "Hi! My name"}]
    resumed = llm.chat(opened, greedy(5), add_generation_prompt=False,
                       continue_final_message=True)
    prompt = llm.get_tokenizer().decode(resumed[0].prompt_token_ids)
    assert prompt.endswith("Hi! My name")
    # an output's prompt is the rendered conversation (vLLM's), whose ids it ran on
    tok = llm.get_tokenizer()
    assert resumed[0].prompt.endswith("Hi! My name") and resumed[0].prompt_token_ids == \
        tok.encode(resumed[0].prompt, add_special_tokens=False)


def test_vllms_keywords_are_taken_where_they_ask_nothing(llm):
    """Code written for vLLM's LLM passes lora_request=None or priority=[0]: taken; an
    adapter is refused (none is built), not ignored."""
    [out] = llm.generate(PROMPT, greedy(2), lora_request=None, priority=[0])
    assert out.outputs[0].finished() and len(out.outputs[0].token_ids) == 2
    assert llm.chat([{"role": "user", "content": "Hi"}], greedy(2), lora_request=None)
    for kwargs, param in (({"lora_request": object()}, "lora_request"),
                          ({"priority": [1, 2]}, "priority")):  # (two for one prompt)
        with pytest.raises(InvalidRequest) as e:
            llm.generate(PROMPT, greedy(2), **kwargs)
        assert e.value.param == param


def test_a_refused_prompt_queues_none(llm):
    with pytest.raises(InvalidRequest):
        llm.generate([PROMPT, ""], greedy(4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_blocks == 0
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        llm.generate({"text": PROMPT})


def assert_idle(llm) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_blocks == 0, "blocks leaked"
    llm.engine.block_manager.check_invariants()


def test_sampling_params_take_vllms_forms(llm):
    """None for no stop strings or stop ids, one stop string as a str (not its characters),
    logit_bias's ids as strings; a stop of another type is refused before anything queues."""
    assert SamplingParams(stop=None, stop_token_ids=None, logit_bias=None).stop == []
    assert SamplingParams(stop="x, y").stop == ["x, y"]
    for empty in ("", ["ok", ""]):  # (vLLM's 400: it would stop before any text)
        with pytest.raises(InvalidRequest, match="empty string"):
            SamplingParams(stop=empty).validate()
    assert SamplingParams(logit_bias={"42": 5}).logit_bias == {42: 5}
    for key in ("1_0", "-1", "٣", "9" * 20):  # (int() takes the first three)
        with pytest.raises(InvalidRequest, match="logit_bias keys must be token ids"):
            SamplingParams(logit_bias={key: 1})
    counted = "Count: 1, 2, 3,"
    cut = texts(llm.generate(counted, greedy(12, stop=" 5,")))
    assert cut == texts(llm.generate(counted, greedy(12, stop=[" 5,"])))
    assert cut[0] and " 5," not in cut[0]
    for bad in (5, [5], ["ok", None]):
        with pytest.raises(InvalidRequest, match="stop must be a string or a list of strings"):
            llm.generate(PROMPT, greedy(4, stop=bad))
        assert_idle(llm)
    assert texts(llm.generate(PROMPT, greedy(3)))[0]


def test_structured_outputs_by_vllms_names(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    params = greedy(24, structured_outputs=StructuredOutputsParams(json=schema))
    params.ignore_eos = False
    out = json.loads(texts(llm.generate("A number as JSON:", params))[0])
    assert isinstance(out["n"], int)
    pick = greedy(8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    pick.ignore_eos = False
    assert texts(llm.generate("Is the sky blue?", pick))[0] in ("yes", "no")


def test_an_interrupted_or_failed_run_takes_its_requests_back(llm, monkeypatch):
    """Ctrl-C mid-run (here from the progress bar), or a step that fails: the call's
    requests are withdrawn and every block is free, and the next call runs only its own."""
    class Interrupting:
        def __init__(self, **_):
            pass

        def update(self, _):
            raise KeyboardInterrupt

        def close(self):
            pass

    prompts = [PROMPT, "Once upon a time"]
    params = [greedy(1), greedy(200)]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=Interrupting)
    assert_idle(llm)
    assert [len(o.outputs[0].token_ids) for o in llm.generate(PROMPT, greedy(2))] == [2]

    cached = "A prompt the prefix cache holds before the failure, of several blocks. " * 4
    llm.generate(cached, greedy(1))
    engine = llm.engine
    execute = engine.runner.execute
    calls = []

    def failing_execute(batch, carried=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return execute(batch, carried)

    monkeypatch.setattr(engine.runner, "execute", failing_execute)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(prompts, params)
    assert_idle(llm)
    # the pool was sound, so not rebuilt: the prefix cache still holds what it held
    assert llm.generate(cached, greedy(1))[0].num_cached_tokens >= 32
    assert texts(llm.generate(PROMPT, greedy(6))) == texts(llm.generate([PROMPT], greedy(6)))


def test_a_list_of_params_is_one_per_prompt(llm):
    with pytest.raises(InvalidRequest, match="3 sampling params for 2 prompts"):
        llm.generate([PROMPT, PROMPT], [greedy(2)] * 3)
    assert_idle(llm)
    both = llm.generate([PROMPT, PROMPT], (greedy(2), greedy(3)))
    assert [len(o.outputs[0].token_ids) for o in both] == [2, 3]
    assert llm.llm_engine is llm.engine


def test_chat_reads_openais_message_form(llm):
    """As the server renders them: content parts joined, "developer" as "system", a call's
    arguments given as a JSON string rendered as the object it holds."""
    plain = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Say hi.\nNow."}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Say hi."},
                                          {"type": "text", "text": "Now."}]}]
    assert llm.chat_prompt(parts) == llm.chat_prompt(plain)
    assert texts(llm.chat(parts, greedy(4))) == texts(llm.chat(plain, greedy(4)))
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    as_object = {**call, "function": {"name": "f", "arguments": {"a": 1}}}
    turn = [*plain, {"role": "assistant", "content": None, "tool_calls": [call]}]
    turn_object = [*plain, {"role": "assistant", "content": None, "tool_calls": [as_object]}]
    assert llm.chat_prompt(turn) == llm.chat_prompt(turn_object)
    with pytest.raises(ValueError, match="content parts of type 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_takes_a_template_for_one_call(llm):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}> "
    out = llm.chat([{"role": "user", "content": "Hi"}], greedy(2), chat_template=template)
    assert llm.get_tokenizer().decode(out[0].prompt_token_ids) == "[user] Hi\n> "
    own = llm.get_tokenizer().decode(llm.chat([{"role": "user", "content": "Hi"}],
                                              greedy(2))[0].prompt_token_ids)
    assert "[user]" not in own  # the engine's template is untouched


def test_cumulative_logprob_sums_the_sampled_tokens(llm):
    out = llm.generate(PROMPT, greedy(5, logprobs=0))[0].outputs[0]
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    assert out.cumulative_logprob < 0
    assert llm.generate(PROMPT, greedy(2))[0].outputs[0].cumulative_logprob is None


def test_a_prompts_cache_salt_keeps_its_prefix_to_its_salt(llm):
    """vLLM's {"prompt": ..., "cache_salt": ...}: the prefix cache serves a prompt blocks
    computed under its salt only; the output does not change."""
    prompt = "A salted prompt for the offline API, long enough for two blocks. " * 3
    engine = llm.llm_engine

    def hit(*prompts) -> tuple[int, list[str]]:
        before = engine.stats()["prefix_cache_hit_tokens"]
        outputs = llm.generate(list(prompts), greedy(4))
        return engine.stats()["prefix_cache_hit_tokens"] - before, texts(outputs)

    salted = {"prompt": prompt, "cache_salt": "offline-a"}
    first, want = hit(salted)
    assert first == 0
    assert hit({"prompt": prompt})[0] == 0  # unsalted: no hit of the salted blocks
    assert hit({**salted, "cache_salt": "offline-b"})[0] == 0
    again, text = hit(salted)
    assert again >= 32 and text == want
    # One params object, prompts with and without a salt: each keeps to its own.
    assert hit(prompt, {**salted, "cache_salt": "offline-c"})[0] >= 32  # (the unsalted one)
    with pytest.raises(InvalidRequest, match="cache_salt"):
        llm.generate({**salted, "cache_salt": "a/b"}, greedy(1))


def test_priorities_order_the_prompts_under_the_priority_policy(embedded):
    """vLLM's --scheduling-policy priority: with one seat, the prompts run lowest priority
    value first (arrival breaks ties), each with the tokens it has alone. Under fcfs (the
    default) priorities are taken and unused, as vLLM's fcfs queue takes them."""
    prompts = ["One", "Two", "Three", "Four"]
    for policy, want in (("priority", ["Two", "Four", "Three", "One"]), ("fcfs", prompts)):
        engine = make_engine(embedded, scheduling_policy=policy, max_num_seqs=1)
        llm = LLM.from_engine(engine)
        alone = texts(llm.generate(prompts, greedy(3)))
        order = []
        step = engine.step

        def recorded(step=step, order=order):
            outputs = step()
            order.extend(o.prompt for o in outputs if o.finished)
            return outputs

        engine.step = recorded
        ranked = llm.generate(prompts, greedy(3), priority=[2, 0, 1, 0])
        assert order == want, policy
        assert texts(ranked) == alone  # in prompt order
    with pytest.raises(InvalidRequest, match="2 priorities for 4 prompts"):
        llm.generate(prompts, greedy(1), priority=[1, 2])
