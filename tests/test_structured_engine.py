"""Guided decoding in the engine (docs/design.md §4): every sample follows its grammar and
finishes with "stop" when the grammar completes; the tokens do not depend on the path
(chunked, forked, preempted); compiled grammars are cached; bad constraints are refused
before anything is queued. On the tiny random-weight Llama: the grammar, not the weights,
makes the output valid."""

import json
import math
import re
from dataclasses import replace

import jsonschema
import pytest
import torch
from engine_utils import compile_threads_held, make_engine, prompts_of_lengths, run

from pagedserve.engine import InvalidRequest, SamplingParams
from pagedserve.scheduler import StructuredOutputs
from pagedserve.structured.bitmask import allocate_bitmask, allowed_tokens, unpack_words
from pagedserve.structured.schema import closed, subschemas

PROMPTS = prompts_of_lengths([15, 49, 64, 70], seed=1)
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "dims": {"type": "object", "properties": {"w": {"type": "boolean"}},
                 "required": ["w"], "additionalProperties": False},
    },
    "required": ["ok", "size", "dims"],
    "additionalProperties": False,
}
REGEX = "(yes|no)-[0-9]{2}"
# A discriminated union as pydantic writes it: oneOf.
UNION = {"oneOf": [
    {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "boolean"}},
     "required": ["kind", "x"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"enum": ["S", "M"]}},
     "required": ["kind", "y"], "additionalProperties": False}]}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


def constrained(so: StructuredOutputs, max_tokens: int = 40, **kw) -> SamplingParams:
    kw.setdefault("seed", 3)
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outputs]


