"""The offline API (engine/llm.py) as vLLM's LLM is called: its prompt forms, its keyword
names, one conversation or several, and all-or-nothing queueing."""

import pytest
from engine_utils import greedy, make_engine

from pagedserve.engine import LLM, InvalidRequest

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


def test_a_refused_prompt_queues_none(llm):
    with pytest.raises(InvalidRequest):
        llm.generate([PROMPT, ""], greedy(4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_blocks == 0
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        llm.generate({"text": PROMPT})
