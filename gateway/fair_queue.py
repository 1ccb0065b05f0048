"""The admission queue's pure core: bounded, deadline-aware, priority-tiered fair queueing.

No asyncio and no clock: every call takes ``now``, so the policy (who goes next, who is pushed out
of a full queue, who is refused at once and with which ``Retry-After``) is unit-tested with
explicit times. ``gateway.admission`` is the asyncio shell over it (one ``FairQueue`` per pool).

Entries are grouped in tiers (``tier_of(priority)``: 0..``levels``, higher first; strict
priority between tiers). Within a tier, tenants share by weight with start-time fair queueing
(each tenant is a flow; its head carries a virtual start tag, the smallest tag goes next), so a
tenant with 1,000 queued and one with 1 alternate, and weights 3:1 admit 3:1. Tags are
computed only for flow heads, so cancelling or expiring an entry never skews anyone's tags.

Bounds: ``max_queued`` entries in all, optionally ``max_queued_per_tenant`` (429). When full,
a newcomer pushes out the newest entry of the heaviest (queued / weight) tenant in the lowest
tier below it (503 "shed"); in its own tier, it pushes out the heaviest tenant's newest entry
when that tenant holds more than the newcomer's would (429 "over_share": longest weighted
queue drop, so one tenant's burst cannot lock another of the same tier out of a full queue).
Otherwise the newcomer is refused: 429 if its tenant holds more than its weighted share of the
tier, else 503 (the fleet is saturated).

Deadlines: each entry carries an absolute deadline; ``expire(now)`` removes the overdue. A
service rate (admissions per second of backlogged time, exponentially forgetting) predicts a
newcomer's wait from what is ahead of it (higher tiers, its own tenant's backlog, and other
tenants' entries up to their fair share); one that cannot make its deadline is refused at
push time instead of timing out later. The prediction also sets every ``Retry-After``.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "Entry",
    "FairQueue",
    "Pushed",
    "Reason",
    "Rejection",
    "State",
    "tier_of",
]


def tier_of(priority: float, levels: int = 10) -> int:
    """Bucket a 0..1 tenant priority; half-up so 0.25 and 0.35 do not round differently."""
    if not priority > 0:  # also NaN
        return 0
    return min(levels, math.floor(priority * levels + 0.5))


class State(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    ADMITTED = "admitted"
    REJECTED = "rejected"  # refused at push, never queued
    SHED = "shed"  # pushed out of a full queue by a newcomer
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    CLOSED = "closed"


class Reason(enum.Enum):
    OVER_SHARE = "over_share"  # the tenant holds more than its weighted share (429)
    TENANT_LIMIT = "tenant_limit"  # max_queued_per_tenant (429)
    QUEUE_FULL = "queue_full"  # (503)
    SHED = "shed"  # pushed out for a higher tier (503)
    DEADLINE = "deadline"  # predicted wait beyond the deadline, refused at push (429/503)
    EXPIRED = "expired"  # the deadline passed in the queue (429/503)
    CLOSED = "closed"  # the gateway is shutting down (503)


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: Reason
    status: int  # 429: the tenant's own load is the cause; 503: the fleet's
    retry_after_s: float


@dataclass(slots=True, eq=False)
class Entry:
    """One waiting request; identity-hashed, owned by the queue between push and leaving it."""

    tenant: str
    tier: int
    weight: float
    deadline: float  # absolute, on the caller's clock
    cost: float = 1.0  # virtual service it consumes in fair queueing
    payload: Any = None  # the shell's waiter; the core never looks at it
    priority: float = 0.0  # what `tier` was computed from, for a reload that rescales tiers
    seq: int = -1
    enqueued_at: float = 0.0
    state: State = State.NEW
    rejection: Rejection | None = None
    wait_s: float = 0.0  # time queued, set when it leaves the queue


class Pushed(NamedTuple):
    rejected: Rejection | None  # None: queued
    shed: tuple[Entry, ...]  # entries pushed out to make room (each has its rejection set)


class _Flow:
    """One tenant within one tier: FIFO of its entries and its fair-queueing tags."""

    __slots__ = ("finish", "q", "start", "tenant", "weight")

    def __init__(self, tenant: str, weight: float) -> None:
        self.tenant = tenant
        self.weight = weight
        self.q: OrderedDict[int, Entry] = OrderedDict()  # O(1) removal anywhere, peek both ends
        self.start = 0.0  # start tag of the current head
        self.finish = 0.0  # finish tag of the last served entry


class _Tier:
    __slots__ = ("flows", "heap", "size", "vtime")

    def __init__(self) -> None:
        # Active flows, plus idle ones whose finish tag still matters while the tier is busy.
        self.flows: dict[str, _Flow] = {}
        self.heap: list[tuple[float, int, _Flow]] = []  # (head start tag, head seq, flow), lazy
        self.size = 0
        self.vtime = 0.0


class _Rate:
    """Admissions per second of backlogged time, forgetting with a half-life.

    Measured only while entries wait, so it is the fleet's service rate under load, not the
    (demand-limited) arrival rate of a quiet period.
    """

    __slots__ = ("count", "half_life", "samples", "time")

    def __init__(self, half_life_s: float) -> None:
        self.half_life = half_life_s
        self.count = 0.0
        self.time = 0.0
        self.samples = 0

    def add(self, dt: float, served: int) -> None:
        decay = 0.5 ** (dt / self.half_life) if dt > 0 else 1.0
        self.count = self.count * decay + served
        self.time = self.time * decay + dt
        self.samples += served

    def per_s(self) -> float | None:
        r = self.count / self.time if self.time > 1e-9 else 0.0
        return r if r > 0 else None  # (a long stall can decay the count to underflow)


class FairQueue:
    """Bounded, deadline-aware, priority-tiered weighted fair queue; see the module docstring."""

    def __init__(
        self,
        *,
        max_queued: int,
        max_queued_per_tenant: int = 0,
        rate_half_life_s: float = 10.0,
        min_rate_samples: int = 16,
        fallback_retry_after_s: float = 1.0,
        max_retry_after_s: float = 60.0,
    ) -> None:
        self.max_queued = max_queued
        self.max_queued_per_tenant = max_queued_per_tenant
        self.min_rate_samples = min_rate_samples
        self.fallback_retry_after_s = fallback_retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self.outcomes: Counter[State] = Counter()  # terminal states, for tests and debugging
        self._rate = _Rate(rate_half_life_s)
        self._tiers: dict[int, _Tier] = {}  # non-empty tiers only
        self._per_tenant: dict[str, int] = {}
        self._deadlines: list[tuple[float, int, Entry]] = []  # lazy: stale items are skipped
        self._size = 0
        self._seq = 0
        self._busy_since: float | None = None  # the queue has been non-empty since
        self._mark = 0.0  # last time backlogged time was accounted

    def __len__(self) -> int:
        return self._size

    # -- entering --------------------------------------------------------------------------------
    def push(
        self,
        e: Entry,
        now: float,
        *,
        max_queued: int | None = None,
        max_queued_per_tenant: int | None = None,
    ) -> Pushed:
        """Queue ``e``, or refuse it, shedding another when full. The bounds may be narrowed
        for this push: a queue that shares its bounds with others (a model's retry queues,
        `AdmissionController`) is given what the others leave."""
        if e.state is not State.NEW:
            raise ValueError(f"entry already {e.state.value}")
        if not (e.weight > 0 and math.isfinite(e.weight)):
            raise ValueError(f"weight must be finite and > 0, got {e.weight!r}")
        e.enqueued_at = now
        cap = self.max_queued_per_tenant if max_queued_per_tenant is None else max_queued_per_tenant
        if cap and self._per_tenant.get(e.tenant, 0) >= cap:
            return self._refuse(e, Reason.TENANT_LIMIT, 429, now)
        remaining = e.deadline - now
        # Refused on the estimate only behind others: a newcomer with nobody ahead waits for the
        # next free slot, which no rate learned in an earlier stall predicts (one stall had made
        # an empty queue predict 16 s, refuse every newcomer, and so never learn again).
        late = remaining <= 0
        rate = self.service_rate()
        if not late and rate is not None:
            ahead = self._ahead(e.tier, e.tenant, e.weight)
            late = ahead >= 1 and (ahead + 1) / rate > remaining
        if late:
            status = 429 if self._over_share(e.tier, e.tenant, e.weight, 1) else 503
            return self._refuse(e, Reason.DEADLINE, status, now)
        shed: tuple[Entry, ...] = ()
        if self._size >= (self.max_queued if max_queued is None else max_queued):
            victim = self._victim(e)
            if victim is None:
                if self._over_share(e.tier, e.tenant, e.weight, 1):
                    return self._refuse(e, Reason.OVER_SHARE, 429, now)
                return self._refuse(e, Reason.QUEUE_FULL, 503, now)
            v, reason, status = victim
            self._leave(v, State.SHED, now, reason, status)
            shed = (v,)
        self._enqueue(e, now)
        return Pushed(None, shed)

    def refuse(self, e: Entry, reason: Reason, status: int, now: float) -> Pushed:
        """Refuse ``e`` without queueing it, as ``push`` would for ``reason``: for a bound
        kept outside this queue (a model's queues together)."""
        if e.state is not State.NEW:
            raise ValueError(f"entry already {e.state.value}")
        return self._refuse(e, reason, status, now)

    def shed_for(self, e: Entry, now: float) -> Entry:
        """Shed the entry a full queue would shed for ``e``, a lower tier's newest, for a bound
        kept outside this queue; ValueError when no tier below ``e``'s is queued here."""
        found = self._victim(e)
        if found is None or found[1] is not Reason.SHED:
            raise ValueError(f"no tier below {e.tier} is queued")
        v, reason, status = found
        self._leave(v, State.SHED, now, reason, status)
        return v

    def _refuse(self, e: Entry, reason: Reason, status: int, now: float) -> Pushed:
        e.state = State.REJECTED
        e.rejection = Rejection(reason, status, self._retry_after(e.tier, e.tenant, e.weight))
        self.outcomes[State.REJECTED] += 1
        return Pushed(e.rejection, ())

    def _enqueue(self, e: Entry, now: float) -> None:
        self._seq += 1
        e.seq = self._seq
        e.state = State.QUEUED
        tier = self._tiers.get(e.tier)
        if tier is None:
            tier = self._tiers[e.tier] = _Tier()
        flow = tier.flows.get(e.tenant)
        if flow is None:
            flow = tier.flows[e.tenant] = _Flow(e.tenant, e.weight)
        flow.weight = e.weight  # the latest config wins
        if not flow.q:  # (re)activation: no credit for having been idle, no debt either
            flow.start = max(tier.vtime, flow.finish)
            heapq.heappush(tier.heap, (flow.start, e.seq, flow))
        flow.q[e.seq] = e
        tier.size += 1
        self._per_tenant[e.tenant] = self._per_tenant.get(e.tenant, 0) + 1
        if self._size == 0:
            self._busy_since = now
        self._size += 1
        heapq.heappush(self._deadlines, (e.deadline, e.seq, e))

    def _victim(self, e: Entry) -> tuple[Entry, Reason, int] | None:
        low = min(self._tiers, default=None)
        if low is None or low > e.tier:
            return None
        tier = self._tiers[low]
        own = tier.flows.get(e.tenant) if low == e.tier else None
        best: _Flow | None = None
        best_load, best_seq = -1.0, -1
        for f in tier.flows.values():
            if f is own or not f.q:
                continue
            load = len(f.q) / f.weight
            seq = next(reversed(f.q))
            if load > best_load or (load == best_load and seq > best_seq):
                best, best_load, best_seq = f, load, seq
        if best is None:
            return None
        if low < e.tier:
            return _newest(best), Reason.SHED, 503
        mine = (len(own.q) if own is not None else 0) + 1
        if best_load > mine / e.weight:
            return _newest(best), Reason.OVER_SHARE, 429
        return None

    # -- leaving ---------------------------------------------------------------------------------
    def peek(self) -> Entry | None:
        """The entry ``pop`` would return."""
        if not self._size:
            return None
        flow = self._head_flow(self._tiers[max(self._tiers)])
        return flow.q[next(iter(flow.q))]

    def pop(self, now: float) -> Entry | None:
        """Admit the next entry; counts toward the service rate, so call it only on admission."""
        if not self._size:
            return None
        tier = self._tiers[max(self._tiers)]
        flow = self._head_flow(tier)
        _, e = flow.q.popitem(last=False)
        tier.vtime = flow.start
        flow.finish = flow.start + e.cost / flow.weight
        if flow.q:
            flow.start = flow.finish
            heapq.heappush(tier.heap, (flow.start, next(iter(flow.q)), flow))
        self._account(now, 1)
        self._forget(e, tier)
        e.state = State.ADMITTED
        e.wait_s = now - e.enqueued_at
        self.outcomes[State.ADMITTED] += 1
        if not self._size:
            self._busy_since = None
        return e

    def remove(self, e: Entry, now: float) -> bool:
        """Take out an entry whose client left; False if it had already left the queue."""
        if e.state is not State.QUEUED:
            return False
        self._leave(e, State.CANCELLED, now, None, 0)
        return True

    def expire(self, now: float) -> list[Entry]:
        """Remove every entry whose deadline has passed; each carries its rejection."""
        out: list[Entry] = []
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            e = heapq.heappop(dl)[2]
            if e.state is State.QUEUED:
                status = 429 if self._over_share(e.tier, e.tenant, e.weight, 0) else 503
                self._leave(e, State.EXPIRED, now, Reason.EXPIRED, status)
                out.append(e)
        return out

    def drain(self, retry_after_s: float, now: float) -> list[Entry]:
        """Empty the queue for shutdown: every entry leaves CLOSED with a 503."""
        out = [e for t in self._tiers.values() for f in t.flows.values() for e in f.q.values()]
        for e in out:
            self._leave(e, State.CLOSED, now, None, 0)
            e.rejection = Rejection(Reason.CLOSED, 503, retry_after_s)
        return out

    def retier(self, tier_of_entry: Callable[[Entry], int], now: float) -> None:
        """A reload changed how priorities map to tiers: every waiter moves to its tier on the
        new scale, in arrival order, keeping its deadline and time queued. Left on the old
        scale, tiers compare as raw numbers: after 10 -> 100 levels a 0.1 newcomer (tier 10)
        went before a 0.9 request already waiting (tier 9), for as long as waiters live."""
        queued = sorted(
            (e for t in self._tiers.values() for f in t.flows.values() for e in f.q.values()),
            key=lambda e: e.seq,
        )
        busy = self._busy_since
        self._tiers, self._per_tenant, self._deadlines, self._size = {}, {}, [], 0
        for e in queued:
            e.tier = tier_of_entry(e)
            self._enqueue(e, now)
        self._busy_since = busy

    def top_tier(self) -> int:
        """The highest tier with a waiter (-1 when empty): the next one served."""
        return max(self._tiers, default=-1)

    def next_deadline(self) -> float | None:
        dl = self._deadlines
        while dl and dl[0][2].state is not State.QUEUED:
            heapq.heappop(dl)
        return dl[0][0] if dl else None

    def _leave(
        self, e: Entry, state: State, now: float, reason: Reason | None, status: int
    ) -> None:
        tier = self._tiers[e.tier]
        flow = tier.flows[e.tenant]
        was_head = next(iter(flow.q)) == e.seq
        del flow.q[e.seq]
        if was_head and flow.q:  # the next head inherits the tag: the removed one got nothing
            heapq.heappush(tier.heap, (flow.start, next(iter(flow.q)), flow))
        self._forget(e, tier)
        e.state = state
        e.wait_s = now - e.enqueued_at
        self.outcomes[state] += 1
        if reason is not None:
            e.rejection = Rejection(reason, status, self._retry_after(e.tier, e.tenant, e.weight))
        if not self._size:
            self._account(now, 0)  # the backlog ended without service: that time counts too
            self._busy_since = None

    def _forget(self, e: Entry, tier: _Tier) -> None:
        tier.size -= 1
        self._size -= 1
        n = self._per_tenant[e.tenant] - 1
        if n:
            self._per_tenant[e.tenant] = n
        else:
            del self._per_tenant[e.tenant]
        if not tier.size:  # a new busy period starts with fresh tags
            del self._tiers[e.tier]
        elif len(tier.heap) > 2 * len(tier.flows) + 16:
            tier.heap = [(f.start, next(iter(f.q)), f) for f in tier.flows.values() if f.q]
            heapq.heapify(tier.heap)
        if len(self._deadlines) > 2 * self._size + 64:
            self._deadlines = [x for x in self._deadlines if x[2].state is State.QUEUED]
            heapq.heapify(self._deadlines)

    def _head_flow(self, tier: _Tier) -> _Flow:
        heap = tier.heap
        while True:
            _, seq, flow = heap[0]
            if flow.q and next(iter(flow.q)) == seq:
                return flow
            heapq.heappop(heap)

    def _account(self, now: float, served: int) -> None:
        if self._busy_since is None:
            return
        t0 = max(self._busy_since, self._mark)
        self._rate.add(max(0.0, now - t0), served)
        self._mark = now

    # -- what is ahead ---------------------------------------------------------------------------
    def service_rate(self) -> float | None:
        """Admissions per second while backlogged; None until enough have been seen."""
        if self._rate.samples < self.min_rate_samples:
            return None
        return self._rate.per_s()

    def predicted_wait(self, tier: int, tenant: str, weight: float = 1.0) -> float | None:
        """Seconds a newcomer would wait; None while the service rate is unknown.

        Future arrivals of higher tiers are not foreseen, so this is a lower bound: refusing on it
        never refuses a request that would have made its deadline at the current rate.
        """
        rate = self.service_rate()
        if rate is None:
            return None
        return (self._ahead(tier, tenant, weight) + 1) / rate

    def _ahead(self, tier: int, tenant: str, weight: float) -> float:
        """Queued entries served before a newcomer (tier, tenant, weight) at the current shares."""
        ahead = 0.0
        for level, t in self._tiers.items():
            if level > tier:
                ahead += t.size
        t = self._tiers.get(tier)
        if t is not None:
            own = t.flows.get(tenant)
            n_own = len(own.q) if own is not None else 0
            w = own.weight if own is not None and own.q else weight
            turns = (n_own + 1) / w  # virtual time until the newcomer's turn
            ahead += n_own
            for f in t.flows.values():
                if f is not own and f.q:
                    ahead += min(len(f.q), turns * f.weight)
        return ahead

    def _over_share(self, tier: int, tenant: str, weight: float, extra: int) -> bool:
        """More than its weighted share of the tier's queue (counting `extra` more of its own).

        A tenant alone in its tier is never over its share: then the fleet is the bottleneck.
        """
        t = self._tiers.get(tier)
        if t is None:
            return False
        own = t.flows.get(tenant)
        n_own = (len(own.q) if own is not None else 0) + extra
        w_own = own.weight if own is not None and own.q else weight
        total_w = w_own + sum(f.weight for f in t.flows.values() if f.q and f is not own)
        return n_own * total_w > (t.size + extra) * w_own + 1e-9

    def _retry_after(self, tier: int, tenant: str, weight: float) -> float:
        wait = self.predicted_wait(tier, tenant, weight)
        if wait is None:
            wait = self.fallback_retry_after_s
        return min(max(wait, 1.0), self.max_retry_after_s)

    # -- stats -----------------------------------------------------------------------------------
    def depth_by_tier(self) -> dict[int, int]:
        return {level: t.size for level, t in self._tiers.items()}

    def depth_of(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def check(self) -> None:
        """Assert the internal bookkeeping agrees with itself (tests)."""
        total = 0
        per_tenant: Counter[str] = Counter()
        for level, t in self._tiers.items():
            n = 0
            for name, f in t.flows.items():
                assert f.tenant == name
                for seq, e in f.q.items():
                    assert e.seq == seq and e.state is State.QUEUED
                    assert e.tier == level and e.tenant == name
                    per_tenant[name] += 1
                n += len(f.q)
                if f.q:  # every active flow is reachable through the heap
                    assert any(s == next(iter(f.q)) and g is f for _, s, g in t.heap)
            assert n == t.size > 0
            total += n
        assert total == self._size
        assert dict(per_tenant) == self._per_tenant
        queued = sum(1 for x in self._deadlines if x[2].state is State.QUEUED)
        assert queued == self._size


def _newest(f: _Flow) -> Entry:
    return f.q[next(reversed(f.q))]