@pytest.mark.parametrize("so, check", [
    (StructuredOutputs(json=json.dumps(SCHEMA)),
     lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    (StructuredOutputs(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
    (StructuredOutputs(choice=("red", "green", "blue")),
     lambda t: t in ("red", "green", "blue")),
    (StructuredOutputs(grammar='root ::= "x" [0-9] [0-9] "!"'),
     lambda t: re.fullmatch(r"x[0-9]{2}!", t)),
    (StructuredOutputs(json=json.dumps(UNION)),
     lambda t: jsonschema.validate(json.loads(t), UNION)),
], ids=["json_schema", "regex", "choice", "ebnf", "one_of"])
def test_every_sample_follows_the_grammar(engine, so, check):
    # (Any JSON object is left to the real model's server tests: random weights fill its
    # free-form strings with noise until max_tokens.)
    out = run(engine, PROMPTS[:2], constrained(so, n=4))
    for request in out:
        for sample in request.outputs:
            assert sample.finish_reason == "stop", sample.text
            assert check(sample.text) is not False, sample.text


def _independent(tiny_llama, so, n, **engine_config) -> list[list[list[int]]]:
    """Each sample i as its own single-sample request with seed + i."""
    engine = make_engine(tiny_llama, **engine_config)
    return [[run(engine, [p], constrained(so, seed=3 + i))[0].outputs[0].token_ids
             for i in range(n)] for p in PROMPTS]


def test_tokens_do_not_depend_on_the_path(tiny_llama):
    """Forked = independent seeds, chunked = whole, preempted = uninterrupted."""
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    whole = tokens(run(make_engine(tiny_llama), PROMPTS, constrained(so, n=2)))
    assert whole == _independent(tiny_llama, so, 2)  # forked = independent seeds
    chunked = make_engine(tiny_llama, max_num_batched_tokens=7)
    assert tokens(run(chunked, PROMPTS, constrained(so, n=2))) == whole
    # 4 prompts of up to ~110 tokens with 2 samples each in a 10-block pool: preempted.
    preempted = make_engine(tiny_llama, num_kv_blocks=10)
    assert tokens(run(preempted, PROMPTS, constrained(so, n=2))) == whole
    assert preempted.stats()["preemptions"] > 0


def test_guided_and_free_rows_share_a_batch(engine):
    """The bitmask lands on the guided rows only (an index into the batch's logits)."""
    so = StructuredOutputs(regex=REGEX)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = run(engine, PROMPTS[:2], [constrained(so), free])
    mixed = run(engine, PROMPTS[:2] * 2, [free, constrained(so), constrained(so), free])
    assert tokens(mixed[2:]) == tokens(alone)
    assert re.fullmatch(REGEX, alone[0].outputs[0].text)
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)


def test_grammar_completion_finishes_with_stop(engine):
    so = StructuredOutputs(choice=("alpha", "beta"))
    # ignore_eos and min_tokens cannot keep a complete grammar going.
    (out,) = run(engine, PROMPTS[:1], constrained(so, ignore_eos=True, min_tokens=8))
    assert out.outputs[0].text in ("alpha", "beta")
    assert out.outputs[0].finish_reason == "stop"
    # A grammar that allows nothing but a stop token beats min_tokens, which masks it.
    x = engine.tokenizer.encode("x")
    (out,) = run(engine, PROMPTS[:1], constrained(StructuredOutputs(regex="x"),
                                                  stop_token_ids=x, min_tokens=4))
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (x, "stop")
    # (before min_tokens the token is text, not a stop; after, a stop named as any is)
    (stopped,) = run(engine, PROMPTS[:1], constrained(StructuredOutputs(regex="x"),
                                                      stop_token_ids=x))
    assert (stopped.outputs[0].text, stopped.outputs[0].stop_reason) == ("", x[0])
    assert out.outputs[0].stop_reason is None and out.outputs[0].text == "x"
    # A stop string inside the grammar's text cuts it there, as anywhere.
    (cut,) = run(engine, PROMPTS[:1], constrained(StructuredOutputs(choice=("alphabet",)),
                                                  stop=["hab"]))
    assert (cut.outputs[0].text, cut.outputs[0].finish_reason) == ("alp", "stop")
    # A max_tokens that cuts the grammar short still finishes with "length".
    (cut,) = run(engine, PROMPTS[:1], constrained(StructuredOutputs(regex="[a-z]{30}"),
                                                  max_tokens=3))
    assert cut.outputs[0].finish_reason == "length"
    assert re.fullmatch("[a-z]+", cut.outputs[0].text)


def test_logprobs_are_of_what_the_grammar_allows(engine):
    """vLLM's: a constrained token's logprobs are of the distribution its grammar allows
    (before biases and penalties), so a choice's logprob says how sure the model is of it
    among the choices; a token the grammar forbids is -inf, never a top alternative."""
    so = StructuredOutputs(regex="(alpha|beta)-[0-9]")
    (out,) = run(engine, PROMPTS[:1], constrained(so, logprobs=20, logit_bias={5: 50}))
    sample = out.outputs[0]
    assert re.fullmatch("(alpha|beta)-[0-9]", sample.text)
    for lp in sample.logprobs:
        allowed = [v for _, v in lp.top if v != float("-inf")]
        assert 0 < len(allowed) < 20 and lp.logprob in allowed
        assert sum(map(math.exp, allowed)) == pytest.approx(1, abs=1e-4), lp
    assert sample.logprobs[-2].logprob == 0  # "-" is all the grammar allows there


@pytest.mark.parametrize("so, texts", [
    (StructuredOutputs(regex=r"<\|im_start\|>"), ["<|im_start|>"]),
    (StructuredOutputs(regex="(x|y)<filename>"), ["x<filename>", "y<filename>"]),
    (StructuredOutputs(choice=("<|im_end|>",)), ["<|im_end|>"]),
    (StructuredOutputs(json='{"const": "<|im_end|>"}'), ['"<|im_end|>"']),
], ids=["regex", "regex-later", "choice-eos", "json"])
def test_a_special_tokens_text_in_a_constraint_is_text(engine, so, texts):
    """The text of a special token (the EOS's too) in a constraint is spelled with plain
    tokens: its special id was forced, and refused (a 400, or every sample an "error")."""
    for o in run(engine, PROMPTS[:1], constrained(so, n=2))[0].outputs:
        assert (o.finish_reason, o.text in texts) == ("stop", True), o


def test_a_matcher_that_gives_up_ends_its_sample_as_error(engine):
    """A resource limit of llguidance's that trips mid-output (after a free first token, so
    the compile step could not see it) ends the sample as "error", never as a "stop" of an
    unfinished output; the batch beside it goes on as if it were alone."""
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    alone = run(engine, PROMPTS[1:2], free)
    limit = StructuredOutputs(regex="(b|c)a{500000}")
    engine.grammars.compile(limit)  # passes: its first token is a choice
    out = run(engine, PROMPTS[:2], [constrained(limit), free])
    assert out[0].outputs[0].finish_reason == "error"
    assert re.fullmatch("[bc]a*", out[0].outputs[0].text)
    assert tokens(out[1:]) == tokens(alone)
    assert engine.block_manager.num_used_blocks == 0


def test_a_matcher_that_gives_up_leaves_the_next_request_of_its_constraint_whole(engine):
    """Each request's matcher has a lexer of its own: a sample that runs its lexer out of
    states fails alone. Copies of one matcher would share the lexer, and every later request
    of the constraint would then fail at its first mask, whatever branch it takes."""
    b, c = (engine.tokenizer.encode(t, add_special_tokens=False)[0] for t in "bc")
    limit = StructuredOutputs(regex="(ba{500000}|c[a-z]{0,8})")
    branch = {token: constrained(limit, max_tokens=8, logit_bias={token: 100.0})
              for token in (b, c)}
    runs = [(token, run(engine, PROMPTS[:1], branch[token])[0].outputs[0])
            for token in (c, b, c, b, c)]
    for token, out in runs:
        assert out.token_ids[0] == token
        assert out.finish_reason == ("error" if token == b else "length"), (token, out)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("so", [
    StructuredOutputs(regex="a{1000000}"),  # the lexer's limit, on the first forced token
    StructuredOutputs(json=json.dumps({"type": "array", "minItems": 20000,
                                       "items": {"const": 1}})),  # the parser's item limit
    StructuredOutputs(json=json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}},
                                       "$ref": "#/$defs/a"})),  # matches nothing
    # llguidance counts keys, not distinct keys: {"a": 1, "a": 2} would pass
    StructuredOutputs(json=json.dumps({"type": "object", "minProperties": 2,
                                       "additionalProperties": {"type": "integer"}})),
    StructuredOutputs(json=json.dumps({"type": "object", "minProperties": 2,
                                       "required": [["a"], "b", "b"]})),
], ids=["lexer_limit", "item_limit", "empty_language", "min_properties", "odd_required"])
def test_constraints_the_matcher_cannot_follow_are_refused(engine, so):
    with pytest.raises(InvalidRequest):
        engine.grammars.compile(so)
    # minProperties within the required properties is kept by the required keys
    engine.grammars.compile(StructuredOutputs(json=json.dumps({
        "type": "object", "minProperties": 1, "required": ["a"],
        "properties": {"a": {"type": "integer"}}})))


