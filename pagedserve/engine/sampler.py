"""Batched sampling: temperature, top-k/top-p/min-p, per-sample random streams, and logprobs
of the model's distribution as a grammar allows it, before biases and penalties (vLLM's;
the masks, biases and penalties are logits_processors.py's).

A random row draws its token by inverse CDF: one uniform number per token, compared with
the cumulative probabilities (in float64, so that no token's share is lost to rounding),
in vocabulary order. Only the rows that filter the vocabulary (top-k, top-p, min-p) sort
it, to find the tokens they keep, and on a CPU mostly just their most likely tokens: on a
2-vCPU host, sorting 64 rows of 49,152 logits took 235 ms, over three times a greedy
decode step of the embedded model.

Why vocabulary order: logits that differ in their last bits (a GPU's kernels round
differently at another batch size) reorder tokens of nearly equal probability, and a
draw in sorted order lands on the other one; in vocabulary order it moves only where the
uniform number falls at a token's edge. A flat 32k vocabulary at top_p 0.95, 1,024
seeded draws, 4 seeds: at 1e-6 relative noise 3-12 moved in sorted order, 1-4 in
vocabulary order; at 1e-5, 51-69 against 4-12 (tests/test_sampler.py). For the same
reason the mass that top_p keeps is summed in float64: a float32 sum's rounding differs
with the order a device adds in."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.engine import logits_processors
from pagedserve.engine.step_inputs import on_device
from pagedserve.kernels import reference
from pagedserve.scheduler import MIN_TEMPERATURE, SamplingParams, Sequence


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives, most likely first
    rank: int | None = None  # the token's rank in the distribution (prompt logprobs)


def make_generator(seed: int | None, sample_index: int,
                   device: torch.device | str = "cpu") -> torch.Generator | None:
    """Sample i of a request with seed s draws from the stream of seed s + i (on the device
    that samples: a stream on another device would draw other numbers). Unseeded samples
    have none: they draw together from the device's default stream, in one launch."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((seed + sample_index) % 2**63)
    return g


