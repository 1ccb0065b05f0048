"""The fleet as the gateway sees it: each worker's health state, served models and load.

State changes are plain synchronous methods (no I/O) so the health state machine is tested
directly; `workers.probe` and the proxy feed it outcomes.

    starting --probe ok--> healthy --N consecutive failures--> unhealthy
    unhealthy --M consecutive probe successes (re-probed with backoff)--> healthy

Passive failures (a proxied request that could not connect or got a 5xx) count toward the same N,
so a dead worker is ejected at the speed of traffic rather than at the speed of probes.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from scoring.policy import WorkerView
from workers.vllm_metrics import WorkerMetrics


class Health(enum.StrEnum):
    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


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
class Worker:
    spec: WorkerSpec
    health: Health = Health.STARTING
    models: frozenset[str] = frozenset()
    # The worker's own /v1/models entries (max_model_len, parent for LoRA adapters, ...).
    model_cards: dict[str, dict[str, object]] = field(default_factory=dict)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    in_flight: int = 0
    # Gateway-side load the last scrape cannot show yet (see scoring.views.WorkerView).
    in_flight_at_scrape: int | None = None
    prefill_tokens: int = 0
    sent_tokens_since_scrape: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    backoff_s: float = 0.0
    last_error: str = ""
    last_probe_at: float = 0.0
    last_change_at: float = field(default_factory=time.monotonic)
    _view: WorkerView | None = field(default=None, repr=False, compare=False)
    _view_key: tuple[object, ...] = field(default=(), repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    def view(self) -> WorkerView:
        """The routing snapshot; the same object until this worker changes, so policies can
        memoise per-view work by identity (kv_aware does)."""
        key = (
            self.in_flight,
            self.prefill_tokens,
            self.sent_tokens_since_scrape,
            self.in_flight_at_scrape,
            id(self.metrics),
            id(self.spec),
        )
        if self._view is not None and self._view_key == key:
            return self._view
        m = self.metrics
        self._view_key = key
        self._view = WorkerView(
            name=self.spec.name,
            in_flight=self.in_flight,
            running=m.running,
            waiting=m.waiting,
            kv_usage=m.kv_usage,
            block_size=m.block_size,
            num_blocks=m.num_blocks,
            weight=self.spec.weight,
            labels=self.spec.labels,
            in_flight_at_scrape=self.in_flight_at_scrape,
            prefill_tokens=self.prefill_tokens,
            sent_tokens_since_scrape=self.sent_tokens_since_scrape,
        )
        return self._view


class Registry:
    def __init__(
        self,
        specs: Iterable[WorkerSpec] = (),
        *,
        unhealthy_after: int = 3,
        healthy_after: int = 1,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.workers: dict[str, Worker] = {}
        # Every model any current worker has ever reported: tells "unknown model" (404) apart
        # from "known model, nobody healthy serves it right now" (503).
        self._known_models: dict[str, frozenset[str]] = {}
        self.sync(specs)

    # -- membership --------------------------------------------------------------------------
    def sync(self, specs: Iterable[WorkerSpec]) -> tuple[list[str], list[str]]:
        """Make the fleet match `specs`; returns (added, removed). Unchanged workers keep state."""
        wanted = {s.name: s for s in specs}
        removed = [n for n in self.workers if n not in wanted]
        for n in removed:
            self.remove(n)
        added = []
        for name, spec in wanted.items():
            cur = self.workers.get(name)
            if cur is None:
                self.workers[name] = Worker(spec)
                added.append(name)
            elif cur.spec != spec:
                if cur.spec.url != spec.url:  # a different server: start over
                    self.workers[name] = Worker(spec)
                    self._known_models.pop(name, None)
                    added.append(name)
                else:
                    cur.spec = spec
        return added, removed

    def add(self, spec: WorkerSpec) -> Worker:
        if spec.name in self.workers:
            raise ValueError(f"worker {spec.name!r} already exists")
        w = self.workers[spec.name] = Worker(spec)
        return w

    def remove(self, name: str) -> bool:
        self._known_models.pop(name, None)
        return self.workers.pop(name, None) is not None

    # -- queries -----------------------------------------------------------------------------
    def candidates(self, model: str) -> list[Worker]:
        return [
            w for w in self.workers.values() if w.health is Health.HEALTHY and model in w.models
        ]

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.health is Health.HEALTHY]

    def served_models(self) -> dict[str, dict[str, object]]:
        """Model id -> card, over healthy workers (the first worker's card wins)."""
        out: dict[str, dict[str, object]] = {}
        for w in self.healthy():
            for mid, card in w.model_cards.items():
                out.setdefault(mid, card)
        return out

    def knows_model(self, model: str) -> bool:
        return any(model in ms for ms in self._known_models.values())

    # -- outcomes ----------------------------------------------------------------------------
    def probe_ok(
        self,
        name: str,
        cards: list[dict[str, object]] | None,
        metrics: WorkerMetrics | None,
    ) -> None:
        w = self.workers.get(name)
        if w is None:
            return
        w.last_probe_at = time.monotonic()
        if cards is not None:
            w.model_cards = {str(c["id"]): c for c in cards}
            w.models = frozenset(w.model_cards)
            self._known_models[name] = w.models
        if metrics is not None:
            w.metrics = metrics
            w.in_flight_at_scrape = w.in_flight
            w.sent_tokens_since_scrape = 0
        w.consecutive_failures = 0
        w.consecutive_successes += 1
        w.last_error = ""
        if w.health is not Health.HEALTHY and w.consecutive_successes >= self.healthy_after:
            self._set(w, Health.HEALTHY)
            w.backoff_s = 0.0

    def probe_failed(self, name: str, error: str) -> None:
        w = self.workers.get(name)
        if w is None:
            return
        w.last_probe_at = time.monotonic()
        self._fail(w, error)
        if w.health is Health.UNHEALTHY:
            w.backoff_s = min(
                self.backoff_max_s,
                max(self.backoff_initial_s, w.backoff_s * 2 if w.backoff_s else 0.0),
            )

    def passive_failure(self, name: str, error: str) -> None:
        """A proxied request failed before its first byte (connect error, 5xx, timeout)."""
        w = self.workers.get(name)
        if w is not None:
            self._fail(w, error)

    def passive_success(self, name: str) -> None:
        w = self.workers.get(name)
        if w is not None and w.health is Health.HEALTHY:
            w.consecutive_failures = 0

    def _fail(self, w: Worker, error: str) -> None:
        w.consecutive_successes = 0
        w.consecutive_failures += 1
        w.last_error = error
        if w.health is not Health.UNHEALTHY and w.consecutive_failures >= self.unhealthy_after:
            self._set(w, Health.UNHEALTHY)

    def _set(self, w: Worker, health: Health) -> None:
        w.health = health
        w.last_change_at = time.monotonic()

    def next_probe_delay(self, name: str, interval_s: float) -> float:
        w = self.workers.get(name)
        if w is None or w.health is not Health.UNHEALTHY:
            return interval_s
        return max(interval_s, w.backoff_s)
