"""The gateway's Prometheus metrics, in a registry of its own (one per app instance).

Label sets are bounded by config (models the fleet serves, configured workers); nothing from the
request body that a client can vary freely ever becomes a label.
"""

from __future__ import annotations

import contextlib
import time
from bisect import bisect_left
from collections.abc import Callable, Collection, Container, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gateway.logs import log_handler
from workers.worker import Health

# Observations a BatchedHistogram holds before it hands them to prometheus_client. A scrape
# flushes them all first (GatewayMetrics registers a collector for it), so this only keeps the
# prometheus_client values current for readers that bypass the registry.
_BATCH = 64


class BatchedHistogram:
    """Observations binned locally and added to a labelled ``Histogram`` child in bulk.

    The relay observes the gap between upstream reads once per read: ``observe`` on the child
    takes its lock and walks the buckets, ~2.4 us, which at 17 reads per short stream was ~3% of
    the gateway's CPU (and 7-8% when relaying 256-token streams). Here an observation is a bisect
    and two adds; ``flush`` adds the counts under the child's own bucket and sum values (the same
    series ``observe`` would produce: tests/gateway/test_metrics_batch.py holds it to that).
    """

    __slots__ = ("_bounds", "_buckets", "_counts", "_n", "_sum", "_sum_value")

    def __init__(self, child: Any) -> None:
        # prometheus_client's Histogram child: `_upper_bounds` ends with +Inf, one bucket value
        # per bound (non-cumulative; the exposition accumulates), one sum value.
        self._bounds: list[float] = list(child._upper_bounds)
        self._buckets = child._buckets
        self._sum_value = child._sum
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._n = 0

    def observe(self, v: float) -> None:
        self._counts[bisect_left(self._bounds, v)] += 1
        self._sum += v
        self._n += 1
        if self._n >= _BATCH:
            self.flush()

    def flush(self) -> None:
        if not self._n:
            return
        counts = self._counts
        for i, n in enumerate(counts):
            if n:
                self._buckets[i].inc(n)
                counts[i] = 0
        self._sum_value.inc(self._sum)
        self._sum = 0.0
        self._n = 0


class BatchedCounter:
    """A labelled counter child counted in plain Python, handed to prometheus_client when the
    registry is collected (or the worker's series are dropped). ``inc`` on the child checks the
    metric's type and takes its lock, ~0.5 us; a walk counts three or more per request."""

    __slots__ = ("_child", "_n")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._n = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._n += amount

    def flush(self) -> None:
        if self._n:
            self._child.inc(self._n)
            self._n = 0.0


class BatchedGauge:
    """A labelled gauge child set in plain Python (the last ``set`` and the moves since), handed
    to prometheus_client when the registry is collected; ``set`` on the child takes its lock, and
    the walk sets the worker's in-flight gauge twice per request."""

    __slots__ = ("_child", "_delta", "_value")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._value: float | None = None
        self._delta = 0.0

    def set(self, value: float) -> None:
        self._value = value
        self._delta = 0.0

    def inc(self, amount: float = 1) -> None:
        self._delta += amount

    def dec(self, amount: float = 1) -> None:
        self._delta -= amount

    def flush(self) -> None:
        if self._value is not None:
            self._child.set(self._value)
            self._value = None
        if self._delta:
            self._child.inc(self._delta)
            self._delta = 0.0


class _Discarded:
    """What ``GatewayMetrics.child`` hands out for a series of a worker that is gone: takes every
    update (counter, gauge, histogram) and exports nothing."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        pass

    dec = set = observe = inc


_DISCARDED = _Discarded()
# The `worker` label of a request no worker had (refused, or failed before one took it).
NO_WORKER = "-"


if TYPE_CHECKING:
    from gateway.admission import AdmissionController
    from workers.kv_intake import KVEventFleet

# Seconds; TTFT spans cache hits (ms) to long queued prefills (tens of s).
_TTFT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _FlushFirst(Collector):
    """Registered before every metric: whatever collects the registry (the /metrics endpoint,
    the supervisor's merge, a test's ``get_sample_value``) adds the batched observations first."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        m.flush()
        if m._pending_tenants:  # removed tenants whose last requests have settled since
            m._forget_settled_tenants()
        return iter(())


