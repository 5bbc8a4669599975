"""Guided decoding on llguidance: constraints compiled to grammars (cached by key), a
matcher per request (its samples' copies of it), and the batch token bitmask the sampler
applies to the logits."""

from pagedserve.structured.bitmask import allocate_bitmask, apply_bitmask
from pagedserve.structured.grammar import GrammarCompiler, LLGuide

__all__ = ["GrammarCompiler", "LLGuide", "allocate_bitmask", "apply_bitmask"]
