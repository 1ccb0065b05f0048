"""One worker as the gateway sees it: its spec, health state, served models, load and the evidence
the registry's protections act on.

A record, not an actor: apart from derived reads (`drained`, `error_rate`, `ttft_median`, the
routing `view`) it has no behaviour, and every state change is `workers.registry`'s, so the health
state machine stays in one place. It lives apart from the registry because the request path (the
call record, proxy, relay, endpoints) holds and reads single workers without needing the fleet.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from scoring.views import WorkerView
from workers.dispatch_load import DispatchLoad
from workers.vllm_metrics import WorkerMetrics


class Health(enum.StrEnum):
    STARTING = "starting"
    HEALTHY = "healthy"
    # On trial after a request-failure ejection: routable for `half_open_requests` at a time.
    HALF_OPEN = "half_open"
    UNHEALTHY = "unhealthy"


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    name: str
    url: str
    weight: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)
    api_key: str = ""
    # KV events (vLLM --kv-events-config): PUB endpoint, replay endpoint, topic; "" = none.
    kv_events: str = ""
    kv_events_replay: str = ""
    kv_events_topic: str = ""
    max_concurrency: int = 0  # 0 = the gateway's default per-worker concurrency


@dataclass(slots=True)
class Worker(DispatchLoad):
    spec: WorkerSpec
    health: Health = Health.STARTING
    models: frozenset[str] = frozenset()
    # The worker's own /v1/models entries (max_model_len, parent for LoRA adapters, ...).
    model_cards: dict[str, dict[str, object]] = field(default_factory=dict)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    # When `metrics` were last scraped (registry clock; None = never), and how many probes in a
    # row have brought none since: at the registry's `metrics_stale_after` they are dropped
    # (`WorkerMetrics()`: unknown, routed on the gateway's own counts) until a scrape succeeds.
    metrics_at: float | None = None
    metrics_missed: int = 0
    in_flight: int = 0
    # Gateway-side load the last scrape cannot show yet (see scoring.views.WorkerView).
    in_flight_at_scrape: int | None = None
    prefill_tokens: int = 0
    sent_tokens_since_scrape: int = 0
    # Other gateway replicas' in-flight requests and queued-prefill tokens here, as the last
    # cluster sync saw them (gateway.cluster; 0 without [cluster]). `in_flight` stays this
    # replica's own (what it releases, what drain waits for); load readers add these.
    remote_in_flight: int = 0
    remote_prefill_tokens: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # Proxied requests failed since the last proxied success (probe successes do not reset it).
    passive_streak: int = 0
    backoff_s: float = 0.0
    last_error: str = ""
    last_probe_at: float = 0.0
    last_change_at: float = field(default_factory=time.monotonic)
    # Operator drain: no new requests, in-flight ones finish, probes go on.
    draining: bool = False
    # Held ejection: not readmitted before this (registry clock); why; how many in a row. The
    # reason stays through half-open, until a trial request succeeds.
    ejected_until: float = 0.0
    ejection_reason: str = ""  # "" | "failures" | "breaker" | "outlier"
    ejections: int = 0
    # Last passive success (registry clock): proof of generation the deep probe need not repeat.
    last_success_at: float = 0.0
    # Breaker window: the last passive outcomes (True = failure) and how many of them failed.
    outcomes: deque[bool] = field(default_factory=deque, repr=False)
    outcome_failures: int = 0
    # The last TTFT samples (seconds) for outlier detection.
    ttfts: deque[float] = field(default_factory=deque, repr=False)
    _view: WorkerView | None = field(default=None, repr=False, compare=False)
    _view_key: tuple[object, ...] = field(default=(), repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def drained(self) -> bool:
        """Draining and nothing in flight: safe to stop or upgrade."""
        return self.draining and self.in_flight <= 0

    @property
    def error_rate(self) -> float:
        """Failure share of the breaker window (0 when empty)."""
        n = len(self.outcomes)
        return self.outcome_failures / n if n else 0.0

    def change_message(self, was: Health) -> str:
        """The log line for the transition from `was` to the current state (the registry's
        `on_change` hook logs it): one per transition, saying why, and for an ejection how many in
        a row and for how long, so a flapping or relapsing worker reads as such."""
        name = self.spec.name
        if self.health is Health.UNHEALTHY and self.ejected_until > self.last_change_at:
            hold = self.ejected_until - self.last_change_at
            return (
                f"worker {name} ejected ({self.ejection_reason}, ejection {self.ejections} in a "
                f"row, held {hold:g}s): {self.last_error}"
            )
        if self.health is Health.HALF_OPEN:
            return (
                f"worker {name} -> half_open after its {self.ejection_reason} ejection: back once "
                "a trial request succeeds"
            )
        if self.health is Health.HEALTHY:
            why = "a trial request succeeded" if was is Health.HALF_OPEN else "probe ok"
            return f"worker {name} -> healthy ({why}; models: {sorted(self.models)})"
        return f"worker {name} -> {self.health} ({self.last_error})"

    def ttft_median(self) -> float | None:
        """Median of the TTFT window; a median, not a mean, so that a few slow prefills of long
        uncached prompts do not make a worker look slow."""
        return median(list(self.ttfts)) if self.ttfts else None

    def view(self) -> WorkerView:
        """The routing snapshot; the same object until this worker changes, so policies can
        memoise per-view work by identity (kv_aware does)."""
        key = (
            self.in_flight,
            self.prefill_tokens,
            self.remote_in_flight,
            self.remote_prefill_tokens,
            self.sent_tokens_since_scrape,
            self.in_flight_at_scrape,
            # The objects, not their id(): a scrape's metrics replaced and freed, a later one
            # often took the same address, and a worker whose view went unread across two
            # scrapes was routed on the old one (review: waiting 0 where it reported 40). The
            # key holds them, so no address is reused while it does; equal ones are the same.
            self.metrics,
            self.spec,
        )
        if self._view is not None and self._view_key == key:
            return self._view
        m = self.metrics
        self._view_key = key
        # The whole gateway's load, every replica's: the worker's queue is shared.
        self._view = WorkerView(
            name=self.spec.name,
            in_flight=self.in_flight + self.remote_in_flight,
            running=m.running,
            waiting=m.waiting,
            kv_usage=m.kv_usage,
            block_size=m.block_size,
            num_blocks=m.num_blocks,
            weight=self.spec.weight,
            labels=self.spec.labels,
            in_flight_at_scrape=self.in_flight_at_scrape,
            prefill_tokens=self.prefill_tokens + self.remote_prefill_tokens,
            sent_tokens_since_scrape=self.sent_tokens_since_scrape,
        )
        return self._view