class GatewayMetrics:
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._batched: dict[tuple[int, tuple[str, ...]], BatchedHistogram] = {}
        self._deferred: list[BatchedCounter | BatchedGauge] = []  # batched children of child()
        self._pending_tenants: set[str] = set()  # removed, series dropped once settled
        # The fleet's worker names (the gateway wires its registry's `workers`); None = any.
        self.worker_names: Container[str] | None = None
        # Whether some worker lists a model (the gateway wires `Registry.knows_model`); None = any.
        self.model_known: Callable[[str], bool] | None = None
        r = self.registry = CollectorRegistry(auto_describe=True)
        r.register(_FlushFirst(self))
        self.requests = Counter(
            "kvgate_requests",
            "Finished requests by model, worker and HTTP status",
            ["model", "worker", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "kvgate_rejected_requests",
            "Requests the gateway refused itself, by reason",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Gateway-observed time from request arrival to the first upstream SSE event",
            ["model", "pool"],
            buckets=_TTFT,
            registry=r,
        )
        self.tpot = Histogram(
            "kvgate_time_per_output_token_seconds",
            "Gateway-observed (e2e - ttft) / (completion_tokens - 1), per worker pool",
            ["model", "pool"],
            buckets=_ITL,
            registry=r,
        )
        self.routing_decisions = Counter(
            "kvgate_routing_decisions",
            "Routing decisions by policy and reason (affinity, load, session, ...)",
            ["policy", "reason"],
            registry=r,
        )
        self.prefix_match = Histogram(
            "kvgate_prefix_match_ratio",
            "Share of the request's prefix blocks the chosen worker is believed to hold",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0),
            registry=r,
        )
        self.queue_delay = Gauge(
            "kvgate_worker_estimated_queue_delay",
            "Queue-delay signal (0..1) of the worker at its last routing decision",
            ["worker"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "kvgate_tenant_requests",
            "Requests per tenant by admission outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "kvgate_tenant_tokens",
            "Tokens per tenant: reserved at admission, settled from usage, refunded",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_in_flight = Gauge(
            "kvgate_tenant_in_flight",
            "Admitted, unsettled requests per tenant",
            ["tenant"],
            registry=r,
        )
        self.quota_breaker = Gauge(
            "kvgate_quota_store_circuit",
            "Quota store circuit state (1 = current): closed = shared limits in force",
            ["state"],
            registry=r,
        )
        self.quota_degraded = Counter(
            "kvgate_quota_degraded_admissions",
            "Admission decisions made by the local fail-open limiter while the store was down",
            ["tenant"],
            registry=r,
        )
        self.quota_deferred_pending = Gauge(
            "kvgate_quota_deferred_settlements",
            "Settlements waiting for the quota store to answer again (replayed when it does)",
            registry=r,
        )
        self.quota_deferred = Counter(
            "kvgate_quota_deferred_settlements_outcomes",
            "Deferred settlements by outcome: replayed to the store, dropped (backlog full) or "
            "failed (the store refused them, not an outage); dropped and failed leases expire by "
            "age",
            ["outcome"],
            registry=r,
        )
        self.usage_buffered = Gauge(
            "kvgate_usage_records_buffered",
            "Usage records waiting for the Redis stream to answer again",
            registry=r,
        )
        self.usage_dropped = Counter(
            "kvgate_usage_records_dropped",
            "Usage records lost because the buffer was full during a long Redis outage",
            registry=r,
        )
        self.inter_event = Histogram(
            "kvgate_inter_event_seconds",
            "Gaps between upstream SSE reads while streaming",
            ["model"],
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "kvgate_e2e_request_seconds",
            "Gateway-observed request duration",
            ["model"],
            buckets=_E2E,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvgate_worker_in_flight", "Requests in flight per worker", ["worker"], registry=r
        )
        self.retries = Counter(
            "kvgate_retries",
            "Attempts retried on another worker, by reason",
            ["reason"],
            registry=r,
        )
        self.stream_errors = Counter(
            "kvgate_stream_errors",
            "Streams that failed after the first byte, by reason",
            ["reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvgate_client_disconnects", "Streams the client abandoned", registry=r
        )
        self.worker_up = Gauge(
            "kvgate_worker_up", "1 when the worker is healthy and routable", ["worker"], registry=r
        )
        self.worker_state = Gauge(
            "kvgate_worker_state",
            "Worker health state (1 = current)",
            ["worker", "state"],
            registry=r,
        )
        self.probe_seconds = Histogram(
            "kvgate_probe_duration_seconds",
            "Health/metrics probe duration",
            ["worker"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.probe_failures = Counter(
            "kvgate_probe_failures", "Failed probes", ["worker"], registry=r
        )
        self.cached_prediction = Counter(
            "kvgate_cached_tokens_predictions",
            "Routing's predicted cached prompt tokens vs the worker's reported cached_tokens, by "
            "match source (precise = KV events, approx = dispatch history) and outcome "
            "(agree = within one block, over, under)",
            ["source", "outcome"],
            registry=r,
        )
        self.cached_prediction_error = Histogram(
            "kvgate_cached_tokens_prediction_error_tokens",
            "|predicted - reported| cached prompt tokens per request, by match source",
            ["source"],
            buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384),
            registry=r,
        )
        self.admission_wait = Histogram(
            "kvgate_admission_wait_seconds",
            "Time requests waited in the admission queue for a worker, by model and priority tier "
            "(only requests that queued)",
            ["model", "tier"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.admission_outcomes = Counter(
            "kvgate_admission_outcomes",
            "Admission queue outcomes by model, tier and result (admitted, cancelled, or the "
            "refusal reason: queue_full, shed, over_share, expired, deadline, closed, ...)",
            ["model", "tier", "outcome"],
            registry=r,
        )
        self.config_reloads = Counter("kvgate_config_reloads", "Config reloads applied", registry=r)
        self.config_reload_errors = Counter(
            "kvgate_config_reload_errors",
            "Config reloads rejected (running config kept)",
            registry=r,
        )
        # id(metric) -> the index of its `worker` label, for metrics that have one.
        self._worker_label = {id(metric): i for metric, i in self._labelled("worker")}
        self._model_label = {id(metric): i for metric, i in self._labelled("model")}

    def child(self, metric: Any, *labels: str) -> Any:
        """A labelled child, cached: `labels()` costs microseconds per call on the hot path.
        A counter's or gauge's is batched (`BatchedCounter`, `BatchedGauge`): exact whenever
        the registry is collected, which is how everything reads it.

        A series of a worker no longer in ``worker_names`` is not created: a request that ends
        on a worker a reload removed (its stream outlived it) would bring back the series
        `forget_worker` dropped, for good. Checked only where the cache has no child, which is
        the case for every series of a forgotten worker (`_forget` dropped them): one dict
        lookup and one membership test there, nothing on the cached path."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            if self._gone(metric, labels):
                return _DISCARDED
            c = metric.labels(*labels)
            if isinstance(metric, Counter):
                c = BatchedCounter(c)
                self._deferred.append(c)
            elif isinstance(metric, Gauge):
                c = BatchedGauge(c)
                self._deferred.append(c)
            self._children[key] = c
        return c

    def batched(self, metric: Histogram, *labels: str) -> BatchedHistogram:
        """A labelled histogram child observed in batches (per-request histograms: ~0.3 us an
        observation against ~2.4 us), exact whenever the registry is collected."""
        key = (id(metric), labels)
        b = self._batched.get(key)
        if b is None:
            if self._gone(metric, labels):
                return _DISCARDED  # type: ignore[return-value]
            b = self._batched[key] = BatchedHistogram(metric.labels(*labels) if labels else metric)
        return b

    def flush(self) -> None:
        for b in self._batched.values():
            b.flush()
        for c in self._deferred:
            c.flush()

    def _gone(self, metric: Any, labels: tuple[str, ...]) -> bool:
        """``labels`` name, as their `worker`, a worker not in the fleet (``worker_names``), or
        as their `model`, one no worker lists (``model_known``): a request that ends after a
        reload removed its model's last worker brought back the series `forget_model` dropped
        (ttft, tpot, e2e, requests), until the next reload. Cache misses only."""
        mid = id(metric)
        i = self._worker_label.get(mid)
        names = self.worker_names
        if i is not None and names is not None:
            name = labels[i]
            if name != NO_WORKER and name not in names:
                return True
        j = self._model_label.get(mid)
        known = self.model_known
        return j is not None and known is not None and not known(labels[j])

    def export_health(self, name: str, health: Health) -> None:
        """A worker's health as `kvgate_worker_up` and one-hot `kvgate_worker_state` (nothing for
        a worker no longer in ``worker_names``: see `child`)."""
        if self.worker_names is not None and name not in self.worker_names:
            return
        self.worker_up.labels(name).set(1 if health is Health.HEALTHY else 0)
        for h in Health:
            self.worker_state.labels(name, h.value).set(1 if health is h else 0)

    def _labelled(self, label: str) -> list[Any]:
        """This registry's labelled metrics that have ``label``, with its index in their labels."""
        out = []
        for metric in vars(self).values():
            names = getattr(metric, "_labelnames", None)
            if isinstance(metric, MetricWrapperBase) and names and label in names:
                out.append((metric, names.index(label)))
        return out

    def _forget(self, label: str, values: Collection[str]) -> None:
        """Drop every series whose ``label`` is one of ``values``, in every metric that has the
        label, and the cached (batched) children that fed them. Per event (a worker, model or
        tenant that left), never per request: it walks every child of those metrics."""
        if not values:
            return
        self.flush()  # what the batched children hold goes in before they are dropped
        for metric, i in self._labelled(label):
            mid = id(metric)
            for cache in (self._children, self._batched):
                for key in [k for k in cache if k[0] == mid and k[1][i] in values]:
                    del cache[key]
            with metric._lock:
                gone = [k for k in metric._metrics if k[i] in values]
            for labels in gone:
                with contextlib.suppress(KeyError):
                    metric.remove(*labels)
        self._rebuild_deferred()

    def label_values(self, label: str) -> set[str]:
        """The values ``label`` has in this registry's series now (per event, not per request)."""
        out: set[str] = set()
        for metric, i in self._labelled(label):
            with metric._lock:
                out.update(k[i] for k in metric._metrics)
        return out

    def forget_model(self, model: str) -> None:
        """Drop every series of a model no worker serves any more (its pool is gone): requests,
        latencies (ttft, tpot, inter-event, e2e) and admission."""
        self._forget("model", (model,))

    def _rebuild_deferred(self) -> None:
        """The batched children still cached, after some were dropped."""
        self._deferred = [
            c for c in self._children.values() if isinstance(c, (BatchedCounter, BatchedGauge))
        ]

    def forget_worker(self, name: str, states: list[str] | None = None) -> None:
        """Drop a removed worker's series (every metric with a ``worker`` label: requests,
        in-flight, health, probes, queue delay) so dashboards do not show ghosts and pods that
        come and go under new names do not grow the exposition. ``states`` is unused (every
        ``kvgate_worker_state`` series of the worker goes); kept for callers."""
        self._forget("worker", (name,))

    def forget_tenants(self, names: Collection[str]) -> None:
        """Drop the series of tenants a reload removed. A tenant with requests still in flight
        keeps its series until they have settled (their settlement would bring them back, the
        in-flight gauge below zero): dropped at the first collection after that (`_FlushFirst`).
        An unlimited tenant's requests are not counted in flight: its series go at once."""
        self._pending_tenants.update(names)
        self._forget_settled_tenants()

    def keep_tenants(self, names: Collection[str]) -> None:
        """Tenants (back) in the config: not to be dropped."""
        self._pending_tenants.difference_update(names)

    def _forget_settled_tenants(self) -> None:
        pending = self._pending_tenants
        if not pending:
            return
        self.flush()
        busy = {
            k[0]
            for k, child in list(self.tenant_in_flight._metrics.items())
            if k[0] in pending and child._value.get()
        }
        done = pending - busy
        if done:
            self._pending_tenants = busy
            self._forget("tenant", done)


class KVEventCollector(Collector):
    """KV-event intake and precise-index figures, read from the live objects at scrape time.

    The intake counts in plain ints on its hot path (no Prometheus call per event); a scrape
    turns them into series here.
    """

    def __init__(self, fleet: KVEventFleet, clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        stats = self.fleet.stats()
        idx = self.fleet.index
        sink = self.fleet.sink
        now = self.clock()
        trusted = idx.trusted(now)
        counters = {
            "events": ("kvgate_kv_events", "KV events received"),
            "batches": ("kvgate_kv_event_batches", "KV event batches received"),
            "gaps": ("kvgate_kv_event_gaps", "Sequence gaps detected"),
            "replays": ("kvgate_kv_event_replays", "Replays requested after a gap or reconnect"),
            "replay_failures": ("kvgate_kv_event_replay_failures", "Replays that failed"),
            "decode_errors": ("kvgate_kv_event_decode_errors", "Undecodable event batches"),
        }
        for attr, (name, doc) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["worker"])
            for w, st in stats.items():
                c.add_metric([w], float(getattr(st, attr)))
            yield c
        resets = CounterMetricFamily(
            "kvgate_kv_event_resets",
            "Times a worker's precise entries were cleared, by reason",
            labels=["worker", "reason"],
        )
        for (w, reason), n in sorted(sink.resets.items()):
            resets.add_metric([w, reason], float(n))
        yield resets
        # Blocks dropped past a worker's claim bound (its num_gpu_blocks x slack): a worker that
        # claims more than its cache can hold is broken or lying, and shows here.
        overflow = CounterMetricFamily(
            "kvgate_precise_index_overflow_blocks",
            "Blocks dropped from the precise index past the worker's claim bound",
            labels=["worker"],
        )
        for w, n in sorted(idx.overflow.items()):
            overflow.add_metric([w], float(n))
        yield overflow
        # Received but never indexed: without it a worker whose events are all ignored (a
        # hybrid model's other groups, vLLM 0.11 LoRA blocks) looks like one with a cold cache.
        skipped = CounterMetricFamily(
            "kvgate_kv_events_skipped",
            "KV events received but not applied to the precise index, by reason",
            labels=["worker", "reason"],
        )
        for w, st in stats.items():
            for reason, n in sink.skip_counts(w).items():
                skipped.add_metric([w, reason], float(n))
            skipped.add_metric([w, "unknown_type"], float(st.skipped_events))
        yield skipped
        size = GaugeMetricFamily(
            "kvgate_precise_index_blocks", "Blocks the precise index holds", labels=["worker"]
        )
        live = GaugeMetricFamily(
            "kvgate_kv_events_trusted",
            "1 when routing uses the worker's KV events (in sync and fresh)",
            labels=["worker"],
        )
        age = GaugeMetricFamily(
            "kvgate_kv_events_age_seconds",
            "Seconds since the worker's last event batch",
            labels=["worker"],
        )
        for w, st in stats.items():
            size.add_metric([w], float(idx.size(w)))
            live.add_metric([w], 1.0 if w in trusted else 0.0)
            if st.last_event_monotonic:
                age.add_metric([w], max(0.0, now - st.last_event_monotonic))
        yield size
        yield live
        yield age


class AdmissionMetrics:
    """The admission controller's observer: Prometheus series, cached children."""

    def __init__(self, m: GatewayMetrics) -> None:
        self.m = m

    def admitted(self, pool: str, tier: int, wait_s: float) -> None:
        m = self.m
        t = str(tier)
        m.child(m.admission_wait, pool, t).observe(wait_s)
        m.child(m.admission_outcomes, pool, t, "admitted").inc()

    def refused(self, pool: str, tier: int, reason: str, status: int) -> None:
        m = self.m
        # Not `rejected`: the refusal reaches the walk as its APIError, which counts the
        # request once (kvgate_rejected_requests_total, or kvgate_requests_total for a retry's
        # wait after a worker had it).
        m.child(m.admission_outcomes, pool, str(tier), reason).inc()

    def cancelled(self, pool: str, tier: int, wait_s: float) -> None:
        m = self.m
        m.child(m.admission_outcomes, pool, str(tier), "cancelled").inc()


class AdmissionCollector(Collector):
    """Queue depth per model and priority tier, read at scrape time."""

    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvgate_admission_queue_depth",
            "Requests waiting for a worker, by model and priority tier",
            labels=["model", "tier"],
        )
        c = self.controller
        for pool in c.pools():
            for tier, n in sorted(c.depth_by_tier(pool).items()):
                g.add_metric([pool, str(tier)], float(n))
        yield g


class LogCollector(Collector):
    """Log lines the writer thread never got (its queue was full: a stuck or slow log sink)."""

    def collect(self) -> Iterator[Metric]:
        h = log_handler()
        c = CounterMetricFamily(
            "kvgate_log_lines_dropped", "Log lines dropped because the log writer fell behind"
        )
        c.add_metric([], h.dropped if h is not None else 0)
        yield c


# -- several processes (gateway/supervisor.py) ---------------------------------------------------
def _with_label(line: bytes, label: bytes) -> bytes:
    """`name{a="b"} 1` -> `name{<label>,a="b"} 1`; `name 1` -> `name{<label>} 1`. A metric name
    holds no `{` or space, so the first of them ends it."""
    brace, space = line.find(b"{"), line.find(b" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = line[brace + 1 :]
        return line[: brace + 1] + label + (b"," if not rest.startswith(b"}") else b"") + rest
    if space == -1:
        return line
    return line[:space] + b"{" + label + b"}" + line[space:]


def merge_expositions(parts: list[tuple[str, bytes]]) -> bytes:
    """Several processes' text expositions as one: each family's HELP and TYPE once (the first
    process's), then every process's samples with `process="<k>"` added, processes in order.

    Line-based on the exposition `generate_latest` writes (HELP, TYPE, then the family's samples),
    so values pass through byte for byte: 2.0 ms for two processes of ~300 lines (20 KB) each,
    where prometheus_client's parser alone took 18 ms for the same two. Each (family, process)
    keeps its own series, so `sum without(process)` over a family is the gateway's total."""
    heads: dict[bytes, list[bytes]] = {}
    samples: dict[bytes, list[bytes]] = {}
    for proc, text in parts:
        label = b'process="' + proc.encode() + b'"'
        family = b""
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith(b"# HELP ") or line.startswith(b"# TYPE "):
                family = line[7:].split(b" ", 1)[0]
                head = heads.setdefault(family, [])
                samples.setdefault(family, [])
                if len(head) < 2 and not any(h[:7] == line[:7] for h in head):
                    head.append(line)
            elif line.startswith(b"#"):
                continue
            else:
                samples.setdefault(family, []).append(_with_label(line, label))
    out: list[bytes] = []
    for family, lines in samples.items():
        out += heads.get(family, [])
        out += lines
    return b"\n".join(out) + b"\n" if out else b""


def supervisor_exposition(state: dict[str, Any] | None, scraped: int) -> bytes:
    """The supervisor's own series (no `process` label: one per gateway, whichever process
    answers the scrape): target, live and scraped processes, and restarts so far."""

    class _Once(Collector):
        def collect(self) -> Iterator[Metric]:
            g = GaugeMetricFamily(
                "kvgate_processes",
                "Gateway processes: target (server.processes), live (running), serving "
                "(listening), scraped (in this scrape)",
                labels=["state"],
            )
            if state is not None:
                g.add_metric(["target"], float(state.get("target", 0)))
                g.add_metric(["live"], float(state.get("live", 0)))
                g.add_metric(["serving"], float(state.get("serving", 0)))
            g.add_metric(["scraped"], float(scraped))
            yield g
            if state is not None:
                c = CounterMetricFamily(
                    "kvgate_process_restarts",
                    "Gateway processes the supervisor restarted after they died",
                )
                c.add_metric([], float(state.get("restarts", 0)))
                yield c

    r = CollectorRegistry(auto_describe=False)
    r.register(_Once())
    return generate_latest(r)
