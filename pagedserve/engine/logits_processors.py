"""What is done to a batch's logits before a token is drawn from them (vLLM's logits
processors): structured outputs' grammar masks, then HF's repetition penalty, OpenAI's
presence/frequency penalties and logit_bias, vLLM's allowed_token_ids, bad_words, min_tokens
and thinking_token_budget. Each runs in a few batched operations over the rows that ask for
it, whatever their number.
Logprobs are taken between the masks and the rest, as vLLM takes them: of the distribution
a grammar allows, before the biases and penalties."""

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.engine.step_inputs import on_device
from pagedserve.models.reasoning import ReasoningParser
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.scheduler import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    TOO_MANY_BAD_WORDS,
    InvalidRequest,
    SamplingParams,
    Sequence,
    ThinkingBudget,
)
from pagedserve.structured import allocate_bitmask, apply_bitmask


def process(logits: torch.Tensor, rows: list[Sequence], pending: torch.Tensor | None,
            eos_token_ids: tuple[int, ...]) -> None:
    """Every processor but the grammars' masks (applied before: apply_grammars), in place,
    in this order (vLLM's: a token's bias, then its penalties over the biased logit;
    min_tokens, then bad words last: each gives way where a grammar, allowed_token_ids or
    what came before it allow nothing else, so a sample never ends early or draws a token
    nothing allows). A token a grammar masked stays masked: no bias or penalty lifts -inf."""
    apply_logit_bias(logits, rows)
    apply_penalties(logits, rows, pending)
    apply_allowed_tokens(logits, rows)
    mask_early_stops(logits, rows, eos_token_ids)
    apply_bad_words(logits, rows)
    force_thinking_end(logits, rows)  # (last: a thought out of budget ends, whatever else)


def needs_processing(r: Sequence) -> bool:
    p = r.params
    return (penalized(r) or r.guide is not None or bool(p.logit_bias)
            or p.allowed_token_ids is not None or r.bad_words is not None
            or r.num_output_tokens < p.min_tokens or r.thinking_budget is not None)


def needs_token_history(r: Sequence) -> bool:
    """Whether sampling this sequence reads its earlier tokens' ids on the host (a grammar's
    matcher, a bad word of several tokens, a thinking budget's count), so its last token
    must be read back before its next one is sampled (the forward need not wait).
    Penalties need not: a token still in flight joins them on the device (``pending``)."""
    return (r.guide is not None or r.thinking_budget is not None
            or r.bad_words is not None and bool(r.bad_words.by_prefix_end))


def penalized(r: Sequence) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


def apply_penalties(logits: torch.Tensor, rows: list[Sequence],
                    pending: torch.Tensor | None) -> None:
    """HF's repetition penalty over every token a row has seen (prompt and output), then
    OpenAI's presence and frequency penalties over its output: each in a few batched ops
    over the rows that ask, on each row's distinct tokens (Sequence.counted_outputs), not
    its whole output. A row's last token may still be on the device only (``pending``); it
    joins the host's tokens there, so that every logit gets what it would with that token
    on the host, bit for bit. A (row, token) pair listed twice (a token in the prompt and
    the output, or pending and seen before) writes the same value both times."""
    dev = logits.device
    repeating = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    counting = [i for i, r in enumerate(rows)
                if r.params.presence_penalty or r.params.frequency_penalty]
    seen = {i: rows[i].counted_outputs() for i in {*repeating, *counting}}  # (once for both)
    if repeating:
        # A prompt's distinct tokens reach the device once a request (its samples share
        # them), each row's distinct output tokens every step.
        prompts = [prompt_tokens(rows[i], dev) for i in repeating]
        j, token, _ = _output_pairs(seen, repeating, dev)
        pending_j, pending_token = _pending_pairs(pending, rows, repeating, dev)
        j = torch.cat([rows_of([len(t) for t in prompts], dev), j, *pending_j])
        token = torch.cat([*prompts, token, *pending_token])
        at = _flat_index(logits, on_device(repeating, dev, torch.long)[j], token)
        factor = on_device([rows[i].params.repetition_penalty for i in repeating], dev)[j]
        vals = logits.view(-1).index_select(0, at)
        logits.view(-1).index_copy_(0, at, torch.where(vals > 0, vals / factor, vals * factor))
    if counting:
        j, token, count = _output_pairs(seen, counting, dev)
        pending_j, pending_token = _pending_pairs(pending, rows, counting, dev)
        params = [rows[i].params for i in counting]
        frequency = on_device([p.frequency_penalty for p in params], dev)
        presence = on_device([p.presence_penalty for p in params], dev)
        rows_at = on_device(counting, dev, torch.long)
        if pending_j:  # a pending token counts once more where the row has seen it
            last = torch.full((len(counting),), -1, dtype=torch.long, device=dev)
            last[pending_j[0]] = pending_token[0]
            again = token == last[j]  # (a row's distinct tokens: one match at most)
            count = count + again
        _add_at(logits, rows_at[j], token, -(count * frequency[j] + presence[j]))
        if pending_j:  # and is counted anew where it has not (no pair written twice)
            k = pending_j[0]
            new = 1.0 - torch.zeros(len(counting), device=dev).index_add_(0, j, again.float())[k]
            _add_at(logits, rows_at[k], pending_token[0], -(frequency[k] + presence[k]) * new)


