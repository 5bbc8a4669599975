"""--reasoning-parser (models/reasoning.py): a thinking model's answer split into reasoning
and content as vLLM's qwen3 and deepseek_r1 parsers split it (their outputs for these texts
were read from vLLM 0.32's parsers), the same whether the text comes whole or in pieces; and
in the engine, a structured-output constraint that applies after the thinking.

The engine tests run a scripted checkpoint (tests/scripted_model.py): a real Llama whose
greedy answer to the chat prompt is "<think>Let me see.</think> Hi there!"."""

import pytest
import torch
from engine_utils import make_engine, run
from scripted_model import save_scripted_llama, script_of, with_added_tokens

from pagedserve.models.loader import load_model_files
from pagedserve.models.reasoning import ReasoningParser, split
from pagedserve.scheduler import InvalidRequest, SamplingParams, StructuredOutputs

ANSWER = "<think>Let me see.</think> Hi there!"
R = "\nR\n"

# text -> (reasoning, content) for both parsers, where vLLM's two agree
BOTH = {
    f"<think>{R}</think>\n\nC": (R, "\n\nC"),
    "R</think>C": ("R", "C"),  # the template opened the thinking
    "R": ("R", None),  # no end: all thinking (a length cut)
    "<think>R</think>": ("R", None),  # no answer: null, as an empty thinking would be
    "<think></think>C": (None, "C"),
    "R</thi": ("R</thi", None),  # cut where a tag might have begun: still thinking
}
QWEN3 = {"R<tool_call>{}</tool_call>": ("R", "<tool_call>{}</tool_call>"),
         "R</think>C<think>X": ("R", "C<think>X")}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return with_added_tokens(tiny_llama.tokenizer, ["<think>", "</think>", "<tool_call>"])


@pytest.fixture(scope="module")
def parsers(tokenizer):
    return {name: ReasoningParser.load(name, tokenizer) for name in ("qwen3", "deepseek_r1")}


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_the_answer_is_split_as_vllm_splits_it_whole_or_in_pieces(parsers):
    cases = [(name, text, want) for name in parsers for text, want in BOTH.items()]
    cases += [("qwen3", text, want) for text, want in QWEN3.items()]
    for name, text, want in cases:
        parser = parsers[name]
        assert split(parser.splitter(True), text) == want, (name, text)
        for size in (1, 2, 3, 5):  # a tag cut anywhere is held until it is known
            splitter, got = parser.splitter(True), ["", ""]
            for piece in _pieces(text, size):
                for k, part in enumerate(splitter.feed(piece)):
                    got[k] += part
            for k, part in enumerate(splitter.finish()):
                got[k] += part
            assert tuple(part or None for part in got) == want, (name, text, size)
    # an answer that starts after the thinking (the prompt closed it): all content
    assert split(parsers["qwen3"].splitter(False), "A</think>B") == (None, "A</think>B")
    # deepseek_r1 reads no <tool_call>
    assert split(parsers["deepseek_r1"].splitter(True), "R<tool_call>x") == ("R<tool_call>x",
                                                                           None)


def test_where_the_answer_starts_is_read_from_the_prompt(parsers, tokenizer):
    qwen3, r1 = parsers["qwen3"], parsers["deepseek_r1"]
    turn = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    think, end = qwen3.start_id, qwen3.end_id
    for parser in (qwen3, r1):
        assert parser.opens_thinking(turn, True)  # no tag: the model thinks first
        assert parser.opens_thinking([*turn, think], True)
        assert not parser.opens_thinking([*turn, think, 5, end, 6], True)
        assert not parser.opens_thinking([*turn, think, 5, end, *[7] * 80], True)  # (far back)
        assert not parser.opens_thinking(turn + [think], False)  # asked for no thinking
    # qwen3 reads back to the turn's start: an earlier turn's </think> is not this one's
    earlier = [think, 5, end, 6, *turn]
    assert qwen3.opens_thinking(earlier, True) and not r1.opens_thinking(earlier, True)
    called = [*turn, think, 5, qwen3.tool_call_id, 6]  # qwen3: a call ends the thinking
    assert not qwen3.opens_thinking(called, True) and r1.opens_thinking(called, True)
    assert qwen3.thinking({}) and not qwen3.thinking({"enable_thinking": False})
    assert r1.thinking({"enable_thinking": False})  # (deepseek_r1 reads no such variable)
    assert qwen3.reasoning_tokens([think, 5, 6, end, 7], True) == 2
    assert qwen3.reasoning_tokens([5, qwen3.tool_call_id, 7], True) == 1
    assert qwen3.reasoning_tokens([think, 5, end], False) == 0


