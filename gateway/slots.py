"""Which workers a request may use and how many requests they can take now: the free slots that
admission waits for and the proxy passes full workers by, the priority reserve, and canary pools.

Kept apart from the walk (gateway/app.py) because both admission's wake-ups and every dispatch
read it, and because its rules (KV saturation scaled to the requests still in flight, a half-open
worker's trial budget, headroom for the latency-sensitive tiers) are policy, not plumbing.
`Gateway.apply` reconfigures it on every reload.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence

from gateway.config import AdmissionSettings, SplitSettings
from gateway.fair_queue import tier_of
from scoring.views import RoutingOptions
from workers.registry import Registry
from workers.worker import Health, Worker


class Slots:
    """Free worker slots, per worker and per model for a priority."""

    def __init__(
        self,
        registry: Registry,
        admission: AdmissionSettings,
        options: RoutingOptions,
        top_priority: float,
    ) -> None:
        self.registry = registry
        self.configure(admission, options, top_priority)

    def configure(
        self, admission: AdmissionSettings, options: RoutingOptions, top_priority: float
    ) -> None:
        """A reload: the caps, the reserve, the saturation threshold and the tenants' top tier."""
        self.worker_concurrency = admission.worker_concurrency
        self.priority_reserve = admission.priority_reserve
        self.reserve_min_priority = admission.reserve_min_priority
        self.saturation_kv = options.saturation_kv
        self.top_priority = top_priority
        # The reserve is decided on the admission queue's tier, not the raw priority: a tier is
        # served as one (fair shares, FIFO per tenant), and a waiter the reserve excludes at the
        # head of a tier would hold back one behind it that may take the reserve, until it timed
        # out with the reserved slots idle. So the whole tier of reserve_min_priority takes it.
        # Kept only when some tenant can use it: an open gateway (or one whose tenants all sit
        # in lower tiers) would otherwise leave that share of the fleet idle.
        self.priority_levels = levels = admission.priority_levels
        reserve_tier = tier_of(admission.reserve_min_priority, levels)
        # 0: no reserve (no tier is below it).
        self.reserve_tier = reserve_tier if tier_of(top_priority, levels) >= reserve_tier else 0

    def worker_room(self, w: Worker) -> int:
        """Requests ``w`` can take now: its concurrency cap minus what is in flight there (every
        replica's, with [cluster]: the cap is the worker's, not one replica's share), none while
        its KV cache is saturated (new sequences would only preempt running ones).

        The KV figure is the last scrape's, up to a probe interval old. Requests that finished
        since then freed their blocks: the usage is scaled by the share of the requests in flight
        at the scrape that still are. Gating on the raw figure held every request in the queue
        while the worker sat idle until the next scrape (measured: 256 queued, the worker at 0
        running, ~2 s at a time: the ladder's c=256 TTFB p99)."""
        busy = w.in_flight + w.remote_in_flight
        kv = w.metrics.kv_usage
        sat = self.saturation_kv
        if kv >= sat:
            at = w.in_flight_at_scrape
            if not at or busy >= at or kv * busy / at >= sat:
                return 0
        cap = w.spec.max_concurrency or self.worker_concurrency
        room = cap - busy
        if w.health is Health.HALF_OPEN:
            # On trial: only this replica's trial requests (the half-open state is its own
            # view; another replica's traffic there must not keep its trial from ever starting).
            # Not the requests it still runs from before its ejection (`Registry.trial_room`):
            # counted, a stream that outlived the ejection held the trial off until it ended.
            trial = self.registry.trial_room(w)
            room = trial if trial < room else room
        return room if room > 0 else 0

    def eligible(
        self, model: str, tried: Collection[str], pool_ok: Callable[[Worker], bool] | None
    ) -> list[Worker]:
        """The workers a dispatch may pick from, the filters in order: healthy and serving
        ``model`` (the registry's), not ``tried`` by this request, in its canary pool, with room.
        The last two are preferences: when nobody passes one it is dropped, so a request still
        goes somewhere (the pool empty or full, every worker full past admission's count).
        Room comes before the pool: admission counted the free slots of every worker of the
        model, so a request drawn into a full canary pool goes to a worker with room outside it
        (the canary's share falls while it is full) rather than past the canary's cap (review:
        a canary at max_concurrency 1 reached 6 in flight beside an idle stable worker)."""
        cands = [w for w in self.registry.candidates(model) if w.name not in tried]
        room = self.worker_room
        if pool_ok is not None:
            pool = [w for w in cands if pool_ok(w)]
            roomy = [w for w in pool if room(w) > 0] or [w for w in cands if room(w) > 0]
            return roomy or pool or cands
        return [w for w in cands if room(w) > 0] or cands

    def free(self, model: str, priority: float, tried: Collection[str] = ()) -> int:
        """Free slots for ``model`` that a request of ``priority`` may take (the reserve is
        kept for the latency-sensitive tiers). The same for every priority of one admission
        tier, so the queue never finds room for one waiter of a tier and none for another.
        A retry's count leaves out the workers it ``tried``: their room is no use to it; -1 when
        none of the others serves ``model`` (admission refuses it: no wait can help)."""
        free = total = spare = 0
        room = self.worker_room
        untried = not tried
        for w in self.registry.candidates(model):
            total += w.spec.max_concurrency or self.worker_concurrency
            if not tried or w.name not in tried:
                free += room(w)
                untried = True
            else:
                spare += room(w)
        if not untried:
            return -1
        if self.reserve_tier and tier_of(priority, self.priority_levels) < self.reserve_tier:
            # Headroom, not a quota: the last free slots stay free for the high tiers whatever
            # they already run. Withholding only the part of the reserve they leave unused was
            # measured too (bench/spike.py): it let high-priority p99 TTFT reach 10x unloaded,
            # because a busy high tier then finds no slot; fixed headroom kept it at 1.2x.
            # Free slots of the workers a retry tried are headroom too: withheld from its own
            # untried ones alone, the reserve kept a low-tier retry waiting with all 3 of 3
            # workers free (reserve 2), once retries had to be admitted (gateway/proxy.py).
            reserve = int(total * self.priority_reserve)
            free = min(free, free + spare - reserve)
        return free if free > 0 else 0


def canary_pool(
    splits: Sequence[SplitSettings], model: str, rng: random.Random
) -> Callable[[Worker], bool] | None:
    """Canary splits: this request's pool, drawn once so retries stay in it when they can; None
    when no split applies to ``model`` (any worker)."""
    mine = [sp for sp in splits if sp.model in ("*", model)]
    if not mine:
        return None
    r = rng.random()
    acc = 0.0
    for sp in mine:
        acc += sp.share
        if r < acc:
            want = sp.labels
            return lambda w: all(w.spec.labels.get(k) == v for k, v in want.items())
    others = [sp.labels for sp in mine]
    return lambda w: (
        not any(all(w.spec.labels.get(k) == v for k, v in lab.items()) for lab in others)
    )
