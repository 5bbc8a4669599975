"""The special tokens a Hugging Face directory names (models/tokenizer.py): a BOS is added
only where the tokenizer's post-processor adds it (no add_bos_token flag), and EOS ids
come from config.json too."""

from __future__ import annotations

import json

from engine_utils import save_byte_level_tokenizer

from pagedserve.models.tokenizer import Tokenizer


def test_a_named_bos_is_added_only_where_the_tokenizer_adds_it(tmp_path):
    """No add_bos_token flag: tokenizer.json's post-processor decides, as in transformers.
    A BOS the config names but nothing adds (SmolLM's, Qwen's) stays out of the prompt."""
    save_byte_level_tokenizer(tmp_path, 400)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert tok.bos_token_id == 1 and not tok.add_bos
    assert tok.encode("ab")[:1] != [1]
    # with a post-processor that adds it, it is added
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [1],
                                                         "tokens": ["<s>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert tok.add_bos and tok.encode("ab")[0] == 1


def test_eos_ids_of_config_json_end_generation_too(tmp_path):
    """EOS ids come from tokenizer_config, generation_config and config.json together (a
    Llama 3 instruct lists <|eot_id|> only in its config.json's eos_token_id)."""
    save_byte_level_tokenizer(tmp_path, 400)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert 2 in tok.eos_token_ids and 7 in tok.eos_token_ids


def _fields(pre: str) -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "abc", "<|end|>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 5}


def test_llama3_gguf_takes_a_whole_word_from_the_vocabulary_before_merging():
    """"abc" is in the vocabulary though no merge makes it: Llama 3's pre-tokenizers read it
    whole (one token), GPT-2's merge their way to "ab" + "c"."""
    for pre in ("llama-bpe", "llama3", "llama-v3"):
        tok = Tokenizer.from_gguf(_fields(pre))
        assert tok.encode("abc") == [4], pre
        assert tok.decode([4]) == "abc"
    assert Tokenizer.from_gguf(_fields("gpt-2")).encode("abc") == [3, 2]


def test_gguf_end_of_turn_and_message_tokens_end_a_sample_too():
    """Llama 3's GGUF names <|end_of_text|> as eos, <|eot_id|> as eot and <|eom_id|> as eom:
    each ends a sample (the first is the tokenizer's eos_token)."""
    fields = {**_fields("llama-bpe"),
              "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "abc", "<|end|>", "<|eot|>",
                                        "<|eom|>"],
              "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3, 3, 3],
              "tokenizer.ggml.eot_token_id": 6, "tokenizer.ggml.eom_token_id": 7}
    tok = Tokenizer.from_gguf(fields)
    assert tok.eos_token_ids == [5, 6, 7]
    assert tok.eos_token == "<|end|>"


def test_chat_templates_are_found_where_transformers_looks(tmp_path):
    """chat_template.json wins over tokenizer_config.json's template; a list of named
    templates gives "default" (wherever it stands) and "tool_use"; a template set in place
    of the model's replaces its named ones too (--chat-template)."""
    save_byte_level_tokenizer(tmp_path, 400)
    config = {"eos_token": "</s>", "chat_template": "config"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "file"}))
    assert Tokenizer.from_hf_dir(str(tmp_path)).chat_template == "file"
    (tmp_path / "chat_template.json").unlink()
    named = [{"name": "tool_use", "template": "tools {{ tools | length }}"},
             {"name": "default", "template": "plain"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "chat_template": named}))
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert tok.chat_template == "plain" and tok.tool_use_template.startswith("tools")
    hi = [{"role": "user", "content": "hi"}]
    tool = [{"type": "function", "function": {"name": "f"}}]
    assert tok.apply_chat_template(hi, tools=tool) == "tools 1"
    tok.set_chat_template("mine")
    assert tok.apply_chat_template(hi, tools=tool) == "mine"


def test_gguf_user_defined_tokens_are_whole_and_kept_in_the_text():
    """A GGUF's user-defined token (type 4, like <think>) is matched whole, as a control
    token is, but stays in decoded text (llama.cpp's), where a control token is dropped."""
    fields = {**_fields("gpt-2"),
              "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "abc", "<|end|>", "<t>"],
              "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3, 4]}
    tok = Tokenizer.from_gguf(fields)
    assert tok.encode("a<t>b") == [0, 6, 1]
    assert tok.decode([0, 6, 1, 5]) == "a<t>b"
