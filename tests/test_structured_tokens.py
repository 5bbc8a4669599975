"""The vocabulary guided decoding sees (structured/grammar.py's TokenTable): every token spells
the bytes the tokenizer gives it, special tokens are marked special, and an added token that
is plain text (Qwen3's <think>, <tool_call>) is text a constraint can ask for."""

import json

import llguidance
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from pagedserve.models.tokenizer import Tokenizer
from pagedserve.scheduler import InvalidRequest, StructuredOutputs
from pagedserve.structured import GrammarCompiler
from pagedserve.structured.bitmask import allocate_bitmask, allowed_tokens


@pytest.fixture(scope="module")
def thinking_tokenizer(tiny_llama) -> Tokenizer:
    """The embedded tokenizer with Qwen3's kinds of added tokens: text, and special."""
    base = tiny_llama.tokenizer
    backend = Backend.from_str(base.backend.to_str())
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ("<think>", "</think>")])
    backend.add_special_tokens([AddedToken("<|tool|>", special=True, normalized=False)])
    return Tokenizer(backend, bos_token_id=base.bos_token_id,
                     eos_token_ids=base.eos_token_ids, add_bos=base.add_bos)


def ids_of(tokenizer: Tokenizer, *texts: str) -> list[int]:
    return [tokenizer.backend.token_to_id(t) for t in texts]


def test_every_token_is_spelled_as_the_tokenizers_json_spells_it(thinking_tokenizer):
    """Against llguidance's own reading of tokenizer.json: the same bytes and the same
    special marks, except for the added tokens that are text, which it marks special."""
    tok = thinking_tokenizer
    size = tok.vocab_size
    ours = GrammarCompiler(tok, size).tokenizer
    theirs = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=size,
                                    eos_token=tok.eos_token_ids[0])
    text_tokens = set(ids_of(tok, "<think>", "</think>"))
    differ = [i for i in range(size) if ours.decode_bytes([i]) != theirs.decode_bytes([i])
              or ours.is_special_token(i) != theirs.is_special_token(i)]
    assert set(differ) == text_tokens
    assert all(not ours.is_special_token(i) for i in text_tokens)
    special = ids_of(tok, "<|tool|>")[0]
    assert ours.is_special_token(special) and ours.decode_bytes([special]) == b"<|tool|>"


def walk(compiler: GrammarCompiler, so: StructuredOutputs, prefer: set[int]) -> list[int]:
    """The tokens a matcher lets through, taking a preferred token wherever one is allowed
    (else the lowest id), until the grammar ends."""
    guide = compiler.guide(so)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    out: list[int] = []
    for _ in range(40):
        guide.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist()
        assert allowed, guide.matcher.get_error()
        token = next((t for t in allowed if t in prefer), allowed[0])
        out.append(token)
        if guide.accept(token):
            break
    assert guide.error is None
    return out


@pytest.mark.parametrize("so", [
    StructuredOutputs(regex=r"<think>\n(yes|no)\n</think>\n\nok"),
    StructuredOutputs(choice=("<think>\nyes\n</think>\n\nok", "<think>\nno\n</think>\n\nok")),
    StructuredOutputs(json='{"const": "<think>yes</think>ok"}'),
], ids=["regex", "choice", "json"])
def test_a_constraint_may_ask_for_the_text_of_an_added_token(thinking_tokenizer, so):
    tok = thinking_tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size)
    compiler.compile(so)  # (llguidance's reading of the json refuses these: a 400)
    think, end = ids_of(tok, "<think>", "</think>")
    tokens = walk(compiler, so, prefer={think, end})
    assert think in tokens and end in tokens  # the added tokens themselves, where they fit
    text = tok.decode(tokens[:-1] if tokens[-1] in tok.eos_token_ids else tokens)
    assert text.replace('"', "").replace("\n", "") in ("<think>yes</think>ok",
                                                        "<think>no</think>ok")
    # and where the text is not what the grammar wants, the added token is not allowed
    guide = compiler.guide(StructuredOutputs(regex="(yes|no)"))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    guide.fill_bitmask(bitmask, 0)
    allowed = allowed_tokens(bitmask, compiler.vocab_size)[0]
    assert not allowed[think] and not allowed[end] and bool(allowed.any())


