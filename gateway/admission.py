"""The admission queue: what a request does when no worker has room for it.

Overload must be boring: a spike is answered by a bounded wait with a
deadline, served by tenant priority and fairly within a priority, and whoever cannot be served in
time gets an OpenAI-shaped 429 or 503 with ``Retry-After`` at once rather than a hung socket. The
queue never admits beyond the room the caller reports, so queueing adds latency to low-priority
traffic instead of adding load to the fleet.

Two layers, per the project's "pure cores, thin shells":

``FairQueue`` (pure, no asyncio, no clock: every call takes ``now``)
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

``AdmissionController`` (asyncio shell, one ``FairQueue`` per pool, i.e. per model)
    ``await admit(...)`` returns an ``Admitted`` at once when nothing is queued in the pool and
    ``has_room()`` says so (the fast path: no allocation, no clock read); otherwise it queues a
    future and waits. ``kick()`` admits heads while there is room; a timer re-checks every
    ``recheck_s`` while anything is queued, so a missed kick delays, never strands. A refusal
    raises ``APIError`` (429/503, ``Retry-After``, header ``x-kvgate-admission: <reason>``). A
    cancelled waiter (client gone) leaves the queue, and a grant it had not used yet goes to the
    next waiter. ``close()`` drains with 503 for shutdown.

Wiring (for gateway/app.py)
    * ``has_room`` returns the number of free slots in the request's pool (a bool works: ``True``
      counts as one). The controller subtracts grants whose waiters have not resumed yet, because
      ``in_flight`` only grows when the proxy picks a worker: await ``admit()`` as the last await
      before ``proxy.forward()`` (which is synchronous up to ``_acquire``), or a slot can be given
      twice. With a bool predicate, waiters are released one per event-loop turn, which is safe.
    * Call ``kick(model)`` (or ``kick()``) when a request releases its worker and after each
      metrics scrape; it is cheap when nothing is queued.
    * Deadline: ``settings.deadline_s(request.headers.get(settings.deadline_header))``.
    * Metrics: pass an ``AdmissionObserver`` (``admitted``/``refused``/``cancelled`` per pool and
      tier; waits are only reported for requests that queued) and read ``depth_by_tier()`` at
      scrape time. Nothing here imports prometheus.
    * Reload: ``configure(settings)``; disabling releases every waiter. Shutdown: ``close()``.
    * Admission belongs after the quota reservation; a refusal raised here goes through the walk's
      ``except APIError`` branch, which refunds the reservation.

Settings (``[admission]`` in config.example.toml; ``AdmissionSettings`` mirrors them)::

    # Queue requests when no worker has room; false = send everything through (comparison runs).
    enabled = true
    # Queued requests per model, all tenants and priorities together; 0 = never queue.
    max_queued = 1024
    # Queued requests per tenant and model (429 beyond it); 0 = no fixed cap, a full queue is
    # shared by tenant weight instead.
    max_queued_per_tenant = 0
    # How long a request may wait for a worker when the client does not say.
    default_deadline_s = 10.0
    # Upper bound on a client's own deadline (header below, in milliseconds).
    max_deadline_s = 30.0
    deadline_header = "x-kvgate-deadline-ms"
    # Safety re-check while anything is queued (a kick can be missed; a waiter must not be).
    recheck_s = 0.05
    # Priority tiers: tier = round(priority * priority_levels); higher tiers always go first.
    priority_levels = 10
    # Memory of the service-rate estimate, in seconds of backlogged time.
    rate_half_life_s = 10.0
    # Queued admissions seen before predicted waits refuse requests early.
    min_rate_samples = 16
    # Retry-After bounds; the fallback is used while the service rate is unknown.
    fallback_retry_after_s = 1.0
    max_retry_after_s = 60.0

and per tenant (``[tenants.<name>]``)::

    # Share of the admission queue against other tenants of the same priority tier (> 0).
    queue_weight = 1.0
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from gateway.errors import APIError

__all__ = [
    "AdmissionController",
    "AdmissionObserver",
    "AdmissionSettings",
    "Admitted",
    "Entry",
    "FairQueue",
    "Pushed",
    "Reason",
    "Rejection",
    "State",
    "tier_of",
]

log = logging.getLogger("kvgate.admission")

ADMISSION_HEADER = "x-kvgate-admission"


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
        return self.count / self.time if self.time > 1e-9 and self.count > 0 else None


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
    def push(self, e: Entry, now: float) -> Pushed:
        if e.state is not State.NEW:
            raise ValueError(f"entry already {e.state.value}")
        if not (e.weight > 0 and math.isfinite(e.weight)):
            raise ValueError(f"weight must be finite and > 0, got {e.weight!r}")
        e.enqueued_at = now
        cap = self.max_queued_per_tenant
        if cap and self._per_tenant.get(e.tenant, 0) >= cap:
            return self._refuse(e, Reason.TENANT_LIMIT, 429, now)
        remaining = e.deadline - now
        wait = self.predicted_wait(e.tier, e.tenant, e.weight)
        if remaining <= 0 or (wait is not None and wait > remaining):
            status = 429 if self._over_share(e.tier, e.tenant, e.weight, 1) else 503
            return self._refuse(e, Reason.DEADLINE, status, now)
        shed: tuple[Entry, ...] = ()
        if self._size >= self.max_queued:
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
        return (ahead + 1) / rate

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


# -- the asyncio shell -----------------------------------------------------------------------------
@dataclass(slots=True)
class AdmissionSettings:
    """Mirrors ``[admission]``; see the module docstring for what each knob is for."""

    enabled: bool = True
    max_queued: int = 1024
    max_queued_per_tenant: int = 0
    default_deadline_s: float = 10.0
    max_deadline_s: float = 30.0
    deadline_header: str = "x-kvgate-deadline-ms"
    recheck_s: float = 0.05
    priority_levels: int = 10
    rate_half_life_s: float = 10.0
    min_rate_samples: int = 16
    fallback_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0

    def deadline_s(self, header_ms: str | None) -> float:
        """The client's deadline header, capped; a missing or unreadable one gets the default.

        0 is honoured: "do not queue me", refused at once when there is no room.
        """
        if header_ms is None:
            return self.default_deadline_s
        try:
            ms = float(header_ms)
        except ValueError:
            return self.default_deadline_s
        if not math.isfinite(ms):
            return self.default_deadline_s
        return min(max(ms / 1000.0, 0.0), self.max_deadline_s)


@dataclass(frozen=True, slots=True)
class Admitted:
    wait_s: float  # time spent queued
    queued: bool = False


_FAST = Admitted(0.0, False)


class AdmissionObserver(Protocol):
    """Metrics hook; every method is called on the event loop and must not block."""

    def admitted(self, pool: str, tier: int, wait_s: float) -> None: ...

    def refused(self, pool: str, tier: int, reason: str, status: int) -> None: ...

    def cancelled(self, pool: str, tier: int, wait_s: float) -> None: ...


class NullObserver:
    def admitted(self, pool: str, tier: int, wait_s: float) -> None:
        pass

    def refused(self, pool: str, tier: int, reason: str, status: int) -> None:
        pass

    def cancelled(self, pool: str, tier: int, wait_s: float) -> None:
        pass


@dataclass(slots=True)
class _Pool:
    name: str
    queue: FairQueue
    granted: int = 0  # waiters handed a slot that have not resumed (so in_flight lacks them)
    tiers: set[int] = field(default_factory=set)


_MESSAGES = {
    Reason.OVER_SHARE: (
        "The fleet is at capacity and this key already holds more than its share of the "
        "admission queue."
    ),
    Reason.QUEUE_FULL: "The fleet is at capacity and the admission queue is full.",
    Reason.SHED: (
        "The fleet is at capacity; this request was shed from the admission queue in favour of "
        "higher-priority traffic."
    ),
    Reason.DEADLINE: (
        "The fleet is at capacity and the predicted wait for a worker exceeds this request's "
        "deadline."
    ),
    Reason.EXPIRED: "No worker became free within this request's deadline.",
}

_CODES = {
    Reason.QUEUE_FULL: "queue_full",
    Reason.SHED: "queue_shed",
    Reason.DEADLINE: "queue_wait_exceeds_deadline",
    Reason.EXPIRED: "queue_timeout",
    Reason.CLOSED: "shutting_down",
}


class AdmissionController:
    """The asyncio shell over one ``FairQueue`` per pool; see the module docstring for wiring."""

    def __init__(
        self,
        settings: AdmissionSettings | None = None,
        *,
        observer: AdmissionObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or AdmissionSettings()
        self.observer: AdmissionObserver = observer or NullObserver()
        self._clock = clock
        self._pools: dict[str, _Pool] = {}
        self._closed: tuple[str, float] | None = None
        self._bypass = not self.settings.enabled  # disabled or closed: one check on the fast path
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def closed(self) -> bool:
        return self._closed is not None

    # -- the request path ------------------------------------------------------------------------
    async def admit(
        self,
        *,
        tenant: str,
        priority: float,
        weight: float = 1.0,
        deadline_s: float | None = None,
        has_room: Callable[[], int | bool],
        pool: str = "",
        cost: float = 1.0,
    ) -> Admitted:
        """Wait for room in ``pool``; raises ``APIError`` (429/503 + Retry-After) when refused."""
        if self._bypass:
            if self._closed is not None:
                raise self._closed_error()
            return _FAST
        p = self._pools.get(pool)
        if p is None:
            if has_room():
                return _FAST
        elif not p.queue._size and has_room() > p.granted:
            return _FAST
        return await self._wait(tenant, priority, weight, deadline_s, has_room, pool, cost)

    async def _wait(
        self,
        tenant: str,
        priority: float,
        weight: float,
        deadline_s: float | None,
        has_room: Callable[[], int | bool],
        pool: str,
        cost: float,
    ) -> Admitted:
        s = self.settings
        loop = self._loop = asyncio.get_running_loop()
        p = self._pools.get(pool)
        if p is None:
            p = self._pools[pool] = _Pool(pool, self._new_queue())
        now = self._clock()
        if deadline_s is None:
            deadline_s = s.default_deadline_s
        deadline_s = min(max(deadline_s, 0.0), s.max_deadline_s)
        fut: asyncio.Future[Admitted] = loop.create_future()
        e = Entry(
            tenant,
            tier_of(priority, s.priority_levels),
            weight,
            now + deadline_s,
            cost,
            payload=(fut, has_room),
        )
        pushed = p.queue.push(e, now)
        for v in pushed.shed:
            self._fail(p, v)
        if pushed.rejected is not None:
            self.observer.refused(
                pool, e.tier, pushed.rejected.reason.value, pushed.rejected.status
            )
            raise self._error(pushed.rejected, e)
        p.tiers.add(e.tier)
        self._kick_pool(p, now)
        if p.queue._size:
            self._arm()
        try:
            admitted = await fut
        except asyncio.CancelledError:
            self._abandon(p, e, fut)
            raise
        p.granted -= 1
        if p.queue._size:
            # This task now dispatches synchronously (in_flight grows); then the next may go.
            loop.call_soon(self._kick_pool, p)
        return admitted

    def _abandon(self, p: _Pool, e: Entry, fut: asyncio.Future[Admitted]) -> None:
        if e.state is State.QUEUED:
            p.queue.remove(e, self._clock())
            self.observer.cancelled(p.name, e.tier, e.wait_s)
        elif fut.done() and not fut.cancelled() and fut.exception() is None:
            # Granted, but the client left before using it: pass the slot on. (A refusal's
            # exception was retrieved by the check, so asyncio does not log it as lost.)
            p.granted -= 1
            self.observer.cancelled(p.name, e.tier, e.wait_s)
            if self._loop is not None and p.queue._size:
                self._loop.call_soon(self._kick_pool, p)

    # -- releasing waiters -----------------------------------------------------------------------
    def kick(self, pool: str | None = None) -> None:
        """Room may have appeared (a request finished, a scrape came in): admit what fits."""
        if pool is None:
            for p in self._pools.values():
                if p.queue._size:
                    self._kick_pool(p)
        else:
            p = self._pools.get(pool)
            if p is not None and p.queue._size:
                self._kick_pool(p)

    def _kick_pool(self, p: _Pool, now: float | None = None) -> None:
        q = p.queue
        if not q._size:
            return
        if now is None:
            now = self._clock()
        for e in q.expire(now):
            self._fail(p, e)
        while (e := q.peek()) is not None:
            fut, has_room = e.payload
            if fut.done():  # cancelled; its task has not run its handler yet
                q.remove(e, now)
                self.observer.cancelled(p.name, e.tier, e.wait_s)
                continue
            try:
                room = has_room()
            except Exception:  # no room: the waiter expires with a 503 instead of leaking a slot
                log.exception("admission has_room predicate failed")
                break
            if room <= p.granted:
                break
            q.pop(now)
            p.granted += 1
            fut.set_result(Admitted(e.wait_s, True))
            self.observer.admitted(p.name, e.tier, e.wait_s)

    def _fail(self, p: _Pool, e: Entry) -> None:
        rej = e.rejection
        assert rej is not None
        fut = e.payload[0]
        if not fut.done():
            fut.set_exception(self._error(rej, e))
        self.observer.refused(p.name, e.tier, rej.reason.value, rej.status)

    def _arm(self) -> None:
        if self._timer is None and self._loop is not None and self._closed is None:
            self._timer = self._loop.call_later(self._next_tick(), self._tick)

    def _next_tick(self) -> float:
        delay = self.settings.recheck_s
        now = self._clock()
        for p in self._pools.values():
            d = p.queue.next_deadline()
            if d is not None:
                delay = min(delay, max(0.0, d - now))
        return delay

    def _tick(self) -> None:
        self._timer = None
        try:
            for p in list(self._pools.values()):
                self._kick_pool(p)
        except Exception:  # a broken predicate must not stop the timer that ends every wait
            log.exception("admission re-check failed")
        finally:
            if any(p.queue._size for p in self._pools.values()):
                self._arm()

    # -- errors ----------------------------------------------------------------------------------
    def _error(self, rej: Rejection, e: Entry) -> APIError:
        headers = {ADMISSION_HEADER: rej.reason.value}
        if rej.reason is Reason.CLOSED:
            assert self._closed is not None
            return self._closed_error()
        if rej.reason is Reason.TENANT_LIMIT:
            msg = (
                "Too many requests from this key are already waiting for capacity (limit "
                f"{self.settings.max_queued_per_tenant})."
            )
        else:
            msg = _MESSAGES[rej.reason]
            if rej.reason in (Reason.DEADLINE, Reason.EXPIRED):
                msg += f" Deadline: {e.deadline - e.enqueued_at:.3f}s."
        msg += f" Please try again in {math.ceil(rej.retry_after_s)}s."
        if rej.status == 429:
            return APIError(
                429,
                msg,
                "requests",
                code="rate_limit_exceeded",
                retry_after_s=rej.retry_after_s,
                headers=headers,
            )
        return APIError(
            503,
            msg,
            "service_unavailable",
            code=_CODES[rej.reason],
            retry_after_s=rej.retry_after_s,
            headers=headers,
        )

    def _closed_error(self) -> APIError:
        assert self._closed is not None
        reason, retry = self._closed
        return APIError(
            503,
            reason,
            "service_unavailable",
            code=_CODES[Reason.CLOSED],
            retry_after_s=retry,
            headers={ADMISSION_HEADER: Reason.CLOSED.value},
        )

    # -- lifecycle -------------------------------------------------------------------------------
    def _new_queue(self) -> FairQueue:
        s = self.settings
        return FairQueue(
            max_queued=s.max_queued,
            max_queued_per_tenant=s.max_queued_per_tenant,
            rate_half_life_s=s.rate_half_life_s,
            min_rate_samples=s.min_rate_samples,
            fallback_retry_after_s=s.fallback_retry_after_s,
            max_retry_after_s=s.max_retry_after_s,
        )

    def configure(self, settings: AdmissionSettings) -> None:
        """Apply reloaded settings: bounds hold for new pushes; disabling releases every waiter."""
        self.settings = settings
        self._bypass = not settings.enabled or self._closed is not None
        for p in self._pools.values():
            q = p.queue
            q.max_queued = settings.max_queued
            q.max_queued_per_tenant = settings.max_queued_per_tenant
            q.min_rate_samples = settings.min_rate_samples
            q.fallback_retry_after_s = settings.fallback_retry_after_s
            q.max_retry_after_s = settings.max_retry_after_s
            q._rate.half_life = settings.rate_half_life_s
            if not settings.enabled:
                now = self._clock()
                while (e := q.peek()) is not None:
                    fut = e.payload[0]
                    if fut.done():
                        q.remove(e, now)
                        continue
                    q.pop(now)
                    p.granted += 1
                    fut.set_result(Admitted(e.wait_s, True))
                    self.observer.admitted(p.name, e.tier, e.wait_s)

    def close(
        self, reason: str = "The gateway is shutting down.", retry_after_s: float = 5.0
    ) -> None:
        """Refuse every waiter and every later admit with 503 (graceful shutdown)."""
        self._closed = (reason, retry_after_s)
        self._bypass = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self._clock()
        for p in self._pools.values():
            for e in p.queue.drain(retry_after_s, now):
                self._fail(p, e)

    # -- stats -----------------------------------------------------------------------------------
    def depth_by_tier(self, pool: str | None = None) -> dict[int, int]:
        """Queued requests per tier (all pools unless one is named); tiers seen so far report 0
        so a gauge falls back to zero instead of keeping its last value."""
        out: dict[int, int] = {}
        if pool is None:
            pools = list(self._pools.values())
        else:
            pools = [self._pools[pool]] if pool in self._pools else []
        for p in pools:
            for level in p.tiers:
                out.setdefault(level, 0)
            for level, n in p.queue.depth_by_tier().items():
                out[level] = out.get(level, 0) + n
        return out

    def queued(self) -> int:
        return sum(p.queue._size for p in self._pools.values())

    def pools(self) -> list[str]:
        """Pools (models) that ever queued, for per-model gauges."""
        return list(self._pools)

    def pool_queue(self, pool: str = "") -> FairQueue | None:
        """The core of one pool (tests, debugging)."""
        p = self._pools.get(pool)
        return p.queue if p is not None else None
