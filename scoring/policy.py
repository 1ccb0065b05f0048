"""Routing policies behind one interface.

A policy sees an immutable snapshot of the candidate workers (already filtered to healthy ones that
serve the model) and the request's routing key, and picks one. It never does I/O and never mutates
the snapshot, so it is safe to call from the request path and from the offline simulator alike.

Policies that learn (``prefix``, ``session``, ``kv_aware``) keep what they learned in a
``RoutingState`` (prefix index + session table) that outlives the policy object: a weight reload is
``policy.set_weights(w)``, a policy switch is ``make_policy(new, state=old.state)``, and neither
forgets which worker holds what.

Gateway call sequence per request::

    route = route_request("chat", body, model=m, namespace=ns, tenant_priority=p,
                          session_id=session_id_from(headers, body), request_id=rid,
                          options=policy.options, hash_prefix=policy.needs_chain)
    decision = policy.choose(views, route)        # per attempt, retries reuse `route`
    policy.on_dispatch(decision.worker.name, route)

This module holds the interface, the baselines and the registry. The request's key is built by
``scoring.route_key``; what learning policies keep, and how they learn it, is ``scoring.state``;
the default scorer, ``kv_aware``, is ``scoring.kv_aware``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from scoring.kv_aware import KVAware
from scoring.signals import commitment_yield, is_saturated, load_estimate, prefix_signal
from scoring.state import RoutingState, _Learning
from scoring.views import Decision, RouteRequest, RoutingOptions, Weights, WorkerView

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "LeastLoaded",
    "Policy",
    "PrefixAffinity",
    "RoundRobin",
    "SessionAffinity",
    "load_of",
    "make_policy",
]


class Policy(Protocol):
    name: str
    needs_chain: bool  # does choose() use RouteRequest.chain? (skip hashing when not)
    options: RoutingOptions  # pass to route_request so chains match the index's block size
    state: RoutingState | None  # what it learned; pass to make_policy(..., state=) on a switch

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision: ...

    def on_dispatch(self, worker_name: str, request: RouteRequest) -> Any:
        """The request was sent to ``worker_name`` (call once per attempt actually sent);
        returns a receipt for ``on_refused``."""

    def on_refused(self, worker_name: str, request: RouteRequest, receipt: Any) -> None:
        """The worker refused that attempt without working on it: forget what it taught."""

    def on_prefill_done(self, worker_name: str, request: RouteRequest) -> None:
        """That attempt produced its first token, or failed: its prefill is over either way."""

    def on_worker_removed(self, name: str) -> None:
        """The worker left the fleet (or restarted at the same address: its cache is gone)."""

    def set_weights(self, weights: Weights) -> None:
        """Apply new scorer weights from the next decision on (no-op for policies without)."""


class _Stateless:
    """Hooks for policies that learn nothing: the gateway calls every hook on every policy."""

    needs_chain = False
    options: RoutingOptions = RoutingOptions()
    state: RoutingState | None = (
        None  # nothing learned; make_policy(..., state=p.state) still works
    )

    def on_dispatch(self, worker_name: str, request: RouteRequest) -> None:
        return None

    def on_refused(self, worker_name: str, request: RouteRequest, receipt: Any) -> None:
        return None

    def on_prefill_done(self, worker_name: str, request: RouteRequest) -> None:
        return None

    def on_worker_removed(self, name: str) -> None:
        return None

    def set_weights(self, weights: Weights) -> None:
        return None


# Models a round-robin policy keeps a counter for (LoRA adapters are models).
_MAX_MODELS = 4096


class RoundRobin(_Stateless):
    """Even spread, blind to load and cache: the baseline every other policy is measured against."""

    name = "round_robin"

    def __init__(self) -> None:
        # One counter per model: with one for all, a client alternating two models sent each
        # model's every request to the same worker (review).
        self._counters: dict[str, Iterator[int]] = {}

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        counter = self._counters.get(request.model)
        if counter is None:
            if len(self._counters) >= _MAX_MODELS:  # names come from served models only
                self._counters.clear()
            counter = self._counters[request.model] = itertools.count()
        return Decision(candidates[next(counter) % len(candidates)], "round_robin")


def load_of(worker: WorkerView) -> float:
    """Outstanding work per unit of weight; the gateway's own count is fresher than a scrape."""
    return max(worker.in_flight, worker.running + worker.waiting) / max(worker.weight, 1e-9)


class LeastLoaded(_Stateless):
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