@dataclass
class SampledTokens:
    """A step's sampled ids (and the logprobs asked for) on the device, where the next step
    can take its input ids from, and their copy to the host, started without waiting:
    to_host() waits for that copy alone, not for work queued after it."""

    tokens: torch.Tensor  # [rows] on the device
    rows: list[Sequence]
    # tokens, then for the rows that want logprobs (in order): its logprob, top values, ids
    _host: list[torch.Tensor]
    _copied: "torch.cuda.Event | None"

    @classmethod
    def copy_out(cls, tokens: torch.Tensor, rows: list[Sequence], parts: list[torch.Tensor]
                 ) -> "SampledTokens":
        if tokens.device.type != "cuda":
            return cls(tokens, rows, parts, None)
        host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts]
        for h, p in zip(host, parts, strict=True):
            h.copy_(p, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, rows, host, copied)

    def to_host(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """A token and (maybe) logprobs per row."""
        if self._copied is not None:
            self._copied.synchronize()
        token_list, *logprob_parts = (t.tolist() for t in self._host)
        out: list[TokenLogprob | None] = [None] * len(self.rows)
        if logprob_parts:
            chosen, top_values, top_ids, *asked_values = logprob_parts
            want = (i for i, r in enumerate(self.rows) if r.params.num_logprobs is not None)
            for j, i in enumerate(want):
                p, token = self.rows[i].params, token_list[i]
                if p.logprob_token_ids:  # vLLM's list: the sampled token, then each id once
                    top = dict.fromkeys([token, *p.logprob_token_ids])
                    values = dict(zip(p.logprob_token_ids, asked_values[0][j], strict=False))
                    top = [(t, chosen[j] if t == token else values[t]) for t in top]
                else:
                    k = p.logprobs
                    top = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
                out[i] = TokenLogprob(token, chosen[j], top)
        return token_list, out


def sample(
    logits: torch.Tensor, rows: list[Sequence], generators: list[torch.Generator | None],
    eos_token_ids: tuple[int, ...] = (),
    argmax_rows: Callable[[torch.Tensor], torch.Tensor] = reference.argmax_rows,
    pending: torch.Tensor | None = None,
) -> SampledTokens:
    """logits: [len(rows), V] on the model's device, in any float dtype, row i the next-token
    logits of sequence rows[i], drawn with generators[i] (on the same device; None: the
    device's default stream). Launches the sampling, without a device-to-host sync where
    the rows need no history on the host (grammars do); only the tokens and the logprobs
    asked for leave the device.
    argmax_rows: the first maximum of each row (a kernel's).
    pending: [len(rows)] on the device, the id of each penalized row's last token where that
    is still PENDING_TOKEN on the host (asynchronous scheduling), -1 for the other rows;
    None: no row's."""
    # One pass over the rows (this runs every step): which want logprobs, which draw.
    want, random_rows, processing = [], [], False
    for i, r in enumerate(rows):
        p = r.params
        if p.num_logprobs is not None:
            want.append(i)
        if not p.greedy:
            random_rows.append(i)
        processing = processing or logits_processors.needs_processing(r)
    # Widening bf16 to float32 is exact, so plain greedy picks the same token either way;
    # anything else (probabilities, penalties, masks) computes in float32.
    if want or random_rows or processing:
        logits = logits.float()
    if processing:
        logits = logits.clone()  # (the model's own stay as they are)
        logits_processors.apply_grammars(logits, rows)
    logprobs = torch.log_softmax(logits, dim=-1) if want else None
    if processing:
        logits_processors.process(logits, rows, pending, eos_token_ids)
    if len(random_rows) == len(rows):
        tokens = _sample_random(logits, [r.params for r in rows],
                                _uniforms(generators, logits.device))
    else:
        tokens = argmax_rows(logits)
        if random_rows:
            idx = on_device(random_rows, logits.device)
            tokens[idx] = _sample_random(logits[idx], [rows[i].params for i in random_rows],
                                         _uniforms([generators[i] for i in random_rows],
                                                   logits.device))
    parts = [tokens]
    if logprobs is not None:
        index = on_device(want, logits.device)
        picked = logprobs[index]
        chosen = picked.gather(1, tokens[index].long().unsqueeze(1)).squeeze(1)
        asked = [rows[i].params.logprob_token_ids for i in want]
        k = max([rows[i].params.logprobs for i, ids in zip(want, asked, strict=True) if not ids],
                default=0)
        top_values, top_ids = picked.topk(k) if k else (picked[:, :0], picked[:, :0].long())
        parts += [chosen, top_values, top_ids]
        if any(asked):  # each row's asked ids (padded with id 0) gathered in one launch
            width = max(len(ids) for ids in asked if ids)
            padded = [[*(ids or ()), *[0] * (width - len(ids or ()))] for ids in asked]
            parts.append(picked.gather(1, on_device(padded, logits.device, torch.int64)))
    return SampledTokens.copy_out(tokens, rows, parts)


# Prompt logprobs' rows widened at a time: a chunk of 8,192 prompt tokens over a 152k
# vocabulary would need ~10 GB of float32 temporaries at once, 1,024 rows ~1.3 GB.
PROMPT_LOGPROB_ROWS = 1024


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], k: int
                          ) -> list[TokenLogprob]:
    """Row i's logprob of targets[i] (the prompt token it predicts) and the top k, from
    the raw model distribution in float32, PROMPT_LOGPROB_ROWS rows at a time."""
    return [lp for start in range(0, len(targets), PROMPT_LOGPROB_ROWS)
            for lp in _prompt_token_logprobs(logits[start:start + PROMPT_LOGPROB_ROWS],
                                             targets[start:start + PROMPT_LOGPROB_ROWS], k)]