def test_a_tokenizer_without_the_think_tokens_is_refused(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match="needs the tokens <think> and </think>"):
        ReasoningParser.load("qwen3", tiny_llama.tokenizer)
    with pytest.raises(ValueError, match="invalid reasoning parser: r2"):
        ReasoningParser.load("r2", tokenizer)


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("scripted-thinker")
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Say hi"}])
    save_scripted_llama(path, tokenizer,
                        script_of(tokenizer, prompt[-1], ANSWER, tokenizer.eos_token_ids[0]))
    return load_model_files(str(path), torch.float32), prompt


def test_a_constraint_applies_after_the_thinking(thinking_model, tokenizer):
    """Under a reasoning parser the thinking runs free and the grammar takes the answer
    (forks too, and a recomputed sample); where the prompt closed the thinking, or the
    server says it is over, the grammar takes the first token, as without a parser."""
    loaded, prompt = thinking_model
    choice = StructuredOutputs(choice=("yes", "no"))

    def texts(engine, prompt, **kw) -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice,
                                **kw)
        return [o.text for o in run(engine, [prompt], params)[0].outputs]

    plain = make_engine(loaded)
    assert texts(plain, prompt) == ["no"]
    assert tokenizer.decode(run(plain, [prompt], SamplingParams(
        temperature=0, max_tokens=20))[0].outputs[0].token_ids) == ANSWER
    thinker = make_engine(loaded, reasoning_parser="qwen3")
    assert texts(thinker, prompt, n=2) == ["<think>Let me see.</think>no"] * 2
    closed = prompt + tokenizer.encode("<think>x</think>", add_special_tokens=False)
    assert texts(thinker, closed) == ["no"]
    assert texts(thinker, prompt, reasoning_ended=True) == ["no"]
    # preempted mid-thought and recomputed: the same answer (a pool of 3 blocks for two
    # samples that share their prompt's 2 and need one more each)
    small = make_engine(loaded, reasoning_parser="qwen3", num_kv_blocks=3)
    assert texts(small, prompt, n=2) == ["<think>Let me see.</think>no"] * 2
    assert small.stats()["preemptions"] > 0
    assert thinker.block_manager.num_used_blocks == 0