def test_closed_schemas_allow_no_property_they_do_not_name():
    """vLLM's disable_additional_properties: additionalProperties false on every object
    schema that says nothing of it, nested or referenced; names and data are not schemas."""
    schema = {"type": "object", "properties": {
        "type": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a name
        "open": {"type": "object", "additionalProperties": True},
        "list": {"type": "array", "items": {"properties": {"y": {}}}}},
        "$defs": {"d": {"type": ["object", "null"]}},
        "default": {"type": "object"}, "enum": [{"type": "object"}]}
    before = json.dumps(schema)
    out = closed(schema)
    assert json.dumps(schema) == before  # the schema given is not changed
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["type"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in props["type"]["properties"]["x"]  # an integer
    assert out["default"] == {"type": "object"} and out["enum"] == [{"type": "object"}]
    assert [n for n in subschemas(out) if "minProperties" in n] == []


def test_compiled_grammars_are_cached(tiny_llama):
    engine = make_engine(tiny_llama)
    run(engine, PROMPTS[:2], constrained(StructuredOutputs(json=json.dumps(SCHEMA)),
                                         max_tokens=2))
    run(engine, PROMPTS[:2], constrained(StructuredOutputs(json=json.dumps(SCHEMA)),
                                         max_tokens=2))
    assert engine.grammars.compiles == 1
    run(engine, PROMPTS[:1], constrained(StructuredOutputs(regex=REGEX), max_tokens=2))
    assert engine.grammars.compiles == 2


def test_the_cache_keeps_choice_lists_apart(tiny_llama):
    """A cached grammar serves only its own list: not one whose strings join the same."""
    grammars = make_engine(tiny_llama).grammars
    grammars.compile(StructuredOutputs(choice=("",)))
    with pytest.raises(InvalidRequest):
        grammars.compile(StructuredOutputs(choice=()))
    joined = grammars.compile(StructuredOutputs(choice=("cat\x00dog",)))
    assert grammars.compile(StructuredOutputs(choice=("cat", "dog"))) != joined
    assert grammars.compiles == 4


def test_a_refused_constraint_is_kept_refused(tiny_llama):
    """A client repeating a constraint that took seconds to refuse costs nothing more, and
    each refusal names the field of its own request."""
    grammars = make_engine(tiny_llama).grammars
    bad = StructuredOutputs(regex="(unclosed", param="guided_regex")
    for param in ("guided_regex", "structured_outputs.regex"):
        with pytest.raises(InvalidRequest, match="Invalid regex") as refused:
            grammars.compile(replace(bad, param=param))
        assert refused.value.param == param
    assert grammars.compiles == 1


@pytest.mark.parametrize("so, param", [
    (StructuredOutputs(json='{"type": "nonsense"}', param="guided_json"), "guided_json"),
    (StructuredOutputs(json="{not json", param="response_format"), "response_format"),
    (StructuredOutputs(regex="(unclosed", param="guided_regex"), "guided_regex"),
    (StructuredOutputs(grammar="root ::= ((", param="guided_grammar"), "guided_grammar"),
    (StructuredOutputs(choice=(), param="guided_choice"), "guided_choice"),
    (StructuredOutputs(choice=tuple(map(str, range(2001))), param="guided_choice"),
     "guided_choice"),
    (StructuredOutputs(regex="a\\", param="guided_regex"), "guided_regex"),
    (StructuredOutputs(json='{"type": "number", "multipleOf": -3}', param="guided_json"),
     "guided_json"),
    (StructuredOutputs(grammar="start: %json " + json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "minProperties": 2}), param="guided_grammar"), "guided_grammar"),
    (StructuredOutputs(regex="a", choice=("a",), param="structured_outputs"),
     "structured_outputs"),
])
def test_bad_constraints_are_refused_before_queueing(engine, so, param):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request(PROMPTS[0], constrained(so))
    assert e.value.param == param
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0