def _prompt_token_logprobs(logits: torch.Tensor, targets: list[int], k: int
                           ) -> list[TokenLogprob]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, device=logits.device)
    chosen = logprobs.gather(1, target.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(1) + 1).tolist()
    top_values, top_ids = (v.tolist() for v in logprobs.topk(k)) if k else ([[]] * len(
        targets), [[]] * len(targets))
    return [TokenLogprob(t, c, list(zip(i, v, strict=True)), r) for t, c, i, v, r in zip(
        targets, chosen.squeeze(1).tolist(), top_ids, top_values, ranks, strict=True)]


def _uniforms(generators: list[torch.Generator | None], device: torch.device
              ) -> torch.Tensor:
    """One uniform number in [0, 1) per row: a seeded row's from its own stream, which so
    advances once per emitted token whatever else is in the batch; the rest in one draw."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.rand(len(generators), device=device)
    own = torch.stack([torch.rand((), generator=generators[i], device=device) for i in seeded])
    if len(seeded) == len(generators):
        return own
    u = torch.rand(len(generators), device=device)
    u[on_device(seeded, device)] = own
    return u


# On a CPU, a filtered row whose kept tokens are among its CANDIDATES[0] most likely (top_p
# usually keeps far fewer), else among its CANDIDATES[1], needs no full sort: on one thread
# of a Zen 4, 64 rows of 49,152 took 11.6 / 41.6 ms to select 256 / 4,096 and 238 to sort.
CANDIDATES = (256, 4096)


def _filters(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0


def _sample_random(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor
                   ) -> torch.Tensor:
    """[rows, V] logits -> [rows] int64 token ids, row i drawn with uniform u[i] from the
    softmax of its logits over its temperature, within its top-k/top-p/min-p."""
    # As in vLLM, a positive temperature is at least MIN_TEMPERATURE: dividing by 1e-320
    # would make infinities, and their softmax NaN.
    dev, vocab = logits.device, logits.shape[1]
    temps = on_device([max(p.temperature, MIN_TEMPERATURE) for p in params], dev).unsqueeze(1)
    # An extreme penalty or temperature can overflow a logit to +inf, and inf - inf is NaN
    # inside softmax: cap at the largest finite value, so such a token just dominates.
    probs = torch.nan_to_num(logits / temps, nan=float("-inf"),
                             posinf=torch.finfo(logits.dtype).max).softmax(dim=-1)
    filtering = [i for i, p in enumerate(params) if _filters(p, vocab)]
    if not filtering:
        return _inverse_cdf(probs, u)
    if len(filtering) == len(params):
        return _inverse_cdf_filtered(probs, u, params)
    # Each kind of row on its own rows only (a row's draw does not depend on the others).
    plain = on_device([i for i, p in enumerate(params) if not _filters(p, vocab)], dev)
    tokens = torch.empty(len(params), dtype=torch.long, device=dev)
    tokens[plain] = _inverse_cdf(probs[plain], u[plain])
    idx = on_device(filtering, dev)
    tokens[idx] = _inverse_cdf_filtered(probs[idx], u[idx], [params[i] for i in filtering])
    return tokens


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u times the row's total (a
    token of probability 0 never does). The clamp guards a row with no finite logit."""
    cdf = probs.double().cumsum(dim=-1)
    x = (u.double() * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _inverse_cdf_filtered(probs: torch.Tensor, u: torch.Tensor, params: list[SamplingParams]
                          ) -> torch.Tensor:
    """As _inverse_cdf, over each row's most likely tokens only (_dropped says which).
    Those form a prefix of the row sorted by probability. On a CPU, where reading a result
    back costs nothing, the sort is a top-k selection (CANDIDATES, smallest first) wherever
    the prefix ends within it; on a GPU every row sorts, so that nothing in the step waits
    for the device."""
    dev, vocab = probs.device, probs.shape[1]
    limits = (on_device([p.top_k if p.top_k > 0 else vocab for p in params], dev),
              on_device([p.top_p for p in params], dev, torch.float64),
              on_device([p.min_p for p in params], dev))
    if dev.type != "cpu":
        return _draw_sorted(*probs.sort(dim=-1, descending=True), u, limits, vocab)[0]
    tokens = torch.empty(len(params), dtype=torch.long)
    rows = torch.arange(len(params))  # the rows not drawn yet
    tiers = [k for k in CANDIDATES if k < vocab]
    to_sort = [rows[:0]]  # rows whose prefix cannot end within the next tier
    for i, k in enumerate(tiers):
        part = tuple(limit[rows] for limit in limits)
        top = (probs[rows] if i else probs).topk(k, dim=-1)  # (no copy of every row)
        drawn, drop, cut = _draw_sorted(*top, u[rows], part, vocab)
        # Where the last candidate is kept, the prefix may go on past it; where top-k or
        # min-p keeps it, top-p's share is of a sum that may too.
        cuts = (part[0] < vocab) | (part[2] > 0)
        wide = ~drop[:, -1] | (~cut[:, -1] & cuts)
        tokens[rows[~wide]] = drawn[~wide]
        if i + 1 < len(tiers):  # (no token past the k-th is likelier than it: a bound)
            reach = top.values.double().sum(1) + (tiers[i + 1] - k) * top.values[:, -1]
            hopeless = wide & ~cuts & (reach < part[1])
            to_sort.append(rows[hopeless])
            wide &= ~hopeless
        rows = rows[wide]
    rows = torch.cat([*to_sort, rows])
    if len(rows):
        part = tuple(limit[rows] for limit in limits)
        tokens[rows] = _draw_sorted(*probs[rows].sort(dim=-1, descending=True), u[rows],
                                    part, vocab)[0]
    return tokens


def _draw_sorted(sorted_probs: torch.Tensor, order: torch.Tensor, u: torch.Tensor,
                 limits: tuple[torch.Tensor, torch.Tensor, torch.Tensor], vocab: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows sorted by probability (most likely first) and their token ids, the whole
    vocabulary or its most likely tokens: the drawn ids, which of the sorted tokens were
    dropped, and which of them top-k and min-p alone dropped. The draw runs over the kept
    tokens in vocabulary order (the module's docstring says why)."""
    drop, cut = _dropped(sorted_probs, *limits)
    kept = sorted_probs.masked_fill(drop, 0.0)
    if order.shape[1] == vocab:  # every token: put each back at its id
        return _inverse_cdf(torch.empty_like(kept).scatter_(1, order, kept), u), drop, cut
    ids, by_id = order.sort(dim=-1)  # some candidates: in the order of their ids
    tokens = ids.gather(1, _inverse_cdf(kept.gather(1, by_id), u).unsqueeze(1)).squeeze(1)
    return tokens, drop, cut


def _dropped(sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over rows sorted by probability: the tokens dropped, and those top-k and min-p alone
    drop (the tokens past top_k, and those under min_p times the most likely). As vLLM
    does, top-p then keeps the most likely of what is left until their share of it reaches
    top_p (the tokens with less than top_p of it before them). Never the most likely."""
    width = sorted_probs.shape[1]
    rank = torch.arange(width, device=sorted_probs.device).unsqueeze(0)
    # (a token tied with the k-th stays, as in vLLM)
    kth = sorted_probs.gather(1, (top_k.unsqueeze(1) - 1).clamp(0, width - 1))
    cut = ((rank >= top_k.unsqueeze(1)) & (sorted_probs < kth)) \
        | (sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1])
    cut[:, 0] = False
    left = sorted_probs.double().masked_fill(cut, 0.0)
    mass_before = left.cumsum(dim=-1) - left
    # Uncut, the share is of the whole row's mass, 1 (were the sum taken, float32 softmax
    # rows would sum off 1 by a few 1e-7, and on candidates only, by the rest of the row).
    whole = torch.where(cut.any(dim=1), left.sum(dim=1), 1.0).unsqueeze(1)
    # A top_p of 1 keeps all.
    drop = cut | ((mass_before >= top_p.unsqueeze(1) * whole) & (top_p < 1).unsqueeze(1))
    drop[:, 0] = False
    return drop, cut