def test_a_grammar_still_names_special_tokens(thinking_tokenizer):
    tok = thinking_tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size)
    special = ids_of(tok, "<|tool|>")[0]
    so = StructuredOutputs(grammar='start: <|tool|> "x"')
    assert walk(compiler, so, prefer={special})[0] == special
    think = ids_of(tok, "<think>")[0]
    so = StructuredOutputs(grammar=f'start: <[{think}]> "x"')  # any token, by its id
    assert walk(compiler, so, prefer=set())[0] == think


def sentencepiece_tokenizer(prefix: str) -> Tokenizer:
    """A Llama-2-style vocabulary (pieces with "▁" for a space, <0xNN> byte fallback) that
    puts a space in front of every text, by a Prepend normalizer or by its Metaspace."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "h", "e", "l", "o", "▁h", "▁he", "▁hel", "▁hell", "▁hello"]:
        vocab[piece] = len(vocab)
    special = [{"id": i, "content": c, "special": True, "normalized": False,
                "single_word": False, "lstrip": False, "rstrip": False}
               for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    spec = {
        "version": "1.0", "added_tokens": special, "post_processor": None,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, replace]} if prefix == "prepend" else None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                          "split": False} if prefix == "metaspace" else None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": True,
                  "fuse_unk": True, "vocab": vocab,
                  "merges": ["▁ h", "▁h e", "▁he l", "▁hel l", "▁hell o"]},
    }
    backend = Backend.from_str(json.dumps(spec))
    assert backend.encode("hello").tokens == ["▁hello"]  # the space in front
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], add_bos=True)


@pytest.mark.parametrize("prefix", ["prepend", "metaspace"])
def test_a_vocabulary_that_puts_a_space_in_front_of_texts(prefix):
    """SentencePiece's: each token spelled as llguidance's own reader spells it, and the text
    a constraint forces tokenized as a piece of an output, not as a text of its own (else
    "hello" would come out " hello", and every constraint be refused)."""
    tok = sentencepiece_tokenizer(prefix)
    size = tok.vocab_size
    compiler = GrammarCompiler(tok, size)
    theirs = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=size, eos_token=2)
    assert all(compiler.tokenizer.decode_bytes([i]) == theirs.decode_bytes([i])
               for i in range(size))
    for so in [StructuredOutputs(regex="hello"), StructuredOutputs(choice=("hello", "he")),
               StructuredOutputs(json='{"const": "hello"}')]:
        tokens = walk(compiler, so, prefer=set())
        text = tok.decode([t for t in tokens if t != 2])
        assert text.strip('"') in ("hello", "he"), (so, text)


def test_a_model_vocabulary_past_the_tokenizers(thinking_tokenizer):
    """Qwen pads its vocabulary past its tokenizer's: the padding ids spell nothing, and a
    constraint's mask covers them (it was sized to the tokenizer: every mask failed)."""
    tok = thinking_tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size + 64)
    tokens = walk(compiler, StructuredOutputs(regex="(yes|no)!"), prefer=set())
    assert tok.decode(tokens[:-1] if tokens[-1] in tok.eos_token_ids else tokens) in (
        "yes!", "no!")
    assert all(t < tok.vocab_size for t in tokens)


