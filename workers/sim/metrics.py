"""The simulated worker's Prometheus metrics, with vLLM's names, help texts and bucket edges.

The gateway's probe reads these by name and dashboards compare them across fleets, so a simulated
worker must expose what vLLM's `/metrics` does (recorded in `tests/fixtures/vllm-0.32/`). Engine
counters are read at scrape time instead of mirrored on every step, and the latency histograms are
plain counters instead of prometheus_client's locked ones, because both would sit on the
per-token path.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from workers.sim.engine_types import RequestOutput
from workers.sim.profiles import TimingProfile

if TYPE_CHECKING:
    from workers.sim.worker import SimWorker

__all__ = ["EngineCollector", "Metrics", "Tracker"]

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), so dashboards and the gateway's probe see
# the same bucket edges from the simulator as from a real server.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class EngineCollector(Collector):
    """Gauges and counters read from `engine.stats()` at scrape time.

    The engine already keeps cumulative counts; mirroring them into prometheus_client objects on
    every step would cost the hot loop for nothing.
    """

    def __init__(self, worker: SimWorker) -> None:
        self._w = worker

    def collect(self) -> Iterable[Metric]:
        w = self._w
        s = w.engine.stats()
        lv = [w.model, "0"]
        ln = ["model_name", "engine"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=ln)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=ln)
            c.add_metric(lv, value, created=w.started_at)
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*ln, "finished_reason"],
        )
        # vLLM pre-creates every finished_reason child, so all exist from the first scrape.
        counts = {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
        counts.update(exported_success(s.request_success))
        for reason, count in counts.items():
            success.add_metric([*lv, reason], count, created=w.started_at)
        yield success
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        cfg = w.engine_config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
            ],
        )
        info.add_metric(
            [
                str(cfg.block_size),
                "auto",
                str(bool(cfg.enable_prefix_caching)),
                "0",
                str(cfg.num_blocks),
                "sha256",
            ],
            1.0,
        )
        yield info
        for hist in w.metrics.all():
            yield hist.metric(ln, lv)


class _Histogram:
    """A lock-free histogram for the per-token path.

    prometheus_client's Histogram takes a lock and walks its buckets on every observe (about
    4 us); the inter-token histogram is observed once per streamed event, so that alone was ~15%
    of a worker's CPU. One event loop owns each worker, so plain counters are safe here.
    """

    __slots__ = ("counts", "created", "doc", "edges", "name", "total")

    def __init__(self, name: str, doc: str, edges: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.edges = list(edges)
        self.counts = [0] * (len(self.edges) + 1)  # the last slot is +Inf
        self.total = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value

    def metric(self, labelnames: list[str], labelvalues: list[str]) -> Metric:
        m = Metric(self.name, self.doc, "histogram")
        labels = dict(zip(labelnames, labelvalues, strict=True))
        cumulative = 0
        for edge, count in zip([*self.edges, float("inf")], self.counts, strict=True):
            cumulative += count
            m.add_sample(self.name + "_bucket", {**labels, "le": floatToGoString(edge)}, cumulative)
        m.add_sample(self.name + "_count", labels, cumulative)
        m.add_sample(self.name + "_sum", labels, self.total)
        m.add_sample(self.name + "_created", labels, self.created)
        return m


class Metrics:
    """Per-worker latency histograms, observed per request as vLLM's frontend does."""

    def __init__(self) -> None:
        self.ttft = _Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = _Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = _Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_BUCKETS,
        )
        self.queue = _Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_BUCKETS,
        )

    def all(self) -> list[_Histogram]:
        return [self.ttft, self.itl, self.e2e, self.queue]


class Tracker:
    """Latency bookkeeping for one request, feeding the vLLM histograms.

    The engine reports no scheduling timestamp, so the queue time is estimated as TTFT minus what
    the timing profile says the request's own prefill costs (its uncached tokens). That is exact
    for an unchunked prefill in an otherwise idle step and a close bound otherwise, which is what
    the metric is used for (seeing queueing build up on a worker).
    """

    __slots__ = ("arrival", "finished", "first", "last", "metrics", "num_tokens", "profile")

    def __init__(self, metrics: Metrics, profile: TimingProfile, arrival: float) -> None:
        self.metrics = metrics
        self.profile = profile
        self.arrival = arrival
        self.first: float | None = None
        self.last = arrival
        self.num_tokens = 0
        self.finished = False

    def on_output(self, out: RequestOutput) -> None:
        n = len(out.new_token_ids)
        if n:
            now = time.monotonic()
            if self.first is None:
                self.first = now
                ttft = now - self.arrival
                self.metrics.ttft.observe(ttft)
                uncached = max(0, out.num_prompt_tokens - out.num_cached_tokens)
                prefill = self.profile.step_seconds(
                    uncached, 0, 0.0, uncached * out.num_cached_tokens
                )
                self.metrics.queue.observe(max(0.0, ttft - prefill))
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
            self.num_tokens += n
        if out.finished:
            self.finish(out.finish_reason or "length")

    def finish(self, reason: str) -> None:
        """Record the end of a request; aborted ones stay out of the latency histograms.

        Recorded vLLM 0.32 behaviour: a client abort records no finished-request stats, so
        disconnects do not drag the e2e/queue distributions the gateway reads.
        """
        if self.finished:
            return
        self.finished = True
        if reason == "abort":
            return
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.arrival)


def exported_success(finished: dict[str, int]) -> dict[str, int]:
    """`vllm:request_success_total` by finished_reason from the engine's count of how requests
    ended: every reason but "abort". The simulated engine aborts a request only when its caller
    asks (a client disconnect, a cancelled replay), and vLLM 0.32 counts such a request in *no*
    sample, not even finished_reason="abort" (tests/fixtures/vllm-0.32/abort_probe.json:
    request_success_delta 0.0). The engine keeps its own count (`EngineStats.request_success`,
    GET /sim/stats) for tests and the simulator's own bookkeeping."""
    return {k: v for k, v in finished.items() if k != "abort"}