def test_a_thinking_token_budget_forces_the_end_of_the_thinking(thinking_model, tokenizer):
    """vLLM's thinking_token_budget: after that many thinking tokens the end tag comes next
    (the script then goes on from it: " Hi there!"); a budget the thinking stays within, or
    -1, changes nothing; without a reasoning parser it is refused, as a bad value is."""
    loaded, prompt = thinking_model
    engine = make_engine(loaded, reasoning_parser="qwen3")

    def answer(budget, prompt=prompt, **kw) -> str:
        params = SamplingParams(temperature=0, max_tokens=20, thinking_token_budget=budget,
                                **kw)
        return run(engine, [prompt], params)[0].outputs[0].text

    assert answer(2) == "<think>Let me</think> Hi there!"
    assert answer(0) == "<think></think> Hi there!"
    assert answer(4) == answer(100) == answer(-1) == ANSWER
    # (last of the processors: a ban on the end tag does not keep a thinking going)
    assert answer(2, bad_words=["</think>"]) == "<think>Let me</think> Hi there!"
    assert answer(1, n=2, seed=0) == "<think>Let</think> Hi there!"  # (forks too)
    ahead = make_engine(loaded, reasoning_parser="qwen3", async_scheduling=True)
    assert run(ahead, [prompt], SamplingParams(temperature=0, max_tokens=20,
                                               thinking_token_budget=2))[0].outputs[0].text \
        == "<think>Let me</think> Hi there!"  # (the token in flight settles first)
    # a prompt that opened the thinking counts from its tag; one that closed it, not at all
    opened = prompt + tokenizer.encode("<think>Let", add_special_tokens=False)
    assert answer(2, opened) == " me</think> Hi there!"
    closed = prompt + tokenizer.encode("<think></think>", add_special_tokens=False)
    assert answer(0, closed) == " Hi there!"
    # a second thinking counts from its own start tag
    again = prompt + tokenizer.encode("<think>x</think><think>Let", add_special_tokens=False)
    assert answer(2, again) == " me</think> Hi there!"
    # a constraint in force from the first token (the chat's include_reasoning: false) leaves
    # no thinking to end: the budget forces no end tag into the grammar's answer
    choice = StructuredOutputs(choice=("yes", "no"))
    [out] = run(engine, [opened], SamplingParams(
        temperature=0, max_tokens=20, thinking_token_budget=1, structured_outputs=choice,
        reasoning_ended=True))[0].outputs
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    with pytest.raises(InvalidRequest, match="no reasoning parser is configured"):
        make_engine(loaded).add_request(prompt, SamplingParams(thinking_token_budget=3))
    for bad in (-2, 1.5, True):
        with pytest.raises(InvalidRequest, match="must be a non-negative integer or -1"):
            SamplingParams(thinking_token_budget=bad)
    assert engine.block_manager.num_used_blocks == 0


def test_a_gate_says_its_matchers_error():
    """A matcher that gave up (a resource limit) ends the sample as "error" through the gate
    too; a fork keeps whether the thinking is over."""
    from pagedserve.structured.grammar import ThinkingGate

    class Matcher:
        error = "the grammar's limit"

        def fork(self):
            return self

    gate = ThinkingGate(Matcher(), end=9)
    assert gate.error == "the grammar's limit"
    assert not gate.accept(9) and not gate.waiting
    assert not gate.fork().waiting and ThinkingGate(Matcher(), 9).fork().waiting


def test_the_budgets_tag_reading_follows_a_list_that_shrank():
    """Each step reads only a sample's new tokens for tags; a list shorter than what was
    read (a token dropped) is read again whole, not by its stale indices."""
    from pagedserve.engine.logits_processors import force_thinking_end
    from pagedserve.scheduler import Sequence, ThinkingBudget

    seq = Sequence("r", [1, 7, 3, 3, 8], SamplingParams(), arrival=0.0,
                   thinking_budget=ThinkingBudget(start=7, end=8, budget=1))
    logits = torch.zeros(1, 10)
    force_thinking_end(logits, [seq])
    assert bool((logits == 0).all())  # closed by its 8: nothing forced
    seq.token_ids[-1:] = []  # the end tag dropped: the thinking is open, 2 tokens long
    force_thinking_end(logits, [seq])
    assert logits[0].argmax().item() == 8 and bool(torch.isinf(logits[0, :8]).all())


def test_the_budgets_tag_reading_waits_for_a_token_in_flight():
    """Asynchronous scheduling: a sample's last token may still be a placeholder on the host;
    the tag it turns out to be is read once it is settled, not skipped as already read."""
    from pagedserve.engine.logits_processors import force_thinking_end
    from pagedserve.scheduler import Sequence, ThinkingBudget
    from pagedserve.scheduler.sequence import PENDING_TOKEN

    seq = Sequence("r", [1, 7, 3, PENDING_TOKEN], SamplingParams(), arrival=0.0,
                   thinking_budget=ThinkingBudget(start=7, end=8, budget=5))
    logits = torch.zeros(1, 10)
    force_thinking_end(logits, [seq])  # 2 tokens of thinking: under the budget
    seq.token_ids[-1] = 8  # the placeholder settles as the end tag
    seq.token_ids += [3, 3, 3, 3, 3]  # then the answer: 6 tokens since the start tag
    force_thinking_end(logits, [seq])
    assert bool((logits == 0).all())  # closed by its 8: nothing forced