def test_bitmask_unpacks_the_same_on_every_path():
    bitmask = allocate_bitmask(3, 100)
    bitmask[0] = 0
    bitmask[1, 1] = 0b101  # tokens 32 and 34 of word 1 stay allowed; the rest of it not
    allowed = allowed_tokens(bitmask, 100)
    assert not allowed[0].any() and allowed[2].all()
    assert allowed[1, :32].all() and allowed[1, 32] and not allowed[1, 33] and allowed[1, 34]
    assert not allowed[1, 35:64].any() and allowed[1, 64:].all()
    assert torch.equal(unpack_words(bitmask, 100), allowed)  # the device path's unpacking


def _slow_schema(properties: int) -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps({
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(properties)},
        "additionalProperties": False}))


def test_a_constraint_asked_for_twice_at_once_compiles_once(tiny_llama, caplog):
    """Two requests with one new schema share its compile; a waiter that goes away (a
    client's disconnect cancels its future) leaves no error behind."""
    grammars = make_engine(tiny_llama).grammars
    slow = _slow_schema(2000)
    gone = grammars.submit(slow)  # its callback runs first, before the others' results
    assert gone.cancel()
    first, second = grammars.submit(slow), grammars.submit(slow)
    with caplog.at_level("ERROR", logger="concurrent.futures"):
        assert first.result(timeout=120) == second.result(timeout=120)
        grammars.guide(slow)
    assert grammars.compiles == 1
    assert not caplog.records


