"""A real Llama checkpoint whose greedy output is a script: its next token is a function of
the current token alone, so that a test can have the server generate an exact text (a
reasoning block, then an answer) through the whole stack, weights and tokenizer included.

Every layer's attention and MLP output projections are zero, so the last hidden state is
the current token's embedding; token a's embedding is the basis vector of a slot of its own,
and lm_head's row for script[a] reads that slot. Tokens outside the script have a zero
embedding, hence all-zero logits (greedy picks token 0)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from pagedserve.models.tokenizer import Tokenizer

LOGIT = 20.0  # the scripted token's logit over the others' 0 (after the final norm: x8)


def with_added_tokens(base: Tokenizer, texts: list[str]) -> Tokenizer:
    """``base`` with ``texts`` added as plain-text tokens (as Qwen3's <think> and </think>)."""
    backend = Backend.from_str(base.backend.to_str())
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in texts])
    return Tokenizer(backend, bos_token_id=base.bos_token_id, eos_token_ids=base.eos_token_ids,
                     add_bos=base.add_bos, chat_template=base.chat_template)


def save_scripted_llama(path: Path, tokenizer: Tokenizer, script: dict[int, int],
                        hidden: int = 64) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    assert len(script) <= hidden, "one embedding slot a scripted token"
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2,
        bos_token_id=1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.zero_()
        for slot, (token, following) in enumerate(script.items()):
            model.model.embed_tokens.weight[token, slot] = 1.0
            model.lm_head.weight[following, slot] = LOGIT
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": tokenizer.chat_template}))


def script_of(tokenizer: Tokenizer, after: int, text: str, end: int) -> dict[int, int]:
    """The script that answers ``text`` (its tokens each distinct) after token ``after``,
    then ``end``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(set(ids)) == len(ids) and after not in ids, "a token's next must be one"
    chain = [after, *ids, end]
    return dict(zip(chain, chain[1:], strict=False))
