"""A request group's deltas as the event loop reads them: what arrived while the loop was
busy comes as one batch (a stream writes it in one piece), none lost or reordered; the
server's own decoding of a stream (RequestGroup.fill_text) hides the stop token that ended
a sample, as the engine does; best_of generates its candidates with their logprobs."""

import asyncio
import time

from engine_utils import greedy, make_engine, run

from pagedserve.engine import CompletionOutput, OutputCollector, RequestOutput, SamplingParams
from pagedserve.server.async_engine import AsyncEngine, StepFailed
from pagedserve.server.protocol import CompletionRequest, RequestLimits
from pagedserve.server.request_group import RequestGroup

PROMPT = "Write a short story about a robot who learns to paint."


async def _ready(engine: AsyncEngine) -> None:
    engine.start(asyncio.get_running_loop())
    while engine.state != "ready":
        await asyncio.sleep(0.05)


def test_deltas_that_wait_for_a_busy_loop_arrive_together_and_whole(embedded):
    tokenizer = embedded.tokenizer
    prompt = tokenizer.encode(PROMPT)
    [want] = run(make_engine(embedded), [PROMPT], greedy(16))

    async def main() -> list[list[tuple[int, object]]]:
        engine = AsyncEngine(lambda: make_engine(embedded))
        await _ready(engine)
        try:
            group = await engine.submit([prompt], greedy(16))
            time.sleep(2.0)  # the loop is busy: the engine's steps pile up meanwhile
            return [batch async for batch in group.batches()]
        finally:
            await asyncio.to_thread(engine.stop)

    batches = asyncio.run(main())
    assert len(batches[0]) > 1  # the steps of those 2 s came in one wake-up
    collector = OutputCollector()
    finals = [out for batch in batches for _, delta in batch
              if (out := collector.add(delta)) is not None]
    assert finals[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert finals[0].outputs[0].text == want.outputs[0].text


def test_a_batch_before_an_error_is_read_first(embedded):
    """A failure queued behind deltas: the deltas come out, then the error is raised."""
    [done] = run(make_engine(embedded), [PROMPT], greedy(2))

    async def main() -> tuple[list, BaseException | None]:
        group = RequestGroup(post_abort=None, group_id="g", prompts=[[1]], params=greedy(2))
        group.queue.put_nowait((0, done))
        group.queue.put_nowait(StepFailed("boom"))
        seen = []
        try:
            async for batch in group.batches():
                seen.append(batch)
        except StepFailed as e:
            return seen, e
        return seen, None

    seen, error = asyncio.run(main())
    assert seen == [[(0, done)]] and isinstance(error, StepFailed)


def test_a_request_not_streamed_is_delivered_once_whole(embedded):
    """A completion request without ``stream`` asks the engine for its final output only:
    its group gets one delivery, equal to the streamed request's deltas joined."""
    prompt = embedded.tokenizer.encode(PROMPT)
    limits = RequestLimits(vocab_size=embedded.config.vocab_size, max_n=8)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "n": 2,
            "logprobs": 1, "ignore_eos": True}
    plain, streamed = (CompletionRequest.model_validate({**body, "stream": s}).to_params(limits)
                       for s in (False, True))

    async def main() -> list[list[list[tuple[int, object]]]]:
        engine = AsyncEngine(lambda: make_engine(embedded))
        await _ready(engine)
        try:
            groups = [await engine.submit([prompt], p) for p in (plain, streamed)]
            return [[batch async for batch in g.batches()] for g in groups]
        finally:
            await asyncio.to_thread(engine.stop)

    once, deltas = asyncio.run(main())
    assert [len(batch) for batch in once] == [1]
    assert sum(len(batch) for batch in deltas) > 1
    whole = [OutputCollector() for _ in range(2)]
    [got], [want] = ([o for batch in b for _, d in batch if (o := c.add(d)) is not None]
                     for b, c in zip((once, deltas), whole, strict=True))
    assert got.outputs == want.outputs and len(got.outputs[1].token_ids) == 16


def test_an_echo_alone_hides_its_token_when_it_comes_with_its_added(embedded):
    """Completions' echo with max_tokens 0: the one token the engine generates is never
    shown, even where the loop, busy after the request went out, reads its Added and its
    final output in one wake-up (its group marked echo-only after submit() had returned
    showed the token: a client got `completion_tokens: 1` and a generated word)."""
    prompt = embedded.tokenizer.encode(PROMPT)
    limits = RequestLimits(vocab_size=embedded.config.vocab_size, max_n=8)
    req = CompletionRequest.model_validate({"model": "m", "prompt": PROMPT, "max_tokens": 0,
                                            "echo": True, "logprobs": 1})
    assert req.echo_only

    async def main() -> list[list[int]]:
        engine = AsyncEngine(lambda: make_engine(embedded))
        await _ready(engine)
        send = engine._send

        def then_busy(command: object) -> None:
            send(command)
            time.sleep(0.5)  # the loop busy (a large body, say): the step runs meanwhile

        engine._send = then_busy
        try:
            shown = []
            for _ in range(3):
                group = await engine.submit([prompt], req.to_params(limits), req.echo_only)
                outputs = [d for batch in [b async for b in group.batches()] for _, d in batch]
                shown += [o.token_ids + [lp.token_id for lp in o.logprobs or []]
                          for d in outputs for o in d.outputs]
            return shown
        finally:
            await asyncio.to_thread(engine.stop)

    shown = asyncio.run(main())
    assert shown and all(ids == [] for ids in shown), shown


