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