def _flat_index(logits: torch.Tensor, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Where logits[row, token] is in logits.view(-1): one index a pair, read and written
    with index_select/index_copy_ (on a CPU ~6x faster than logits[row, token])."""
    return row * logits.shape[1] + token


def _add_at(logits: torch.Tensor, row: torch.Tensor, token: torch.Tensor,
            values: torch.Tensor) -> None:
    """logits[row, token] += values, each (row, token) pair given once."""
    at, flat = _flat_index(logits, row, token), logits.view(-1)
    flat.index_copy_(0, at, flat.index_select(0, at) + values)


def _output_pairs(seen: dict[int, tuple[np.ndarray, np.ndarray]], subset: list[int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(j, token, count) for each distinct output token of rows[subset[j]], on the device."""
    parts = [seen[i] for i in subset]
    return (rows_of([len(tokens) for tokens, _ in parts], device),
            on_device(np.concatenate([tokens for tokens, _ in parts]), device, torch.long),
            on_device(np.concatenate([counts for _, counts in parts]), device, torch.float32))


def prompt_tokens(r: Sequence, device: torch.device) -> torch.Tensor:
    """The distinct tokens of ``r``'s prompt on the device, built once for the request's
    samples (Sequence.prompt_derived)."""
    derived = r.prompt_derived
    if (key := ("prompt tokens", device)) not in derived:
        derived[key] = on_device(sorted(set(r.token_ids[:r.num_prompt_tokens])), device,
                                 torch.long)
    return derived[key]


def _pending_pairs(pending: torch.Tensor | None, rows: list[Sequence], subset: list[int],
                   device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """([j], [token]) for the rows of rows[subset] whose last token is still on the device
    only (``pending``); ([], []) where none is."""
    waiting = [k for k, i in enumerate(subset) if rows[i].last_token_pending]
    if not waiting:
        return [], []
    assert pending is not None, "a penalized row's last token is in flight: pass pending"
    return ([on_device(waiting, device, torch.long)],
            [pending[on_device([subset[k] for k in waiting], device, torch.long)]])


def rows_of(lengths: list[int], device: torch.device) -> torch.Tensor:
    """j, lengths[j] times, for each j: the row of each token of token lists laid end to
    end, one of lengths[j] tokens a row."""
    return torch.arange(len(lengths), device=device).repeat_interleave(
        on_device(lengths, device, torch.long), output_size=sum(lengths))  # no device sync


def request_tensor(r: Sequence, key: str, values: Callable[[], list], device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """A request's fixed ids or values on the device, built once (SamplingParams.memo)."""
    return r.params.memo((key, device, dtype), lambda: on_device(values(), device, dtype))


def request_pairs(rows: list[Sequence], key: str, ids: Callable[[Sequence], list[int]],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(j, token) for each of rows[j]'s fixed ids, from the tensors built once per request."""
    tokens = [request_tensor(r, key, lambda r=r: ids(r), device, torch.long) for r in rows]
    return rows_of([len(t) for t in tokens], device), torch.cat(tokens)


def apply_logit_bias(logits: torch.Tensor, rows: list[Sequence]) -> None:
    """OpenAI's logit_bias: a per-token offset added to the logits (before the penalties;
    logprobs report the logits before it)."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if biased:
        dev, chosen = logits.device, [rows[i] for i in biased]
        j, token = request_pairs(chosen, "bias_ids", lambda r: list(r.params.logit_bias), dev)
        bias = torch.cat([request_tensor(r, "bias", lambda r=r: list(r.params.logit_bias.values()),
                                         dev, logits.dtype) for r in chosen])
        _add_at(logits, on_device(biased, dev, torch.long)[j], token, bias)


def apply_allowed_tokens(logits: torch.Tensor, rows: list[Sequence]) -> None:
    """vLLM's allowed_token_ids: every other token masked out."""
    limited = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if limited:
        dev = logits.device
        j, token = request_pairs([rows[i] for i in limited], "allowed",
                                 lambda r: r.params.allowed_token_ids, dev)
        mask = torch.full((len(limited), logits.shape[1]), float("-inf"), device=dev)
        mask[j, token] = 0.0
        logits[on_device(limited, dev, torch.long)] += mask


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of bad_words: each word's tokens as it would start the text, and as it
    would follow a space where that is another first token of the same length (so the word
    is forbidden at the start and within the text)."""
    def encode(text: str) -> tuple[int, ...]:
        try:
            return tuple(tokenizer.encode(text, add_special_tokens=False))
        except ValueError as e:  # text that cannot be tokenized
            raise InvalidRequest(f"bad_words: {e}", "bad_words") from None

    if sum(map(len, words)) > MAX_BAD_WORD_TOKENS * tokenizer.max_chars_per_token:
        # (too many tokens for sure: refused before the engine's thread encodes megabytes)
        raise InvalidRequest(f"bad_words hold more than {MAX_BAD_WORD_TOKENS} tokens",
                             "bad_words")
    found: list[tuple[int, ...]] = []
    for word in words:
        alone = encode(word.lstrip())
        if not alone:
            raise InvalidRequest("bad_words entries must tokenize to at least one token",
                                 "bad_words")
        spaced = encode(" " + word.lstrip())
        found += [alone] + ([spaced] if spaced and spaced[0] != alone[0]
                            and len(spaced) == len(alone) else [])
    if len(found) > MAX_BAD_WORDS:
        raise InvalidRequest(TOO_MANY_BAD_WORDS, "bad_words")
    if sum(map(len, found)) > MAX_BAD_WORD_TOKENS:
        raise InvalidRequest(f"Too many total bad word tokens: {sum(map(len, found))}. The "
                             f"max is {MAX_BAD_WORD_TOKENS}.", "bad_words")
    return tuple(found)


def apply_bad_words(logits: torch.Tensor, rows: list[Sequence]) -> None:
    """vLLM's bad_words: a word's last token is masked out where the row's output ends with
    the word's other tokens (a one-token word, always). The prompt does not count. Where a
    row's grammar or allowed tokens allow nothing else, they win (as over min_tokens):
    a sample of no allowed token would be garbage."""
    banning = [i for i, r in enumerate(rows) if r.bad_words is not None]
    if not banning:
        return
    dev = logits.device
    # One-token words from tensors built once a request; longer ones looked up by the
    # row's last token, so a step costs the words that may end there, not all of them.
    j, token = request_pairs([rows[i] for i in banning], "bad singles",
                             lambda r: list(r.bad_words.singles), dev)
    row = on_device(banning, dev, torch.long)[j]
    ends = [(i, word[-1]) for i in banning for word in _words_ending_here(rows[i])]
    if ends:
        row = torch.cat([row, on_device([i for i, _ in ends], dev, torch.long)])
        token = torch.cat([token, on_device([t for _, t in ends], dev, torch.long)])
    _mask_giving_way(logits, row, token, [i for i in banning if _constrained(rows[i])])


def _words_ending_here(r: Sequence) -> list[tuple[int, ...]]:
    """r's words of several tokens whose other tokens its known output ends with."""
    longer, end = r.bad_words.by_prefix_end, r.num_known_tokens
    if not longer or end <= r.num_prompt_tokens:
        return []
    ids = r.token_ids
    return [w for w in longer.get(ids[end - 1], ()) if end - r.num_prompt_tokens >= len(w) - 1
            and tuple(ids[end - len(w) + 1:end]) == w[:-1]]


def _constrained(r: Sequence) -> bool:
    """A grammar or allowed_token_ids: what else the row may sample may be nothing."""
    return r.guide is not None or r.params.allowed_token_ids is not None


def _mask_giving_way(logits: torch.Tensor, row: torch.Tensor, token: torch.Tensor,
                     constrained: list[int]) -> None:
    """logits[row, token] = -inf, except in the rows of ``constrained`` that this would
    leave with no token at all: there they keep their values (what the row's constraint
    allows wins over min_tokens and bad words)."""
    kept = logits[row, token]
    logits[row, token] = float("-inf")
    if constrained:
        nothing_else = torch.zeros(len(logits), dtype=torch.bool, device=logits.device)
        at = on_device(constrained, logits.device, torch.long)
        nothing_else[at] = (logits[at] == float("-inf")).all(dim=1)
        logits[row, token] = torch.where(nothing_else[row], kept, logits[row, token])


def mask_early_stops(logits: torch.Tensor, rows: list[Sequence],
                      eos_token_ids: tuple[int, ...]) -> None:
    """Before min_tokens, EOS and stop tokens cannot be sampled (EOS under ignore_eos too, as
    vLLM masks it); unless a row's grammar or allowed tokens allow nothing else, in which
    case they win."""
    early = [i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens]
    if not early or not eos_token_ids and not any(rows[i].params.stop_token_ids
                                                  for i in early):
        return
    dev = logits.device
    j, token = request_pairs([rows[i] for i in early], f"early_stops{eos_token_ids}",
                             lambda r: [*r.params.stop_token_ids, *eos_token_ids], dev)
    _mask_giving_way(logits, on_device(early, dev, torch.long)[j], token,
                     [i for i in early if _constrained(rows[i])])


def apply_grammars(logits: torch.Tensor, rows: list[Sequence]) -> None:
    """Each guided row's matcher writes its allowed tokens into one batch bitmask, applied
    to those rows in one operation. The matchers have consumed every appended token
    (Scheduler.settle advances them), so the mask is for the token about to be sampled."""
    guided = [i for i, r in enumerate(rows) if r.guide is not None]
    if not guided:
        return
    bitmask = allocate_bitmask(len(guided), logits.shape[1], pin=logits.is_cuda)
    for j, i in enumerate(guided):
        rows[i].guide.fill_bitmask(bitmask, j)
    apply_bitmask(logits, bitmask, None if len(guided) == len(rows)
                  else on_device(guided, logits.device, torch.long))


def thinking_budget_of(params: SamplingParams, reasoning: ReasoningParser | None
                       ) -> ThinkingBudget | None:
    """A request's thinking_token_budget with its model's think tags: a 400 where the engine
    has no reasoning parser to know them (vLLM's words, but its --reasoning-config)."""
    if params.thinking_token_budget is None:
        return None
    if reasoning is None:
        raise InvalidRequest("thinking_token_budget is set but no reasoning parser is "
                             "configured. Please set --reasoning-parser to use "
                             "thinking_token_budget.", "thinking_token_budget")
    return ThinkingBudget(reasoning.start_id, reasoning.end_id, params.thinking_token_budget)


def _think_tags(r: Sequence, b: ThinkingBudget) -> tuple[int, int]:
    """The indices of ``r``'s last start and end tags (-1: none), reading only the tokens
    settled since the last call (a list that shrank, a stop's dropped token, is read anew;
    a token still in flight is read once it is settled)."""
    ids, known = r.token_ids, r.num_known_tokens
    seen, start, end = r.think_tags if r.think_tags[0] <= known else (0, -1, -1)
    for k in range(seen, known):
        if ids[k] == b.start:
            start = k
        elif ids[k] == b.end:
            end = k
    r.think_tags = (known, start, end)
    return start, end


def force_thinking_end(logits: torch.Tensor, rows: list[Sequence]) -> None:
    """vLLM's thinking_token_budget: a row that has thought its budget out (as many tokens
    since its last start tag, the prompt's or its own, with no end tag since) draws the end
    tag next. A row that never opened a thinking is left alone (and a row whose grammar
    takes its first token has no budget: LLMEngine.add_request)."""
    over = []
    for i, r in enumerate(rows):
        if (b := r.thinking_budget) is not None:
            start, end = _think_tags(r, b)
            if start > end and len(r.token_ids) - 1 - start >= b.budget:
                over.append(i)
    if over:
        row = on_device(over, logits.device, torch.long)
        end = on_device([rows[i].thinking_budget.end for i in over], logits.device, torch.long)
        logits[row] = float("-inf")
        logits[row, end] = 0.0