def test_a_stream_that_lags_sends_one_chunk_per_choice_per_wake_up(embedded):
    """Deltas that piled up while the event loop was busy go out merged, one chunk per choice
    (as vLLM merges them): the choices' text and logprobs are those of the whole output."""
    import json

    from pagedserve.server.logprobs import LogprobFormatter
    from pagedserve.server.responses import _stream, new_meta

    prompt = embedded.tokenizer.encode(PROMPT)
    params = greedy(16, n=2, logprobs=1)
    [want] = run(make_engine(embedded), [prompt], params)

    async def main() -> list[str]:
        engine = AsyncEngine(lambda: make_engine(embedded))
        await _ready(engine)
        try:
            group = await engine.submit([prompt], params)
            meta = new_meta("completion", "id", "m", 2, [""], LogprobFormatter(embedded.tokenizer))
            time.sleep(2.0)  # the loop is busy: the engine's steps pile up meanwhile
            return [part async for part in _stream(meta, group, False, False)]
        finally:
            await asyncio.to_thread(engine.stop)

    parts = asyncio.run(main())  # one a wake-up, then [DONE]
    per_part = [[json.loads(line[len("data: "):]) for line in part.split("\n\n")
                 if line.startswith("data: {")] for part in parts[:-1]]
    assert len(per_part) < 16  # the stream woke fewer times than there were steps
    for part in per_part:  # and each wake-up wrote one chunk per choice at most
        assert sorted(c["choices"][0]["index"] for c in part) in ([0], [1], [0, 1])
    chunks = [chunk for part in per_part for chunk in part]
    texts, tokens, logprobs = ["", ""], [[], []], [[], []]
    for chunk in chunks:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        tokens[choice["index"]] += choice["logprobs"]["tokens"]
        logprobs[choice["index"]] += choice["logprobs"]["token_logprobs"]
    for o in want.outputs:
        assert texts[o.index] == o.text
        assert logprobs[o.index] == [lp.logprob for lp in o.logprobs]
        assert len(tokens[o.index]) == 16


def test_merged_deltas_never_send_logprobs_ahead_of_their_text():
    """Tokens whose text the detokenizer still holds back are not joined into an earlier
    delta's chunk: their logprobs wait, as they do unmerged, for the text that spells them."""
    from pagedserve.engine import CompletionOutput, RequestOutput, TokenLogprob
    from pagedserve.server.request_group import merge_deltas

    def delta(text: str, token: int, reason: str | None = None) -> RequestOutput:
        lp = [TokenLogprob(token, -1.0, [])]
        return RequestOutput("r-0", None, [], [CompletionOutput(0, text, [token], reason, lp)],
                             finished=reason is not None)

    a, b, c, d = delta("A", 1), delta("", 2), delta("", 3), delta("BCD", 4)
    [(_, first), (_, second), (_, third)] = merge_deltas([(0, a), (0, b), (0, c)])
    assert (first, second, third) == (a, b, c)  # B and C have no text yet: nothing joins
    [(_, whole)] = merge_deltas([(0, a), (0, b), (0, c), (0, d)])
    assert whole.outputs[0].text == "ABCD" and whole.outputs[0].token_ids == [1, 2, 3, 4]
    assert [lp.token_id for lp in whole.outputs[0].logprobs] == [1, 2, 3, 4]
    [(_, joined), (_, held)] = merge_deltas([(0, a), (0, d), (0, b)])
    assert joined.outputs[0].text == "ABCD" and held is b


def test_the_stop_token_that_ended_a_stream_shows_no_text(embedded):
    """The stop token id (or EOS) that ended a sample shows no text in a stream either."""
    tok = embedded.tokenizer
    prompt = tok.encode("Say something:", add_special_tokens=False)
    a, b, stop = tok.encode(" hello there world", add_special_tokens=False)[:3]
    params = SamplingParams(stop_token_ids=[stop])
    group = RequestGroup(None, "g", [prompt], params, tokenizer=tok)
    first = RequestOutput("g-0", None, prompt, [CompletionOutput(0, "", [a], None)], False)
    last = RequestOutput("g-0", None, prompt, [CompletionOutput(0, "", [b, stop], "stop")], True)
    group.fill_text(0, first)
    group.fill_text(0, last)
    assert first.outputs[0].text + last.outputs[0].text == tok.decode([a, b])


def test_best_of_generates_every_candidate_with_its_logprobs_to_rank_them():
    params = CompletionRequest(prompt="x", n=1, best_of=3, temperature=1.0).to_params(
        RequestLimits(vocab_size=100, max_n=8))
    assert params.n == 3
    assert params.logprobs == 0  # pick_best ranks by cumulative logprob: none without it


def test_the_collector_lists_samples_by_index_whatever_came_first():
    """A fork's later sample can deliver before the parent does (the parent waits, say, on
    a preemption): the whole output lists them by index, each its own tokens and text."""
    def delta(*samples, finished=False):
        return RequestOutput("r", "p", [1], [CompletionOutput(i, text, ids, reason, None)
                                             for i, text, ids, reason in samples], finished)

    collector = OutputCollector()
    assert collector.add(delta((1, "b", [6], None))) is None
    whole = collector.add(delta((0, "a", [5], "length"), (1, "c", [7], "stop"), finished=True))
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in whole.outputs] == [
        (0, "a", [5], "length"), (1, "bc", [6, 7], "stop")]
