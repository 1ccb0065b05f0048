"""The admission queue: what a request does when no worker has room for it.

Overload must be boring: a spike is answered by a bounded wait with a
deadline, served by tenant priority and fairly within a priority, and whoever cannot be served in
time gets an OpenAI-shaped 429 or 503 with ``Retry-After`` at once rather than a hung socket. The
queue never admits beyond the room the caller reports, so queueing adds latency to low-priority
traffic instead of adding load to the fleet.

Two layers, per the project's "pure cores, thin shells":

``FairQueue`` (``gateway.fair_queue``: pure, no asyncio, no clock: every call takes ``now``)
    Strict priority between tiers, weighted fair queueing between the tenants of a tier, bounded
    with shedding of the heaviest tenant's newest entry, per-entry deadlines, and a service-rate
    prediction of the wait that refuses hopeless newcomers early and sets every ``Retry-After``.
    See that module for the rules.

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
      before ``proxy.forward()`` (synchronous up to ``Lifecycle.dispatched``), or a slot can be
      given twice. With a bool predicate, waiters are released one per event-loop turn (safe).
      Those grants are counted across all pools, not per pool: pools can share workers (a base
      model and its LoRA adapters are models served by the same worker), and a per-pool count
      gave one free slot once per pool. Counting is not enough when one pool's workers are a
      subset of another's (an adapter on some of its base model's workers, a retry's untried
      workers): the proxy picks any worker with room, so a grant or a no-wait admission in the
      wider pool can take the very slot a pending grant of the narrower one counts on. So a
      pool grants while another pool's grants are pending only if each of those still finds
      more room than there are pending grants (their predicates are asked again). A pool held
      back by another pool's grants is kicked again as soon as they are used (the next loop
      turn), so disjoint pools lose nothing.
    * ``has_room`` must report the same room for every waiter of a tier in a pool (the kick stops
      at the first head without room): gateway/slots.py decides the priority reserve by tier.
      A retry counts only the workers it has not tried, so retries wait in queues of their own,
      one per model and set of tried workers (``admit(tried=...)``); ``max_queued`` and
      ``max_queued_per_tenant`` bound a model's queues together. A negative room means that
      none of the workers a waiter may use serves its model any more: it is refused at once
      (503) instead of waiting out its deadline.
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
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import APIError, no_capacity
from gateway.fair_queue import Entry, FairQueue, Pushed, Reason, Rejection, State, tier_of

__all__ = [
    "AdmissionController",
    "AdmissionObserver",
    "AdmissionSettings",
    "Admitted",
]

log = logging.getLogger("kvgate.admission")

ADMISSION_HEADER = "x-kvgate-admission"


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
        """The client's deadline header, capped; a missing or unreadable one (or NaN) gets the
        default.

        0 is honoured: "do not queue me", refused at once when there is no room.
        """
        if header_ms is None:
            return self.default_deadline_s
        try:
            ms = float(header_ms)
        except ValueError:
            return self.default_deadline_s
        if math.isnan(ms):
            return self.default_deadline_s
        # +-inf (also what "1e400" parses to) is the far end of the scale like any huge value:
        # "999999" got the cap and "1e400" the (shorter) default.
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
    tiers: set[int] = field(default_factory=set)
    held: bool = False  # its head had room that pending grants (any pool's) held back
    retry: bool = False  # a queue of retries (``AdmissionController._retries``)
    granted: int = 0  # its grants whose waiters have not resumed yet
    # Per tier of those grants: how many, and one waiter's room predicate (a tier's agree), which
    # other pools ask before granting (``AdmissionController._others_fit``).
    grants: dict[int, tuple[int, Callable[[], int | bool]]] = field(default_factory=dict)


_NO_RETRIES: dict[frozenset[str], _Pool] = {}  # a model with no retry waiting (never written)


def _none_left(model: str) -> APIError:
    """A waiting retry whose untried workers have all stopped serving its model (drained,
    removed, unhealthy) while one it tried still does: it waited out its whole deadline, then
    read "no worker became free", and held up the retries behind it (review)."""
    return no_capacity(f"no worker this request has not tried is serving model `{model}` now")


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
        # Retries waiting for room on workers they have not tried, per model and tried set:
        # queues of their own, since their room is not their tier's (``has_room`` must agree
        # within a queue: a retry at the head of its model's queue held up every new request
        # behind it while the worker it had tried sat idle, and one retry waiting for a full
        # worker held up another whose own untried worker was free). Named, observed and
        # refused as the model's pool; a queue that empties is dropped (``_prune``).
        self._retries: dict[str, dict[frozenset[str], _Pool]] = {}
        # Waiters handed a slot that have not resumed (so in_flight lacks them), in every pool:
        # pools share workers, so one pool's pending grant may take the slot another pool sees.
        self._granted = 0
        self._granting: list[_Pool] = []  # the pools with such grants (``_Pool.granted``)
        self._held: list[_Pool] = []  # pools to kick again once pending grants are used
        self._closed: tuple[str, float] | None = None
        self._bypass = not self.settings.enabled  # disabled or closed: one check on the fast path
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0  # when it is due, on the loop's clock

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
        tried: frozenset[str] = frozenset(),
    ) -> Admitted:
        """Wait for room in ``pool``; raises ``APIError`` (429/503 + Retry-After) when refused.
        ``tried``: a retry's wait, whose ``has_room`` counts only the workers it has not tried
        (a queue of its own, ``_retries``)."""
        if self._bypass:
            if self._closed is not None:
                raise self._closed_error()
            return _FAST
        p = self._retries.get(pool, _NO_RETRIES).get(tried) if tried else self._pools.get(pool)
        if (
            (p is None or not p.queue._size)
            and has_room() > self._granted
            # Pending grants all this pool's (or none): the count is enough; else theirs too.
            and (self._granted == (p.granted if p is not None else 0) or self._others_fit(p))
        ):
            return _FAST
        return await self._wait(tenant, priority, weight, deadline_s, has_room, pool, cost, tried)

    async def _wait(
        self,
        tenant: str,
        priority: float,
        weight: float,
        deadline_s: float | None,
        has_room: Callable[[], int | bool],
        pool: str,
        cost: float,
        tried: frozenset[str],
    ) -> Admitted:
        s = self.settings
        loop = self._loop = asyncio.get_running_loop()
        if tried:
            by_tried = self._retries.setdefault(pool, {})
            p = by_tried.get(tried)
            if p is None:
                p = by_tried[tried] = _Pool(pool, self._new_queue(), retry=True)
        else:
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
            priority=priority,
        )
        pushed = self._push(p, e, now)
        for v in pushed.shed:
            self._fail(p, v)
        if pushed.rejected is not None:
            self.observer.refused(
                pool, e.tier, pushed.rejected.reason.value, pushed.rejected.status
            )
            self._prune(p)
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
        finally:
            self._prune(p)
        # This task now dispatches synchronously (in_flight grows); then the next may go.
        self._grant_done(p, e)
        return admitted

    def _push(self, p: _Pool, e: Entry, now: float) -> Pushed:
        """Queue ``e`` in ``p`` within the bounds of its model's queues together (its own and
        its retries'): each is a ``FairQueue`` with bounds of its own, and the model's total
        reached ``max_queued`` once per set of tried workers (review: 4 queued with 1 allowed).
        A full model sheds a lower tier's newest entry from whichever of its queues holds the
        lowest tier, as one queue would."""
        q = p.queue
        if not p.retry and p.name not in self._retries:  # the common case: the model's one queue
            return q.push(e, now)
        others = [o for o in self._named(p.name) if o is not p and len(o.queue)]
        if not others:
            return q.push(e, now)
        s = self.settings
        n_other = sum(len(o.queue) for o in others)
        cap = s.max_queued_per_tenant
        if cap:
            mine = sum(o.queue.depth_of(e.tenant) for o in others)
            if mine >= cap:
                return q.refuse(e, Reason.TENANT_LIMIT, 429, now)
            cap -= mine
        # Another queue's lowest tier, if below both the newcomer's and this queue's: shed there.
        lowest = min(q.depth_by_tier(), default=e.tier)
        victim: _Pool | None = None
        for o in others:
            low = min(o.queue.depth_by_tier())
            if low < min(lowest, e.tier):
                victim, lowest = o, low
        room = max(s.max_queued - n_other + (victim is not None), 0)
        pushed = q.push(e, now, max_queued=room, max_queued_per_tenant=cap)
        if victim is not None and pushed.rejected is None and len(q) + n_other > s.max_queued:
            self._fail(victim, victim.queue.shed_for(e, now))
            self._prune(victim)
        return pushed

    def _abandon(self, p: _Pool, e: Entry, fut: asyncio.Future[Admitted]) -> None:
        if e.state is State.QUEUED:
            p.queue.remove(e, self._clock())
            self.observer.cancelled(p.name, e.tier, e.wait_s)
        elif fut.done() and not fut.cancelled() and fut.exception() is None:
            # Granted, but the client left before using it: pass the slot on. (A refusal's
            # exception was retrieved by the check, so asyncio does not log it as lost.)
            self.observer.cancelled(p.name, e.tier, e.wait_s)
            self._grant_done(p, e)

    def _prune(self, p: _Pool) -> None:
        """Drop an emptied retry queue: one is made per set of tried workers, and kept they
        would pile up (every re-check walks them all). A grant it holds keeps it in ``_held``
        until used; a later retry with the same set makes a new one."""
        if p.retry and not p.queue._size and not p.held:
            by_tried = self._retries.get(p.name)
            if by_tried is not None:
                for k, q in list(by_tried.items()):
                    if q is p:
                        del by_tried[k]
                if not by_tried:
                    del self._retries[p.name]

    def _grant(self, p: _Pool, e: Entry) -> None:
        """``e``, just popped from ``p``, holds a slot until its waiter resumes."""
        self._granted += 1
        if not p.granted:
            self._granting.append(p)
        p.granted += 1
        n, room = p.grants.get(e.tier, (0, e.payload[1]))
        p.grants[e.tier] = (n + 1, room)
        e.payload[0].set_result(Admitted(e.wait_s, True))
        self.observer.admitted(p.name, e.tier, e.wait_s)

    def _grant_done(self, p: _Pool, e: Entry) -> None:
        """A grant was used (in_flight has it now) or given back: the room it held is either
        taken or free again, so ``p`` and every pool it held back look again, after the
        dispatch."""
        self._granted -= 1
        p.granted -= 1
        if not p.granted:
            self._granting.remove(p)
        n, room = p.grants[e.tier]  # a granted entry is no longer retiered: its tier is kept
        if n > 1:
            p.grants[e.tier] = (n - 1, room)
        else:
            del p.grants[e.tier]
        loop = self._loop
        if loop is None:
            return
        if self._held:  # first: they were passed over while the grant held their room
            loop.call_soon(self._kick_held)
        if p.queue._size:
            loop.call_soon(self._kick_pool, p)

    def _others_fit(self, p: _Pool | None) -> bool:
        """Whether one more admission in ``p`` leaves every other pool's pending grants their
        slot: each must still see more room than there are pending grants, since the newcomer
        may take a slot in its workers (``p``'s own are covered by its count: same workers).
        Asked only while another pool's grants are pending, i.e. for a loop turn or so."""
        g = self._granted
        try:
            for o in self._granting:
                if o is not p:
                    for _, room in o.grants.values():
                        if room() <= g:
                            return False
        except Exception:  # held back until those grants are used, rather than over-admitted
            log.exception("admission has_room predicate failed")
            return False
        return True

    def _kick_held(self) -> None:
        held, self._held = self._held, []
        for p in held:
            p.held = False
        for p in self._by_priority(held):
            self._kick_pool(p)
        for p in held:
            self._prune(p)

    # -- releasing waiters -----------------------------------------------------------------------
    def kick(self, pool: str | Collection[str] | None = None) -> None:
        """Room may have appeared (a request finished, a scrape came in): admit what fits, in
        ``pool``, in several (the models one worker serves) or in all."""
        if isinstance(pool, str):
            r = self._retries.get(pool) if self._retries else None
            if r:
                for p in self._by_priority((*r.values(), self._pools.get(pool))):
                    self._kick_pool(p)
                return
            p = self._pools.get(pool)
            if p is not None and p.queue._size:
                self._kick_pool(p)
            return
        if pool is None:
            pools: Iterable[_Pool | None] = self._all()
        else:
            names = list(pool)
            pools = [
                *(q for n in names for q in self._retries.get(n, {}).values()),
                *map(self._pools.get, names),
            ]
        for p in self._by_priority(pools):
            self._kick_pool(p)

    def _all(self) -> list[_Pool]:
        """Every queue, retries' first: at the same tier a retry, which waited before, takes
        the room of a worker it has not tried ahead of new requests (kicked after, they had it
        every time, and under steady load a retry waited out its deadline). The sort by tier
        (`_by_priority`) is stable."""
        return [*(q for r in self._retries.values() for q in r.values()), *self._pools.values()]

    def _named(self, pool: str) -> list[_Pool]:
        """The queues of one model: its own and its retries'."""
        own = self._pools.get(pool)
        return [*([own] if own is not None else []), *self._retries.get(pool, {}).values()]

    @staticmethod
    def _by_priority(pools: Iterable[_Pool | None]) -> list[_Pool]:
        """Pools with waiters, the highest waiting tier first: pools sharing workers (a base
        model and its adapters) compete for the same free slot, and strict priority holds only
        inside one queue, so the order of the pools must follow it too (review: a 0.1 adapter
        request took the slot ahead of a 0.9 base-model one, by dict or frozenset order)."""
        busy = [p for p in pools if p is not None and p.queue._size]
        if len(busy) > 1:
            busy.sort(key=lambda p: -p.queue.top_tier())
        return busy

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
            if room < 0:  # none of the workers it may use serves the model now: refused
                q.remove(e, now)
                fut.set_exception(_none_left(p.name))
                self.observer.refused(p.name, e.tier, "no_capacity", 503)
                continue
            if room <= self._granted or (self._granted != p.granted and not self._others_fit(p)):
                if room and not p.held:  # room, but pending grants may take it: look again
                    p.held = True
                    self._held.append(p)
                break
            q.pop(now)
            self._grant(p, e)

    def _fail(self, p: _Pool, e: Entry) -> None:
        rej = e.rejection
        assert rej is not None
        fut = e.payload[0]
        if not fut.done():
            fut.set_exception(self._error(rej, e))
        self.observer.refused(p.name, e.tier, rej.reason.value, rej.status)

    def _arm(self) -> None:
        """The recheck timer, due at the earliest queued deadline (or ``recheck_s``): set again
        when a newcomer's deadline comes before it, or that waiter would be refused only when a
        timer armed for a later one fired (up to ``recheck_s`` late)."""
        loop = self._loop
        if loop is None or self._closed is not None:
            return
        delay = self._next_tick()
        due = loop.time() + delay
        if self._timer is not None:
            # Its due time as noted: uvloop's call_later(0) returns a plain Handle (no `when`).
            if self._timer_at <= due + 1e-3:
                return
            self._timer.cancel()
        self._timer = loop.call_later(delay, self._tick)
        self._timer_at = due

    def _next_tick(self) -> float:
        delay = self.settings.recheck_s
        now = self._clock()
        for p in self._all():
            d = p.queue.next_deadline()
            if d is not None:
                delay = min(delay, max(0.0, d - now))
        return delay

    def _tick(self) -> None:
        self._timer = None
        try:
            for p in self._by_priority(self._all()):
                self._kick_pool(p)
        except Exception:  # a broken predicate must not stop the timer that ends every wait
            log.exception("admission re-check failed")
        finally:
            if any(p.queue._size for p in self._all()):
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
        """Apply reloaded settings: bounds hold for new pushes; disabling releases every waiter;
        new priority levels move every waiter to its tier on the new scale."""
        levels = self.settings.priority_levels
        self.settings = settings

        def retier(e: Entry) -> int:
            return tier_of(e.priority, settings.priority_levels)

        self._bypass = not settings.enabled or self._closed is not None
        for p in self._all():
            q = p.queue
            q.max_queued = settings.max_queued
            q.max_queued_per_tenant = settings.max_queued_per_tenant
            q.min_rate_samples = settings.min_rate_samples
            q.fallback_retry_after_s = settings.fallback_retry_after_s
            q.max_retry_after_s = settings.max_retry_after_s
            q._rate.half_life = settings.rate_half_life_s
            if settings.priority_levels != levels and q._size:
                q.retier(retier, self._clock())
                p.tiers.update(q.depth_by_tier())
            if not settings.enabled:
                now = self._clock()
                while (e := q.peek()) is not None:
                    fut = e.payload[0]
                    if fut.done():
                        q.remove(e, now)
                        continue
                    q.pop(now)
                    self._grant(p, e)

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
        for p in self._all():
            for e in p.queue.drain(retry_after_s, now):
                self._fail(p, e)

    def fail_pool(self, pool: str, error: Callable[[], APIError]) -> int:
        """Refuse every waiter of ``pool`` now with ``error()``: no worker is left to serve it
        (the last one went unhealthy, or stopped listing the model). A new request for it gets
        that 503 (or 404) at once; a queued one waited out its whole deadline instead, then read
        "no worker became free" with a Retry-After of 1 s (review: 20 s for a model down since
        the first 0.3 s). Counted as ``no_capacity``, or ``model_not_found`` for a 404. Returns
        how many were refused."""
        n = 0
        for p in self._named(pool):
            entries = p.queue.drain(0.0, self._clock()) if p.queue._size else []
            self._prune(p)
            for e in entries:
                err = error()
                fut = e.payload[0]
                if not fut.done():
                    fut.set_exception(err)
                reason = "model_not_found" if err.status == 404 else "no_capacity"
                self.observer.refused(p.name, e.tier, reason, err.status)
            n += len(entries)
        return n

    # -- stats -----------------------------------------------------------------------------------
    def depth_by_tier(self, pool: str | None = None) -> dict[int, int]:
        """Queued requests per tier (all pools unless one is named); tiers seen so far report 0
        so a gauge falls back to zero instead of keeping its last value."""
        out: dict[int, int] = {}
        for p in self._all() if pool is None else self._named(pool):
            for level in p.tiers:
                out.setdefault(level, 0)
            for level, n in p.queue.depth_by_tier().items():
                out[level] = out.get(level, 0) + n
        return out

    def queued(self) -> int:
        return sum(p.queue._size for p in self._all())

    def pools(self) -> list[str]:
        """Pools (models) that ever queued, for per-model gauges."""
        return list(dict.fromkeys([*self._pools, *self._retries]))

    def forget_pool(self, pool: str) -> bool:
        """Drop an idle pool (its model left the fleet), so its gauges go with it; a pool that
        still queues requests stays until they are served or refused. True when dropped."""
        named = self._named(pool)
        if not named or any(p.queue._size or p in self._held for p in named):
            return False
        self._pools.pop(pool, None)
        self._retries.pop(pool, None)
        return True

    def pool_queue(self, pool: str = "") -> FairQueue | None:
        """The core of one pool (tests, debugging)."""
        p = self._pools.get(pool)
        return p.queue if p is not None else None
