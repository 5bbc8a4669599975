"""--reasoning-parser (vLLM's qwen3 and deepseek_r1): a chat answer's thinking, between
<think> and </think>, goes to the message's ``reasoning`` instead of its content (the
server's), and a structured output waits for the thinking's end (the engine's).

The text is split, not the token ids, and the same way whether the answer is streamed or
not (a stream holds back what could be the start of a tag). The answer starts in its
thinking unless the prompt already closed it (the chat template's own ``</think>``) or, for
qwen3, the template was asked for no thinking (``enable_thinking: false``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.models.tokenizer import Tokenizer

START, END, TOOL_CALL = "<think>", "</think>", "<tool_call>"
PARSERS = ("deepseek_r1", "qwen3")
# Qwen3's turn markers: its prompt is read back to the last of them for an open thinking.
_TURN_MARKERS = ("<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start_id: int
    end_id: int
    # qwen3's: a tool call opened while thinking ends the thinking (its tag is content)
    tool_call_id: int | None
    turn_ids: frozenset[int]

    @classmethod
    def load(cls, name: str, tokenizer: Tokenizer) -> ReasoningParser:
        """The parser for ``tokenizer``; ValueError where it has no <think>/</think> tokens."""
        if name not in PARSERS:
            raise ValueError(f"invalid reasoning parser: {name} (chose from {PARSERS})")
        ids = {text: tokenizer.backend.token_to_id(text)
               for text in (START, END, TOOL_CALL, *_TURN_MARKERS)}
        if ids[START] is None or ids[END] is None:
            raise ValueError(f"--reasoning-parser {name} needs the tokens {START} and {END}, "
                             "which this model's tokenizer does not have")
        qwen3 = name == "qwen3"
        return cls(name, ids[START], ids[END], ids[TOOL_CALL] if qwen3 else None,
                   frozenset(ids[m] for m in _TURN_MARKERS if qwen3 and ids[m] is not None))

    def thinking(self, template_kwargs: dict[str, Any]) -> bool:
        """Whether the model was asked to think: qwen3's template variable (default on)."""
        return self.name != "qwen3" or template_kwargs.get("enable_thinking", True) is not False

    def opens_thinking(self, prompt: list[int], thinking: bool) -> bool:
        """Whether the answer to ``prompt`` starts in its thinking (vLLM's reading of the
        prompt: the last think tag before the turn started decides)."""
        if not thinking:
            return False
        for token in reversed(prompt[-64:]):  # (where a chat prompt's turn opens: at once)
            if token == self.start_id or token in self.turn_ids:
                return True
            if token in (self.end_id, self.tool_call_id):
                return False
        # (else a scan in C for each tag: a long prompt is read on the server's event loop)
        turn = max((_last(prompt, t) for t in self.turn_ids), default=-1)
        tags = [(_last(prompt, t), t) for t in (self.start_id, self.end_id, self.tool_call_id)
                if t is not None]
        at, tag = max(tags)
        return at <= turn or tag == self.start_id

    def grammar_waits(self, prompt: list[int], ended: bool | None) -> bool:
        """Whether a structured output waits for the end of the thinking: the server's word
        where it gave one (vLLM's reasoning_ended), else the prompt's."""
        return not ended if ended is not None else self.opens_thinking(prompt, True)

    def splitter(self, starts_thinking: bool) -> ReasoningSplitter:
        return ReasoningSplitter(starts_thinking, self.tool_call_id is not None)

    def reasoning_tokens(self, output: list[int], starts_thinking: bool) -> int:
        """usage's completion_tokens_details.reasoning_tokens: the tokens of the thinking,
        its tags not counted."""
        if not starts_thinking:
            return 0
        ends = {self.end_id, self.tool_call_id} - {None}
        count = 0
        for token in output:
            if token in ends:
                break
            count += token != self.start_id
        return count


class ReasoningSplitter:
    """One answer's text, fed as it comes, into (reasoning, content) pieces. While thinking,
    <think> is dropped and </think> ends the thinking (dropped too); qwen3's <tool_call>
    ends it as well and stays, for the tool parser. After it, the text is all content."""

    def __init__(self, thinking: bool, tool_call_ends: bool):
        self.thinking = thinking
        self._tags = (START, END, TOOL_CALL) if tool_call_ends else (START, END)
        self._held = ""  # the end of the text so far that may open a tag

    def feed(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        text, self._held = self._held + text, ""
        reasoning = []
        while self.thinking:
            found = [(at, tag) for tag in self._tags if (at := text.find(tag)) >= 0]
            if not found:
                keep = _partial_tag_at_end(text, self._tags)
                reasoning.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                return "".join(reasoning), ""
            at, tag = min(found)
            reasoning.append(text[:at])
            if tag == START:
                text = text[at + len(START):]
                continue
            self.thinking = False
            text = text[at:] if tag == TOOL_CALL else text[at + len(END):]
        return "".join(reasoning), text

    def finish(self) -> tuple[str, str]:
        """What was held back: the answer ended inside its thinking."""
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", held)


def _last(ids: list[int], token: int) -> int:
    """The index of ``token``'s last occurrence in ``ids``, -1 for none."""
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1


def _partial_tag_at_end(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins one of ``tags``."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


def split(splitter: ReasoningSplitter, text: str) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content), None for either that is empty (vLLM's)."""
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return reasoning + more_reasoning or None, content + more_content or None
