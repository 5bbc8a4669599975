"""Prometheus metrics, in a registry of their own per app.

Gauges and the engine's cumulative counters are read at scrape time from the Snapshot the
engine loop publishes after every iteration (the HTTP side never calls engine methods).
Per-request histograms and counters are fed on the event loop as the engine's events about
requests arrive: added, first token, finished. Every series exists, at 0, from the model's
load on (as vLLM's do), so that rate() and increase() see the first request too."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from pagedserve.engine import RequestOutput
from pagedserve.server.engine_messages import Snapshot

PREFIX = "pagedserve_"
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's, in its order
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
# Engine stats key -> (counter name without _total, help)
ENGINE_COUNTERS = {
    "prefill_tokens_computed": ("prefill_tokens_computed",
                                "Tokens run through the model in prefill: prompt tokens not "
                                "served from the prefix cache, and a preempted sequence's "
                                "tokens again when it is recomputed."),
    "prefix_cache_queried_tokens": ("prefix_cache_queried_tokens",
                                    "Tokens looked up in the prefix cache as sequences are "
                                    "admitted: prompts, and a preempted sequence's tokens "
                                    "(generated ones too) again when it is readmitted."),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens",
                                "Of those, tokens served from the prefix cache."),
    "preemptions": ("num_preemptions", "Sequences preempted (recomputed later)."),
    "output_tokens": ("generation_tokens", "Tokens generated."),
    "steps": ("engine_steps", "Engine steps run, each one forward of the scheduled batch "
              "(tokens a step: the prefill and generation tokens over these)."),
}


class _SnapshotCollector(Collector):
    def __init__(self, model_name: Callable[[], str], snapshot: Callable[[], Snapshot]):
        self.model_name = model_name
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap, labels = self.snapshot(), [self.model_name()]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        yield gauge("num_requests_running", "Requests with sequences in the running batch.",
                    snap.running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", snap.waiting)
        yield gauge("kv_blocks_used", "KV cache blocks in use.", snap.kv_blocks_used)
        yield gauge("num_kv_blocks", "KV cache blocks in the pool.", snap.kv_blocks_total)
        yield gauge("kv_blocks_shared", "KV cache blocks shared by several sequences "
                    "(ref_count > 1).", snap.kv_blocks_shared)
        ratio = snap.kv_blocks_used / snap.kv_blocks_total if snap.kv_blocks_total else 0.0
        yield gauge("kv_cache_usage_ratio", "KV cache blocks used / pool size (0-1).", ratio)
        for key, (name, doc) in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, snap.stats.get(key, 0))
            yield c


class ServerMetrics:
    """Implements the AsyncEngine Observer interface; one instance per app."""

    def __init__(self, snapshot: Callable[[], Snapshot], model_name: Callable[[], str]):
        self._model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(model_name, snapshot))
        # --api-server-count: each server process counts its own requests into files the
        # parent made (prometheus_client's multiprocess mode, as vLLM's servers do), and a
        # scrape, whichever server takes it, sums them; the engine's figures are every
        # server's alike (the Snapshot).
        own = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            MultiProcessCollector(self.registry)
            own = None
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", labels,
            registry=own)
        self.requests_finished = Counter(
            PREFIX + "requests_finished", "Finished requests by finish reason (stop, length, "
            "abort, error, repetition); each of a request's samples (n, best_of) counts, as "
            "vLLM's child requests do.", [*labels, "finished_reason"], registry=own)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=LATENCY_BUCKETS,
                             registry=own)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token; "
                         "observed as the token reaches the server (a non-streamed request's "
                         "tokens reach it together, at its end).")
        self.itl = hist("inter_token_latency_seconds", "Time between output steps of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.")

    @property
    def model_name(self) -> str:
        return self._model_name()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- Observer (event loop) ---------------------------------------------------------
    def on_loaded(self) -> None:
        name = self.model_name
        for metric in (self.prompt_tokens, self.ttft, self.itl, self.e2e, self.queue_time):
            metric.labels(name)
        for reason in FINISH_REASONS:
            self.requests_finished.labels(name, reason)

    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def on_first_token(self, out: RequestOutput) -> None:
        assert out.first_token_time is not None
        self.ttft.labels(self.model_name).observe(out.first_token_time - out.arrival_time)

    def on_finished(self, out: RequestOutput, num_samples: int) -> None:
        name = self.model_name
        # The final output lists every sample that exists: one aborted before its prompt was
        # forked into its samples lists fewer, and those missing were aborted too.
        reasons = [o.finish_reason or "abort" for o in out.outputs]
        reasons += ["abort"] * (num_samples - len(reasons))
        for reason in reasons:
            self.requests_finished.labels(name, reason).inc()
        if out.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(out.first_scheduled_time - out.arrival_time)
        if "abort" in reasons:
            return
        if out.finished_time is not None:
            self.e2e.labels(name).observe(out.finished_time - out.arrival_time)
        itl = self.itl.labels(name)
        for before, after in zip(out.token_times, out.token_times[1:], strict=False):
            itl.observe(after - before)
