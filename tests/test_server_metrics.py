"""/metrics and aborts on a real `pagedserve serve` (embedded SmolLM2), as a mutation survey
asked: the KV usage ratio, an aborted request's finish reason and latencies, the
inter-token latencies and the queue time, the prompt tokens, and a stream of several
prompts left by its client (every prompt aborted)."""

from __future__ import annotations

import time

import httpx
import pytest
from test_server_utils import RemoteServer, metrics, sse_events, wait_kv_free

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
E2E = "pagedserve_e2e_request_latency_seconds"
ITL = "pagedserve_inter_token_latency_seconds"
QUEUE = "pagedserve_request_queue_time_seconds"
FINISHED = "pagedserve_requests_finished_total"


@pytest.fixture(scope="module")
def server():
    # Two seats: a request of n=2 waits behind one stream (test_aborted_samples_...).
    with RemoteServer("--max-num-seqs", "2") as srv:
        yield srv


def _reason(m: dict[str, float], reason: str) -> float:
    return sum(v for k, v in m.items()
               if k.startswith(FINISHED + "{") and f'finished_reason="{reason}"' in k)


def test_a_left_stream_counts_as_abort_with_no_latency_and_the_ratio_is_a_fraction(server):
    """While a stream runs, kv_cache_usage_ratio is kv_blocks_used / num_kv_blocks (0-1);
    once its client leaves, it is one "abort" finish (not "stop"), and observes no e2e
    latency (vLLM's: aborted requests are left out of the latency histograms)."""
    before = metrics(server.url)
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as s:
        events = sse_events(s.iter_lines())
        assert next(events)["choices"]
        during = metrics(server.url)
        used, total = during["pagedserve_kv_blocks_used"], during["pagedserve_num_kv_blocks"]
        assert used > 0
        assert during["pagedserve_kv_cache_usage_ratio"] == pytest.approx(used / total)
        assert 0 < during["pagedserve_kv_cache_usage_ratio"] < 1
        events.close()
    assert wait_kv_free(server.url) == 0
    after = metrics(server.url)
    assert _reason(after, "abort") - _reason(before, "abort") == 1
    assert _reason(after, "stop") == _reason(before, "stop")
    assert after[E2E + "_count"] == before[E2E + "_count"]


def test_inter_token_latencies_and_queue_time_are_observed_as_they_were(server):
    """A request of 8 tokens observes 7 inter-token gaps, each a real time (> 0), and a
    queue time (arrival to first scheduled) well under its end-to-end time."""
    before = metrics(server.url)
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = metrics(server.url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta(ITL + "_count") == 7
    assert delta(ITL + "_sum") > 0
    assert delta(E2E + "_count") == delta(QUEUE + "_count") == 1
    assert delta(QUEUE + "_sum") < delta(E2E + "_sum") / 2


def test_aborted_samples_count_each_even_before_their_prompt_forks(server):
    """A request of n=2 that waits behind a running stream (two seats in all) and whose
    client then leaves counts two "abort" finishes, one per sample (vLLM's child requests),
    though its prompt was never forked into them."""
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as s:
        events = sse_events(s.iter_lines())
        assert next(events)["choices"]
        before = metrics(server.url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=3,
                       json={"prompt": PROMPT, "n": 2, "max_tokens": 5})
        deadline = time.monotonic() + 20
        while _reason(metrics(server.url), "abort") == _reason(before, "abort") \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        assert _reason(metrics(server.url), "abort") - _reason(before, "abort") == 2
        events.close()
    assert wait_kv_free(server.url) == 0


def test_prompt_tokens_count_tokens_not_prompts(server):
    """pagedserve_prompt_tokens_total grows by the prompt tokens of each admitted request
    (its usage's prompt_tokens), over every prompt of a request."""
    before = metrics(server.url)["pagedserve_prompt_tokens_total"]
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": [PROMPT, "Once upon a time there was"], "max_tokens": 1})
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["prompt_tokens"]
    assert used > 2
    assert metrics(server.url)["pagedserve_prompt_tokens_total"] - before == used


def test_a_stream_left_by_its_client_aborts_every_prompt(server):
    """A completion of two prompts, streamed, whose client goes after the first chunk:
    both prompts' requests are aborted (each would run 2000 tokens), their blocks freed."""
    body = {"prompt": ["The capital of France is", "Once upon a time"], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as s:
        events = sse_events(s.iter_lines())
        assert next(events)["choices"]
        m = metrics(server.url)
        assert m["pagedserve_num_requests_running"] + m["pagedserve_num_requests_waiting"] == 2
        events.close()
    assert wait_kv_free(server.url) == 0
    assert metrics(server.url)["pagedserve_num_requests_running"] == 0