def test_an_eos_added_as_text_stays_the_end(tiny_llama):
    """A fine-tune's <|im_end|> added as a plain token: a grammar ends the output with it,
    never writes it inside (the engine would stop there, the output cut)."""
    base = tiny_llama.tokenizer
    backend = Backend.from_str(base.backend.to_str())
    backend.add_tokens([AddedToken("<|end|>", special=False, normalized=False)])
    end = backend.token_to_id("<|end|>")
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=[end], add_bos=False)
    compiler = GrammarCompiler(tok, tok.vocab_size)
    guide = compiler.guide(StructuredOutputs(regex='"[a-z<|>]*"'))
    guide.accept(backend.token_to_id('"'))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    guide.fill_bitmask(bitmask, 0)
    assert not allowed_tokens(bitmask, compiler.vocab_size)[0][end]
    # Its text in a constraint is text, spelled with plain tokens (its id was forced, and
    # refused: every sample an "error").
    tokens = walk(compiler, StructuredOutputs(choice=("a<|end|>",)), prefer=set())
    assert end not in tokens[:-1] and tok.decode(tokens).startswith("a<|end|>")


def test_an_added_token_past_the_models_vocabulary_is_spelled_with_its_tokens(tiny_llama):
    """A tokenizer's added token the model has no row for: a constraint asking for its text
    gets the model's own tokens for it (the id itself would allow nothing: an empty mask)."""
    base = tiny_llama.tokenizer
    size = base.vocab_size
    backend = Backend.from_str(base.backend.to_str())
    backend.add_tokens([AddedToken("<extra_a>", special=False, normalized=False)])
    assert backend.token_to_id("<extra_a>") == size
    tok = Tokenizer(backend, bos_token_id=base.bos_token_id,
                    eos_token_ids=base.eos_token_ids, add_bos=base.add_bos)
    compiler = GrammarCompiler(tok, size)
    for so in (StructuredOutputs(regex="<extra_a>[a-z]{2}"),
               StructuredOutputs(json='{"const": "<extra_a>"}')):
        tokens = walk(compiler, so, prefer=set())
        assert max(tokens) < size
        assert tok.decode(tokens).startswith(('<extra_a>', '"<extra_a>"'))


@pytest.mark.parametrize("eos", [[], "past"], ids=["none", "past-the-vocabulary"])
def test_a_model_without_an_eos_token_takes_no_constraint(tiny_llama, eos):
    """A grammar ends with the EOS token: without one in the model's vocabulary a constraint
    is a 400 that says so (id 0 stood in for it, and ended outputs as text)."""
    base = tiny_llama.tokenizer
    size = base.vocab_size
    tok = Tokenizer(Backend.from_str(base.backend.to_str()), bos_token_id=base.bos_token_id,
                    eos_token_ids=[size + 3] if eos == "past" else [], add_bos=base.add_bos)
    with pytest.raises(InvalidRequest, match="end-of-sequence token") as e:
        GrammarCompiler(tok, size).compile(StructuredOutputs(regex="[a-z]{1,3}"))
    assert e.value.param == StructuredOutputs(regex="x").param


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TREE = _tool("tree", {"$defs": {"N": {"type": "object", "properties": {"kids": {
    "type": "array", "items": {"$ref": "#/$defs/N"}, "maxItems": 2}}, "required": ["kids"],
    "additionalProperties": False}}, "$ref": "#/$defs/N"})
RECURSIVE = _tool("rec", {"type": "object", "properties": {"child": {"anyOf": [
    {"$ref": "#"}, {"type": "null"}]}}, "required": ["child"], "additionalProperties": False})
FLAG_TRUE, FLAG_ONE = (_tool(name, {"$defs": {"Flag": {"const": value}}, "type": "object",
                                    "properties": {"x": {"$ref": "#/$defs/Flag"}},
                                    "required": ["x"], "additionalProperties": False})
                       for name, value in (("a", True), ("b", 1)))
ANCHOR_INT, ANCHOR_STR = (_tool(name, {
    "type": "object", "properties": {"v": {"$ref": "#n"}}, "required": ["v"],
    "additionalProperties": False, "$defs": {"N": {"$anchor": "n", **kind}}})
    for name, kind in (("fa", {"type": "integer"}), ("fb", {"type": "string", "maxLength": 5})))