def test_a_compile_nobody_waits_for_any_more_is_skipped(tiny_llama):
    """Queued while the compile threads are busy, a compile whose client went away (its
    future cancelled) never runs: clients that time out at once cannot keep the threads
    busy for everyone else."""
    import time

    grammars = make_engine(tiny_llama).grammars
    with compile_threads_held():
        gone = grammars.submit(_slow_schema(2300))
        assert gone.cancel()
        kept = grammars.submit(StructuredOutputs(regex="(yes|no)"))
    kept.result(timeout=120)
    deadline = time.monotonic() + 60
    while grammars._compiling and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not grammars._compiling and grammars.compiles == 1
    grammars.compile(_slow_schema(2300))  # asked again: compiled now
    assert grammars.compiles == 2


def test_a_held_compile_outlives_the_cache(tiny_llama):
    """Between a compile and its request's add (the engine loop's wait), other compiles may
    push it out of the cache: while its future is held, guide() still finds it."""
    import gc

    grammars = make_engine(tiny_llama).grammars
    grammars._cache_size = 1
    first, second = StructuredOutputs(regex="(yes|no)"), StructuredOutputs(regex="[0-9]{3}")
    held = grammars.submit(first)
    held.result(timeout=60)
    grammars.compile(second)  # the cache holds this one alone now
    grammars.guide(first)  # (back in the cache, the other out)
    assert grammars.compiles == 2
    del held
    gc.collect()
    grammars.compile(second)  # nothing held it: compiled again, and the first let go
    grammars.guide(first)
    assert grammars.compiles == 4


def test_a_compile_that_could_not_start_leaves_nothing_to_wait_for(tiny_llama, monkeypatch):
    """No compile thread could be started (a host out of threads): that request fails, and
    the next one for the same constraint compiles, rather than wait on a job never run."""
    from pagedserve.structured import workers

    grammars = make_engine(tiny_llama).grammars
    submit = workers.submit

    def refused(*args):
        raise RuntimeError("no thread could be started for grammar compiles")

    monkeypatch.setattr(workers, "submit", refused)
    with pytest.raises(RuntimeError, match="no thread"):
        grammars.compile(StructuredOutputs(regex=REGEX))
    monkeypatch.setattr(workers, "submit", submit)
    assert grammars.compile(StructuredOutputs(regex=REGEX))
    assert grammars.compiles == 1


def test_the_cache_holds_its_bounds_exactly(tiny_llama):
    """cache_size constraints are kept (the one past them pushes out the least recent), and
    the latest is kept even where its grammar alone is past cache_chars."""
    from pagedserve.structured import GrammarCompiler

    a, b, c = (StructuredOutputs(regex=r) for r in ("(yes|no)", "[0-9]{3}", "[a-z]{2}"))
    grammars = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size,
                               cache_size=2)
    for constraint in (a, b, a, b):
        grammars.compile(constraint)
    assert grammars.compiles == 2  # both kept
    grammars.compile(c)
    grammars.compile(b)  # kept (more recent than a)
    assert grammars.compiles == 3
    grammars.compile(a)  # pushed out by c
    assert grammars.compiles == 4
    tight = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size, cache_chars=1)
    tight.compile(a)
    tight.compile(a)
    assert tight.compiles == 1
    tight.compile(b)  # over the characters: the least recent goes, the latest stays
    tight.compile(a)
    assert tight.compiles == 3