class PrefixAffinity(_Learning):
    """Cache affinity: the longest prefix holder, misses and ties at random, and a load guard.

    A baseline (what the vLLM production-stack router does), kept to measure what the load terms
    of ``kv_aware`` buy. Holders come from ``RoutingState.matches``, as kv_aware's do (what KV
    events say for workers that publish them, the approximate index for the rest).

    Without the guard it was an outage waiting for a common system prompt: every request matched the
    first block on one worker and went there (offline p50 TTFT ~3,000 s of simulated time; online
    p99 23.6 s). So, as the cache-aware Rust routers' balance thresholds do, a worker whose
    outstanding requests exceed the least loaded candidate's by more than ``affinity_max_excess``
    and ``affinity_max_ratio`` times is left out; what it held spreads to the others, which then
    hold it too. A holder is also left out for a request whose session does not live there when the
    long sessions already pinned to it outweigh the least committed worker's past
    ``commitment_slack`` (``signals.commitment_yield`` at 0): request counts miss that agents'
    contexts grow where their preamble was (p99 TTFT 28.8 s on the agentic trace of bench/README).
    """

    name = "prefix"
    needs_chain = True

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        o = self.options
        now = self._clock()  # once per decision
        matches, _trusted = self.state.matches(request, now)
        floor = min(load_of(w) for w in candidates)
        limit = max(floor + o.affinity_max_excess, floor * o.affinity_max_ratio)
        committed, home, floor_c = self._commitment(candidates, request, now)
        best = 0
        ties: list[WorkerView] = []
        open_: list[WorkerView] = []
        yielded = False
        for w in candidates:
            m = matches.get(w.name, 0)
            if load_of(w) > limit or (
                m
                and committed
                and w.name != home
                and commitment_yield(
                    committed.get(w.name, 0),
                    floor_c,
                    request.matched_tokens(m),
                    o.commitment_slack,
                    o.affinity_max_ratio,
                )
                <= 0.0
            ):
                yielded |= m > 0
                continue
            open_.append(w)
            if m > best:
                best, ties = m, [w]
            elif m == best:
                ties.append(w)
        # Both guards may leave nobody (the least loaded worker left out for its commitment,
        # every other one over the load limit): then the least loaded, as with no guard.
        pick = self._pick(
            ties if best else (open_ or [w for w in candidates if load_of(w) == floor])
        )
        self.state.sync_capacity(pick)
        prompt = request.prompt_tokens or request.matched_tokens(len(request.chain))
        return Decision(
            pick,
            "affinity" if best else "balance" if yielded else "random",
            {"prefix": prefix_signal(request.matched_tokens(best), prompt)},
            matched_blocks=best,
            prefill_tokens=_uncached(request, best),
        )

    def _commitment(
        self, candidates: Sequence[WorkerView], request: RouteRequest, now: float
    ) -> tuple[dict[str, int], str | None, float]:
        """(session commitment per worker, this session's worker, the least committed
        candidate's commitment, this session's own turn not counted)."""
        if not self.options.commitment_slack:
            return {}, None, 0.0
        committed = self.state.sessions.committed(now)
        if not committed:
            return committed, None, 0.0
        entry = self.state.sessions.lookup(request.session_id, now) if request.session_id else None
        home = entry[0] if entry else None
        own = self.state.sessions.active_tokens(request.session_id, home) if home else 0
        floor = min(committed.get(w.name, 0) - (own if w.name == home else 0) for w in candidates)
        return committed, home, floor


class SessionAffinity(_Learning):
    """Sticky to the session's last worker unless it is saturated; otherwise least loaded."""

    name = "session"
    needs_chain = False

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        o = self.options
        last = (
            self.state.sessions.get(request.session_id, self._clock())
            if request.session_id
            else None
        )
        ok: list[WorkerView] = []
        lost = False
        for w in candidates:
            _wait, queued, kv = load_estimate(w, o)
            sat = is_saturated(queued, kv, o)
            if w.name == last:
                if not sat:
                    return Decision(w, "session", prefill_tokens=_uncached(request, 0))
                lost = True
            if not sat:
                ok.append(w)
        pool = ok or list(candidates)
        best = min(load_of(w) for w in pool)
        pick = self._pick([w for w in pool if load_of(w) == best])
        return Decision(
            pick,
            "load_fallback" if lost else "least_loaded",
            prefill_tokens=_uncached(request, 0),
            saturated=not ok,
        )


def _uncached(request: RouteRequest, matched_blocks: int) -> int:
    left = request.prompt_tokens - request.matched_tokens(matched_blocks)
    return int(left) if left > 0 else 0


# -- registry --------------------------------------------------------------------------------------
POLICIES: dict[str, type] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "prefix": PrefixAffinity,
    "session": SessionAffinity,
    "kv_aware": KVAware,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(
    name: str,
    *,
    weights: Weights | None = None,
    options: RoutingOptions | None = None,
    rng: random.Random | None = None,
    state: RoutingState | None = None,
    clock: Callable[[], float] | None = None,
) -> Policy:
    """A policy by its config name. Pass ``state=old.state`` to keep what the old one learned."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(rng)
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    policy: Policy = cls(weights=weights, options=options, rng=rng, state=state, clock=clock)
    return policy