IDENTIFIED = _tool("ident", {"$id": "http://x.test/w", "type": "object",
                             "properties": {"v": {"$ref": "#/$defs/W"},
                                            "u": {"$ref": "http://x.test/w#/$defs/W"}},
                             "required": ["v", "u"], "additionalProperties": False,
                             "$defs": {"W": {"type": "integer"}}})
ANCHORED = _tool("at", {"type": "object", "properties": {"loc": {"$ref": "#place"}},
                        "required": ["loc"], "additionalProperties": False,
                        "$defs": {"P": {"$anchor": "place", "type": "string"}}})


@pytest.mark.parametrize("tools, good, bad", [
    ([TREE], '{"name": "tree", "arguments": {"kids": [{"kids": []}]}}',
     '{"name": "tree", "arguments": {"kids": [[{"name": "tree", "arguments": {"kids": []}}]]}}'),
    ([RECURSIVE], '{"name": "rec", "arguments": {"child": {"child": null}}}',
     '{"name": "rec", "arguments": {"child": [{"name": "rec", "arguments": {"child": null}}]}}'),
    ([FLAG_TRUE, FLAG_ONE], '{"name": "b", "arguments": {"x": 1}}',
     '{"name": "b", "arguments": {"x": true}}'),
    ([ANCHORED], '{"name": "at", "arguments": {"loc": "x"}}',
     '{"name": "at", "arguments": {"loc": 1}}'),
    ([ANCHOR_INT, ANCHOR_STR], '{"name": "fa", "arguments": {"v": 1}}',
     '{"name": "fa", "arguments": {"v": "x"}}'),
    ([IDENTIFIED], '{"name": "ident", "arguments": {"v": 1, "u": 2}}',
     '{"name": "ident", "arguments": {"v": 1, "u": "x"}}'),
], ids=["defs", "root", "same-name", "anchor", "same-anchor", "root-id"])
def test_required_tool_schemas_keep_their_own_references(tiny_llama, tools, good, bad):
    """tool_choice required puts each tool's schema under the calls' array: its "#..."
    references still mean its own schema ("#" meant the array; $defs pointed at nothing,
    and two tools' $defs of one name were one)."""
    from pagedserve.server.protocol import ChatCompletionRequest

    tok = tiny_llama.tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size)
    grammar = compiler.compile(ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tools": tools,
        "tool_choice": "required"})._toolconstraint())

    def accepted(text: str) -> bool:
        matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
        ids = tok.encode(f"[{text}]", add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert accepted(good) and not accepted(bad)


def test_a_required_tool_with_an_inner_id_is_refused_clearly():
    """An $id below a tool schema's root makes a resource of its own, whose "#/..." pointers
    would no longer resolve once the schema moves: a 400 that says so."""
    from pagedserve.server.protocol import ChatCompletionRequest

    inner = _tool("in", {"type": "object", "properties": {"v": {
        "$id": "http://x.test/v", "$ref": "#/$defs/W", "$defs": {"W": {"type": "integer"}}}}})
    with pytest.raises(InvalidRequest, match=r"an \$id below the schema's root") as e:
        ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "x"}], "tools": [inner],
            "tool_choice": "required"})._toolconstraint()
    assert e.value.param == "tools"


def _ref_chain(n: int) -> str:
    defs = {f"D{i}": {"type": "object", "properties": {"v": {"$ref": f"#/$defs/D{i + 1}"}}}
            for i in range(n)}
    defs[f"D{n}"] = {"type": "integer"}
    return json.dumps({"$defs": defs, "type": "object",
                       "properties": {"x": {"$ref": "#/$defs/D0"}}, "required": ["x"]})


def test_a_schema_too_deep_through_its_refs_is_a_400_not_a_crash(tiny_llama):
    """A chain of ~1,000 $refs overflowed llguidance's stack as it built the grammar: the
    server's process died (a segfault). Now a 400; a recursive schema still compiles."""
    tok = tiny_llama.tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size)
    compiler.compile(StructuredOutputs(json=_ref_chain(50)))
    compiler.compile(StructuredOutputs(json=json.dumps(TREE["function"]["parameters"])))
    with pytest.raises(InvalidRequest, match="nested more than"):
        compiler.compile(StructuredOutputs(json=_ref_chain(3000)))


