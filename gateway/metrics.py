"""The gateway's Prometheus metrics, in a registry of its own (one per app instance).

Label sets are bounded by config (models the fleet serves, configured workers); nothing from the
request body that a client can vary freely ever becomes a label.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds; TTFT spans cache hits (ms) to long queued prefills (tens of s).
_TTFT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry = CollectorRegistry(auto_describe=True)
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
        self.config_reloads = Counter("kvgate_config_reloads", "Config reloads applied", registry=r)
        self.config_reload_errors = Counter(
            "kvgate_config_reload_errors",
            "Config reloads rejected (running config kept)",
            registry=r,
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """A labelled child, cached: `labels()` costs microseconds per call on the hot path."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def forget_worker(self, name: str, states: list[str]) -> None:
        """Drop a removed worker's series so dashboards do not show ghosts."""
        self._children = {k: v for k, v in self._children.items() if name not in k[1]}
        for g in (self.in_flight, self.worker_up):
            with contextlib.suppress(KeyError):
                g.remove(name)
        for s in states:
            with contextlib.suppress(KeyError):
                self.worker_state.remove(name, s)
