"""Routing policies behind one interface.

A policy sees an immutable snapshot of the candidate workers (already filtered to healthy ones that
serve the model) and the request's routing key, and picks one. It never does I/O and never mutates
the snapshot, so it is safe to call from the request path and from the offline simulator alike.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True, frozen=True)
class WorkerView:
    """What routing may know about one worker at decision time."""

    name: str
    in_flight: int = 0  # requests this gateway has sent and not yet seen finish
    running: int = 0  # vllm:num_requests_running at the last scrape
    waiting: int = 0  # vllm:num_requests_waiting at the last scrape
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1) at the last scrape
    block_size: int | None = None
    num_blocks: int | None = None
    weight: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """The routing key of one request."""

    model: str
    request_id: str = ""
    tenant_priority: float = 0.5


@dataclass(slots=True, frozen=True)
class Decision:
    worker: WorkerView
    reason: str


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision: ...


class RoundRobin:
    """Even spread, blind to load and cache: the baseline every other policy is measured against."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        return Decision(candidates[next(self._counter) % len(candidates)], "round_robin")


def load_of(worker: WorkerView) -> float:
    """Outstanding work per unit of weight; the gateway's own count is fresher than a scrape."""
    return max(worker.in_flight, worker.running + worker.waiting) / max(worker.weight, 1e-9)


class LeastLoaded:
    """Fewest outstanding requests; ties broken at random so bursts do not pile onto one worker."""

    name = "least_loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        best = min(load_of(w) for w in candidates)
        ties = [w for w in candidates if load_of(w) == best]
        pick = ties[0] if len(ties) == 1 else self._rng.choice(ties)
        return Decision(pick, "least_loaded")


POLICIES: dict[str, type] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