# Each case in a child process: a stack overflow there fails the test, not pytest.
_DEEP = """
import json, sys
from pagedserve.models.loader import load_model_files
from pagedserve.scheduler import InvalidRequest, StructuredOutputs
from pagedserve.structured import GrammarCompiler
tok = load_model_files(sys.argv[1]).tokenizer
compiler = GrammarCompiler(tok, tok.vocab_size)
lark = "start: r0\\n" + "".join(f"r{i}: r{i + 1}\\n" for i in range(3000)) + 'r3000: "a"\\n'
defs = {f"d{i}": {"$anchor": f"a{i}", "type": "object", "properties": {"a": {"$ref": f"#a{i + 1}"}},
                  "required": ["a"]} for i in range(1000)}
defs["d1000"] = {"$anchor": "a1000", "type": "integer"}
chain = {f"D{i}": {"type": "object", "properties": {"v": {"$ref": f"#/$defs/D{i + 1}"}}}
         for i in range(1000)}
chain["D1000"] = {"type": "integer"}
nested = json.dumps({"$defs": chain, "$ref": "#/$defs/D0"})
for so in (StructuredOutputs(grammar=lark),
           StructuredOutputs(json=json.dumps({"$ref": "#a0", "$defs": defs})),
           StructuredOutputs(grammar="start: %json " + nested),
           StructuredOutputs(grammar="root ::= " + " ".join(['"a"'] * 9000))):
    try:
        compiler.guide(so)
        print("compiled")
    except InvalidRequest as e:
        print("refused:", e)
"""


def test_deep_grammars_refused_or_compiled_never_a_crash(tiny_llama_dir):
    """A chain of 3,000 Lark rules, or of 1,000 $anchor references (which the depth check
    cannot follow), overflowed a thread's default 8 MiB stack inside llguidance: a SIGSEGV,
    the server gone. They compile on the compile threads' 512 MiB (structured/workers.py).
    A Lark grammar's %json schema gets the JSON schemas' depth check, and a GBNF grammar
    past 16 KB (whose conversion holds the GIL for seconds) is refused."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _DEEP, str(tiny_llama_dir)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == [
        "compiled", "compiled",
        "refused: Invalid grammar (its %json schema): nested more than 400 levels deep (its "
        "$refs followed)",
        "refused: Invalid grammar: longer than 16 KB (GBNF)"]


def test_a_panic_in_the_compile_is_a_400_without_its_backtrace(thinking_tokenizer):
    """llguidance panics on a schema of 15,000 properties (more grammar symbols than it
    counts in 16 bits), and the panic's message carries ~3 KB of native backtrace. The 400
    says what failed, without the frames."""
    tok = thinking_tokenizer
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string"}
                                               for i in range(15_000)}}
    with pytest.raises(InvalidRequest) as refused:
        GrammarCompiler(tok, tok.vocab_size).compile(StructuredOutputs(json=json.dumps(schema)))
    message = str(refused.value)
    assert message.startswith("Invalid JSON schema: panic: ") and "\n" not in message
    assert len(message) < 200


def test_compile_threads_start_where_the_large_stack_is_refused():
    """A host that grants no 512 MiB of address space to a thread (here a ulimit; a strict
    overcommit policy) still compiles grammars, on a smaller stack, and says so."""
    import subprocess
    import sys
    from pathlib import Path

    from pagedserve.structured import workers

    code = ("import importlib.util, logging; logging.basicConfig(); "
            f"spec = importlib.util.spec_from_file_location('w', r'{Path(workers.__file__)}'); "
            "w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w); "
            "print(w.run(lambda: 42))")
    p = subprocess.run(["bash", "-c", 'ulimit -v 400000; exec "$0" -c "$1"', sys.executable,
                        code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "42", p.stderr
    assert "run on a 64 MiB stack (512 MiB refused)" in p.stderr
