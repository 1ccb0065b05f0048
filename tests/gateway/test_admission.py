"""The admission queue: the pure core with explicit clocks, the asyncio shell on a real loop.

Shell tests assert order and outcomes, never tight timings: deadlines are generous and every wait is
bounded by `asyncio.wait_for`, so a slow CI box makes them slower, not flaky.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission import (
    ADMISSION_HEADER,
    AdmissionController,
    AdmissionSettings,
    Admitted,
)
from gateway.errors import APIError
from gateway.fair_queue import Entry, FairQueue, Reason, State, tier_of

TERMINAL = {
    State.ADMITTED,
    State.REJECTED,
    State.SHED,
    State.EXPIRED,
    State.CANCELLED,
    State.CLOSED,
}


def fq(**kw: int | float) -> FairQueue:
    kw.setdefault("max_queued", 10_000)
    return FairQueue(**kw)  # type: ignore[arg-type]


def push(
    q: FairQueue,
    tenant: str,
    *,
    tier: int = 5,
    weight: float = 1.0,
    deadline: float = 1e9,
    now: float = 0.0,
) -> Entry:
    e = Entry(tenant, tier, weight, deadline)
    q.push(e, now)
    return e


def drain_order(q: FairQueue, n: int, now: float = 0.0) -> list[str]:
    out = []
    for _ in range(n):
        e = q.pop(now)
        assert e is not None
        out.append(e.tenant)
    return out


# -- the core: order -------------------------------------------------------------------------------
def test_tier_of_buckets_priority_half_up_and_clamps() -> None:
    assert [tier_of(p) for p in (0.0, 0.04, 0.05, 0.25, 0.5, 0.95, 1.0)] == [0, 0, 1, 3, 5, 10, 10]
    assert tier_of(-1.0) == 0 and tier_of(float("nan")) == 0 and tier_of(7.0) == 10
    assert tier_of(0.5, levels=2) == 1


def test_higher_tier_goes_first_and_fifo_within_a_tenant() -> None:
    q = fq()
    lo = [push(q, "a", tier=1) for _ in range(3)]
    hi = [push(q, "b", tier=9) for _ in range(2)]
    mid = push(q, "c", tier=5)
    got = [q.pop(1.0) for _ in range(6)]
    assert got == [*hi, mid, *lo]
    assert q.pop(1.0) is None and len(q) == 0
    assert all(e.state is State.ADMITTED and e.wait_s == 1.0 for e in got)
    q.check()


def test_equal_weights_alternate_under_a_burst_from_one_tenant() -> None:
    q = fq()
    for _ in range(1000):
        push(q, "burst")
    for _ in range(10):
        push(q, "quiet")
    order = drain_order(q, 20)
    assert Counter(order) == {"burst": 10, "quiet": 10}
    for i in range(0, 20, 2):  # strictly alternating pairs
        assert set(order[i : i + 2]) == {"burst", "quiet"}
    q.check()


def test_a_newcomer_is_not_queued_behind_a_burst() -> None:
    q = fq()
    for _ in range(1000):
        push(q, "burst")
    drain_order(q, 100)  # the burst is being served ...
    push(q, "quiet")  # ... when another tenant arrives: it goes next (or right after one)
    assert "quiet" in drain_order(q, 2)


def test_weights_3_to_1_admit_3_to_1() -> None:
    q = fq()
    for _ in range(300):
        push(q, "gold", weight=3.0)
        push(q, "bronze", weight=1.0)
    order = drain_order(q, 200)
    c = Counter(order)
    assert c["gold"] == 150 and c["bronze"] == 50
    for k in range(4, 201, 4):  # every prefix stays within one entry of 3:1
        assert abs(Counter(order[:k])["gold"] - 3 * k / 4) <= 1.5


def test_a_trickling_light_tenant_does_not_get_more_than_its_weight() -> None:
    """A tenant that keeps one entry queued keeps its finish tag across the moments it is idle;
    otherwise re-queueing after each admission would earn it a fresh start every time."""
    q = fq()
    for _ in range(400):
        push(q, "gold", weight=3.0)
    push(q, "bronze", weight=1.0)
    order = []
    for _ in range(200):
        e = q.pop(0.0)
        assert e is not None
        order.append(e.tenant)
        if e.tenant == "bronze":
            push(q, "bronze", weight=1.0)
    assert Counter(order)["bronze"] == 50


def test_removing_a_head_does_not_cost_its_tenant_a_turn() -> None:
    q = fq()
    a = [push(q, "a") for _ in range(5)]
    for _ in range(5):
        push(q, "b")
    assert q.remove(a[0], 0.0) and not q.remove(a[0], 0.0)
    assert a[0].state is State.CANCELLED
    assert sorted(drain_order(q, 2)) == ["a", "b"]
    q.check()


# -- the core: bounds ------------------------------------------------------------------------------
def test_fixed_per_tenant_cap_refuses_that_tenant_with_429_while_others_queue() -> None:
    q = fq(max_queued=100, max_queued_per_tenant=3)
    for _ in range(3):
        push(q, "a")
    e = Entry("a", 5, 1.0, 1e9)
    r = q.push(e, 0.0)
    assert r.rejected is not None and r.rejected.reason is Reason.TENANT_LIMIT
    assert r.rejected.status == 429 and e.state is State.REJECTED
    b = push(q, "b")
    assert b.state is State.QUEUED and q.depth_of("a") == 3
    q.check()


def test_full_queue_is_shared_by_weight_within_a_tier() -> None:
    q = fq(max_queued=10)
    a = [push(q, "a") for _ in range(10)]  # alone, a may use the whole queue
    b1 = Entry("b", 5, 1.0, 1e9)
    r = q.push(b1, 0.0)
    # b is under its share: a's newest is pushed out, with a 429 because a holds too much.
    assert r.rejected is None and r.shed == (a[-1],)
    assert a[-1].state is State.SHED and a[-1].rejection is not None
    assert a[-1].rejection.reason is Reason.OVER_SHARE and a[-1].rejection.status == 429
    # a asking for more is refused with 429 ...
    again = Entry("a", 5, 1.0, 1e9)
    r = q.push(again, 0.0)
    assert r.rejected is not None and r.rejected.reason is Reason.OVER_SHARE
    assert r.rejected.status == 429 and r.rejected.retry_after_s >= 1.0
    # ... while b keeps getting in until the two hold equal shares.
    for _ in range(4):
        assert push(q, "b").state is State.QUEUED
    assert q.depth_of("a") == q.depth_of("b") == 5
    r = q.push(Entry("b", 5, 1.0, 1e9), 0.0)
    assert r.rejected is not None and r.rejected.status == 429
    # A third tenant is under its share too: it displaces the newest of the heaviest (a tie:
    # b's, the newer).
    r = q.push(Entry("c", 5, 1.0, 1e9), 0.0)
    assert r.rejected is None and [v.tenant for v in r.shed] == ["b"]
    q.check()


def test_a_full_queue_where_everyone_holds_its_share_is_503_for_a_newcomer() -> None:
    q = fq(max_queued=4)
    for t in "abcd":
        push(q, t)
    r = q.push(Entry("e", 5, 1.0, 1e9), 0.0)
    assert r.rejected is not None and r.rejected.reason is Reason.QUEUE_FULL
    assert r.rejected.status == 503


def test_weighted_shares_of_a_full_queue() -> None:
    q = fq(max_queued=8)
    for _ in range(8):
        push(q, "bronze", weight=1.0)
    while q.push(Entry("gold", 5, 3.0, 1e9), 0.0).rejected is None:
        pass
    assert q.depth_of("gold") == 6 and q.depth_of("bronze") == 2


def test_higher_tier_sheds_the_lowest_tier_newest_first() -> None:
    q = fq(max_queued=4)
    low = [push(q, "a", tier=1), push(q, "a", tier=1)]
    mid = [push(q, "b", tier=5), push(q, "b", tier=5)]
    shed: list[Entry] = []
    for _ in range(3):
        r = q.push(Entry("c", 9, 1.0, 1e9), 0.0)
        assert r.rejected is None
        shed.extend(r.shed)
    assert shed == [low[1], low[0], mid[1]]
    for e in shed:
        assert e.state is State.SHED and e.rejection is not None
        assert e.rejection.reason is Reason.SHED and e.rejection.status == 503
    # Only the lowest tier is shed, and not for an equal or lower newcomer.
    r = q.push(Entry("d", 1, 1.0, 1e9), 0.0)
    assert r.rejected is not None and r.rejected.reason is Reason.QUEUE_FULL
    assert r.rejected.status == 503 and mid[0].state is State.QUEUED
    q.check()


def test_shedding_within_the_lowest_tier_hits_the_heaviest_tenant() -> None:
    q = fq(max_queued=4)
    a = [push(q, "a", tier=1) for _ in range(3)]
    b = push(q, "b", tier=1)  # newest, but b holds one entry against a's three
    r = q.push(Entry("vip", 9, 1.0, 1e9), 0.0)
    assert r.shed == (a[-1],) and b.state is State.QUEUED


def test_bounds_kept_outside_the_queue_narrow_a_push_refuse_and_shed() -> None:
    """A queue sharing its bounds with others (a model's retry queues) is pushed with the room
    the others leave, refuses for them, and sheds a lower tier for a newcomer queued elsewhere."""
    q = fq(max_queued=10, max_queued_per_tenant=10)
    low = [push(q, "a", tier=1), push(q, "a", tier=1)]
    r = q.push(Entry("b", 5, 1.0, 1e9), 0.0, max_queued=2)  # full at 2: a lower tier is shed
    assert r.rejected is None and r.shed == (low[1],)
    r = q.push(Entry("b", 5, 1.0, 1e9), 0.0, max_queued_per_tenant=1)
    assert r.rejected is not None and r.rejected.reason is Reason.TENANT_LIMIT
    assert q.max_queued == 10 and q.max_queued_per_tenant == 10  # the queue's own are kept
    e = Entry("c", 5, 1.0, 1e9)
    r = q.refuse(e, Reason.TENANT_LIMIT, 429, 0.0)
    assert e.state is State.REJECTED and r.rejected is not None and r.rejected.status == 429
    assert q.shed_for(Entry("c", 9, 1.0, 1e9), 0.0) is low[0]
    assert low[0].state is State.SHED and low[0].rejection is not None
    with pytest.raises(ValueError):  # only tier 5 is left: nothing below a tier-5 newcomer
        q.shed_for(Entry("c", 5, 1.0, 1e9), 0.0)
    q.check()


def test_zero_max_queued_refuses_everything_with_503() -> None:
    q = fq(max_queued=0)
    r = q.push(Entry("a", 10, 1.0, 1e9), 0.0)
    assert r.rejected is not None and r.rejected.status == 503


# -- the core: deadlines and predicted waits -------------------------------------------------------
def test_expire_removes_only_the_overdue() -> None:
    q = fq()
    e1 = push(q, "a", deadline=5.0)
    e2 = push(q, "b", deadline=10.0)
    assert q.next_deadline() == 5.0
    assert q.expire(4.9) == []
    out = q.expire(5.0)
    assert out == [e1] and e1.state is State.EXPIRED and e1.wait_s == 5.0
    assert e1.rejection is not None and e1.rejection.reason is Reason.EXPIRED
    assert e1.rejection.status == 503  # two tenants, one entry each: nobody is over its share
    assert q.next_deadline() == 10.0 and e2.state is State.QUEUED
    q.check()


def test_expiry_of_the_tenant_that_holds_the_queue_is_its_own_429() -> None:
    q = fq()
    heavy = [push(q, "heavy", deadline=5.0) for _ in range(5)]
    push(q, "light", deadline=50.0)
    out = q.expire(6.0)
    assert out[0] is heavy[0] and out[0].rejection is not None
    assert out[0].rejection.status == 429


def test_a_push_past_its_deadline_is_refused() -> None:
    q = fq()
    r = q.push(Entry("a", 5, 1.0, deadline=10.0), now=10.0)
    assert r.rejected is not None and r.rejected.reason is Reason.DEADLINE
    assert r.rejected.status == 503


def _learn_rate(q: FairQueue, per_s: float, n: int) -> float:
    """Serve n entries at `per_s` while a backlog stands; returns the clock after."""
    now = 0.0
    for _ in range(n):
        push(q, "warmup", now=now)
    for _ in range(n):
        now += 1.0 / per_s
        assert q.pop(now) is not None
    return now


def test_service_rate_is_learned_only_from_backlogged_time() -> None:
    q = fq(min_rate_samples=5)
    assert q.service_rate() is None
    now = _learn_rate(q, 10.0, 20)
    assert q.service_rate() == pytest.approx(10.0)
    # An idle hour (empty queue) does not dilute it.
    now += 3600.0
    push(q, "a", now=now)
    assert q.pop(now + 0.1) is not None
    assert q.service_rate() == pytest.approx(10.0)


def test_a_stall_does_not_lock_the_queue_out() -> None:
    # Review finding: after a stall (waits timing out, nothing served) the learned rate made
    # even an empty queue predict more than a 10 s deadline, so every newcomer was refused at
    # push, nothing queued again and the estimate never moved: no queue until a restart.
    q = fq(min_rate_samples=5)
    now = _learn_rate(q, 10.0, 20)
    for _ in range(8):  # 80 s in which every wait times out
        e = push(q, "a", deadline=now + 10.0, now=now)
        assert e.state is State.QUEUED, "an empty queue refused a newcomer on a stale estimate"
        now += 10.01
        assert [e.rejection.reason for e in q.expire(now)] == [Reason.EXPIRED]
    rate = q.service_rate()
    assert rate is not None and 2 / rate > 10.0  # one ahead would now be "too long"
    # Nobody ahead: the newcomer queues, whatever the stale rate says ...
    head = push(q, "a", deadline=now + 10.0, now=now)
    assert head.state is State.QUEUED
    # ... one behind it is refused on the estimate (503, a Retry-After) ...
    behind = push(q, "b", deadline=now + 10.0, now=now)
    assert behind.rejection is not None and behind.rejection.reason is Reason.DEADLINE
    # ... and served requests teach it the fleet is back: soon a queue forms again.
    for _ in range(10):
        now += 0.01
        assert q.pop(now) is head
        head = push(q, "a", deadline=now + 10.0, now=now)
    assert push(q, "b", deadline=now + 10.0, now=now).state is State.QUEUED


def test_predicted_wait_beyond_the_deadline_is_refused_at_once() -> None:
    q = fq(min_rate_samples=5)
    now = _learn_rate(q, 10.0, 20)  # 10 admissions / s
    for _ in range(30):
        push(q, "a", now=now)  # 3 s of backlog in tier 5
    # Same tier, another tenant: fair share puts it near the front (~0.2 s).
    near = q.predicted_wait(5, "b")
    assert near is not None and near == pytest.approx(0.2)
    # Tenant a's next entry waits behind a's own 30: 3.1 s.
    own = q.predicted_wait(5, "a")
    assert own == pytest.approx(3.1)
    # Lower tier: behind everything.
    assert q.predicted_wait(1, "c") == pytest.approx(3.1)
    e = Entry("a", 5, 1.0, deadline=now + 2.0)
    r = q.push(e, now)
    assert r.rejected is not None and r.rejected.reason is Reason.DEADLINE
    assert r.rejected.status == 503  # alone in its tier: the fleet is the bottleneck
    assert r.rejected.retry_after_s == pytest.approx(3.1)
    assert push(q, "b", deadline=now + 2.0, now=now).state is State.QUEUED
    assert push(q, "a", deadline=now + 5.0, now=now).state is State.QUEUED
    q.check()


def test_retry_after_is_capped() -> None:
    q = fq(min_rate_samples=5, max_retry_after_s=2.0)
    now = _learn_rate(q, 10.0, 20)
    for _ in range(100):
        push(q, "a", now=now)
    r = q.push(Entry("a", 5, 1.0, deadline=now + 1.0), now)
    assert r.rejected is not None and r.rejected.retry_after_s == 2.0


def test_drain_closes_everything_with_503() -> None:
    q = fq()
    es = [push(q, t, tier=i) for i, t in enumerate("abc")]
    out = q.drain(7.0, 1.0)
    assert sorted(out, key=id) == sorted(es, key=id) and len(q) == 0
    for e in es:
        assert e.state is State.CLOSED and e.rejection is not None
        assert e.rejection.status == 503 and e.rejection.retry_after_s == 7.0
    q.check()


# -- the core: nothing is lost ---------------------------------------------------------------------
_op = st.one_of(
    st.tuples(
        st.just("push"),
        st.sampled_from("abcd"),
        st.integers(0, 3),
        st.sampled_from([0.5, 1.0, 3.0]),
        st.floats(0.0, 5.0),
    ),
    st.tuples(st.just("pop")),
    st.tuples(st.just("tick"), st.floats(0.0, 2.0)),
    st.tuples(st.just("remove"), st.integers(0, 10_000)),
)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(_op, max_size=120),
    max_queued=st.integers(0, 12),
    per_tenant=st.integers(0, 4),
)
def test_every_entry_ends_exactly_once(ops: list[tuple], max_queued: int, per_tenant: int) -> None:
    q = FairQueue(max_queued=max_queued, max_queued_per_tenant=per_tenant, min_rate_samples=3)
    now = 0.0
    entries: list[Entry] = []
    left: Counter[int] = Counter()  # id(entry) -> times it left the queue
    for op in ops:
        if op[0] == "push":
            _, tenant, tier, weight, dl = op
            e = Entry(tenant, tier, weight, now + dl)
            entries.append(e)
            r = q.push(e, now)
            if r.rejected is not None:
                assert e.state is State.REJECTED and e.rejection is r.rejected
                assert r.rejected.status in (429, 503) and r.rejected.retry_after_s >= 1.0
                left[id(e)] += 1
            else:
                assert e.state is State.QUEUED
            for v in r.shed:
                assert v.state is State.SHED and v.rejection is not None
                left[id(v)] += 1
            assert len(q) <= max_queued
        elif op[0] == "pop":
            depth = q.depth_by_tier()
            head = q.peek()
            e = q.pop(now)
            assert e is head
            if e is not None:
                assert e.tier == max(depth) and e.state is State.ADMITTED
                left[id(e)] += 1
        elif op[0] == "tick":
            now += op[1]
            for e in q.expire(now):
                assert e.state is State.EXPIRED and e.deadline <= now
                left[id(e)] += 1
        elif entries:
            e = entries[op[1] % len(entries)]
            was = e.state
            if q.remove(e, now):
                assert was is State.QUEUED and e.state is State.CANCELLED
                left[id(e)] += 1
            else:
                assert was is not State.QUEUED
        q.check()
        if per_tenant:
            assert all(q.depth_of(t) <= per_tenant for t in "abcd")
    for e in q.drain(1.0, now):
        left[id(e)] += 1
    q.check()
    assert len(q) == 0 and q.depth_by_tier() == {}
    assert all(e.state in TERMINAL for e in entries)
    assert all(left[id(e)] == 1 for e in entries)
    assert sum(q.outcomes.values()) == len(entries)


# -- the shell -------------------------------------------------------------------------------------
class Fleet:
    """Slots a test hands out by hand; `dispatch` is what the proxy's _acquire does."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.in_flight = 0
        self.peak = 0

    def free(self) -> int:
        return self.slots - self.in_flight

    def has_room(self) -> bool:
        return self.in_flight < self.slots

    def dispatch(self) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        assert self.in_flight <= self.slots, "admitted beyond the room reported"

    def finish(self) -> None:
        self.in_flight -= 1


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def admitted(self, pool: str, tier: int, wait_s: float) -> None:
        self.events.append(("admitted", pool, str(tier)))

    def refused(self, pool: str, tier: int, reason: str, status: int) -> None:
        self.events.append(("refused", pool, str(tier), reason, str(status)))

    def cancelled(self, pool: str, tier: int, wait_s: float) -> None:
        self.events.append(("cancelled", pool, str(tier)))


def ctl(**kw: object) -> AdmissionController:
    kw.setdefault("recheck_s", 0.02)
    return AdmissionController(AdmissionSettings(**kw))  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fast_path_returns_at_once_and_creates_nothing() -> None:
    c = ctl()
    got = await c.admit(tenant="t", priority=0.5, has_room=lambda: True, pool="m")
    assert got == Admitted(0.0, False) and not got.queued
    assert c.pool_queue("m") is None and c.queued() == 0


async def test_disabled_controller_never_waits() -> None:
    c = ctl(enabled=False)
    for _ in range(100):
        got = await c.admit(tenant="t", priority=0.0, has_room=lambda: False)
        assert not got.queued
    assert c.queued() == 0 and not c.enabled


async def test_waiters_are_admitted_in_priority_order_as_kick_frees_room() -> None:
    c = ctl()
    fleet = Fleet(0)
    order: list[str] = []

    async def request(name: str, prio: float) -> None:
        got = await c.admit(tenant=name, priority=prio, has_room=fleet.has_room, pool="m")
        fleet.dispatch()  # synchronously after admit, as the proxy does
        assert got.queued and got.wait_s >= 0
        order.append(name)

    tasks = []
    for name, prio in [("lo", 0.1), ("mid", 0.5), ("hi", 0.9), ("mid2", 0.5), ("top", 1.0)]:
        tasks.append(asyncio.create_task(request(name, prio)))
        await settle()
    assert c.queued() == 5 and c.depth_by_tier() == {1: 1, 5: 2, 9: 1, 10: 1}
    for expect in ["top", "hi", "mid", "mid2", "lo"]:
        fleet.slots += 1  # one worker slot frees
        c.kick("m")
        await settle()
        assert order[-1] == expect and len(order) == fleet.slots
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert c.queued() == 0 and c.depth_by_tier() == {1: 0, 5: 0, 9: 0, 10: 0}
    assert fleet.peak == fleet.slots


async def test_a_newcomer_queues_behind_waiters_even_when_room_appears() -> None:
    c = ctl()
    fleet = Fleet(0)
    order: list[str] = []

    async def request(name: str) -> None:
        await c.admit(tenant=name, priority=0.5, has_room=fleet.has_room)
        fleet.dispatch()
        order.append(name)

    first = asyncio.create_task(request("first"))
    await settle()
    fleet.slots = 1  # room appears, but nobody kicked yet
    second = asyncio.create_task(request("second"))
    await asyncio.wait_for(first, 5)
    assert order == ["first"]  # the newcomer's arrival admitted the older waiter, not itself
    fleet.finish()
    c.kick()
    await asyncio.wait_for(second, 5)
    assert order == ["first", "second"]


async def test_a_bool_predicate_releases_one_per_loop_turn_and_never_overshoots() -> None:
    c = ctl()
    fleet = Fleet(0)

    async def request() -> None:
        await c.admit(tenant="t", priority=0.5, has_room=fleet.has_room)
        fleet.dispatch()

    tasks = [asyncio.create_task(request()) for _ in range(20)]
    await settle()
    fleet.slots = 8
    c.kick()
    c.kick()  # a second kick before the first waiter resumed must not hand out more
    for _ in range(50):  # many loop turns (one release per turn), and no wall clock
        await asyncio.sleep(0)
    assert fleet.in_flight == 8 and c.queued() == 12
    fleet.slots = 20
    c.kick()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert fleet.peak == 20


async def test_an_int_predicate_releases_a_batch_in_one_kick() -> None:
    c = ctl(recheck_s=10.0)  # no timer help: one kick does it
    fleet = Fleet(0)
    woke: list[int] = []

    async def request(i: int) -> None:
        await c.admit(tenant="t", priority=0.5, has_room=fleet.free)
        fleet.dispatch()
        woke.append(i)

    tasks = [asyncio.create_task(request(i)) for i in range(10)]
    await settle()
    fleet.slots = 6
    c.kick()
    assert c.queued() == 4  # granted synchronously, before any waiter ran
    await settle()
    assert sorted(woke) == list(range(6)) and fleet.in_flight == 6
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_recheck_timer_admits_when_a_kick_is_missed() -> None:
    c = ctl(recheck_s=0.02)
    fleet = Fleet(0)
    task = asyncio.create_task(c.admit(tenant="t", priority=0.5, has_room=fleet.has_room))
    await settle()
    fleet.slots = 1  # room, never announced
    got = await asyncio.wait_for(task, 5)
    assert got.queued


async def test_a_failing_predicate_means_no_room_not_a_leak() -> None:
    c = ctl()
    calls = 0

    def broken() -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            return False  # the fast-path check: queue it
        raise RuntimeError("registry exploded")

    with pytest.raises(APIError) as ei:
        await asyncio.wait_for(
            c.admit(tenant="t", priority=0.5, deadline_s=0.05, has_room=broken), 5
        )
    assert ei.value.status == 503 and c.queued() == 0 and c._granted == 0


async def test_deadline_expiry_is_a_503_with_retry_after() -> None:
    c = ctl()
    with pytest.raises(APIError) as ei:
        await asyncio.wait_for(
            c.admit(tenant="t", priority=0.5, deadline_s=0.05, has_room=lambda: False), 5
        )
    e = ei.value
    assert e.status == 503 and e.code == "queue_timeout" and e.type == "service_unavailable"
    resp = e.response()
    assert int(resp.headers["retry-after"]) >= 1
    assert resp.headers[ADMISSION_HEADER] == "expired"
    assert c.queued() == 0


async def test_deadline_is_capped_and_zero_means_do_not_queue() -> None:
    s = AdmissionSettings(default_deadline_s=10.0, max_deadline_s=30.0)
    assert s.deadline_s(None) == 10.0
    assert s.deadline_s("2500") == 2.5
    assert s.deadline_s("999999") == 30.0
    assert s.deadline_s("-5") == 0.0
    assert s.deadline_s("soon") == 10.0 and s.deadline_s("nan") == 10.0
    # Past float's range is as far as any huge value: the cap (it was the shorter default).
    assert s.deadline_s("inf") == 30.0 and s.deadline_s("1e400") == 30.0
    assert s.deadline_s("-inf") == 0.0
    c = ctl()
    with pytest.raises(APIError) as ei:
        await c.admit(tenant="t", priority=0.5, deadline_s=0.0, has_room=lambda: False)
    assert ei.value.status == 503 and ei.value.headers[ADMISSION_HEADER] == "deadline"
    assert c.queued() == 0


async def test_cancelled_waiter_leaves_no_entry() -> None:
    rec = Recorder()
    c = AdmissionController(AdmissionSettings(recheck_s=0.02), observer=rec)
    task = asyncio.create_task(c.admit(tenant="t", priority=0.5, has_room=lambda: False, pool="m"))
    await settle()
    assert c.queued() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert c.queued() == 0
    q = c.pool_queue("m")
    assert q is not None and q.outcomes == {State.CANCELLED: 1}
    q.check()
    assert rec.events == [("cancelled", "m", "5")]


async def test_a_grant_the_client_never_used_goes_to_the_next_waiter() -> None:
    c = ctl(recheck_s=10.0)
    fleet = Fleet(0)

    async def request() -> None:
        await c.admit(tenant="t", priority=0.5, has_room=fleet.has_room)
        fleet.dispatch()

    first = asyncio.create_task(request())
    await settle()
    second = asyncio.create_task(request())
    await settle()
    fleet.slots = 1
    c.kick()  # grants `first` ...
    first.cancel()  # ... whose client leaves before it resumes
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 5)
    assert fleet.in_flight == 1 and c.queued() == 0


async def test_a_cancelled_waiter_at_the_head_is_skipped_by_kick() -> None:
    c = ctl(recheck_s=10.0)
    fleet = Fleet(0)
    first = asyncio.create_task(c.admit(tenant="t", priority=0.5, has_room=fleet.has_room))
    await settle()
    second = asyncio.create_task(c.admit(tenant="t", priority=0.5, has_room=fleet.has_room))
    await settle()
    first.cancel()  # its future is cancelled now; its handler has not run yet
    fleet.slots = 1
    c.kick()
    assert (await asyncio.wait_for(second, 5)).queued
    with pytest.raises(asyncio.CancelledError):
        await first
    q = c.pool_queue()
    assert q is not None and q.outcomes == {State.CANCELLED: 1, State.ADMITTED: 1}


async def test_close_rejects_every_waiter_and_later_admits_with_503() -> None:
    c = ctl()
    tasks = [
        asyncio.create_task(c.admit(tenant=f"t{i}", priority=i / 4, has_room=lambda: False))
        for i in range(4)
    ]
    await settle()
    assert c.queued() == 4
    c.close("draining for a deploy", retry_after_s=3.0)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    for r in [*results]:
        assert isinstance(r, APIError) and r.status == 503 and r.code == "shutting_down"
        resp = r.response()
        assert resp.headers["retry-after"] == "3" and resp.headers[ADMISSION_HEADER] == "closed"
    with pytest.raises(APIError) as ei:
        await c.admit(tenant="t", priority=1.0, has_room=lambda: True)
    assert ei.value.status == 503 and ei.value.message == "draining for a deploy"
    assert c.queued() == 0 and c.closed


async def test_a_shed_waiter_gets_503_and_the_tenant_over_its_share_429() -> None:
    rec = Recorder()
    c = AdmissionController(AdmissionSettings(max_queued=2, recheck_s=0.02), observer=rec)
    no = lambda: False  # noqa: E731
    low = asyncio.create_task(c.admit(tenant="batch", priority=0.1, has_room=no))
    await settle()
    hog = asyncio.create_task(c.admit(tenant="hog", priority=0.9, has_room=no))
    await settle()
    vip = asyncio.create_task(c.admit(tenant="vip", priority=0.9, has_room=no))
    await settle()
    with pytest.raises(APIError) as ei:
        await asyncio.wait_for(low, 5)
    assert ei.value.status == 503 and ei.value.code == "queue_shed"
    # Full at tier 9 with one each: hog asking for a second is over its share -> 429.
    with pytest.raises(APIError) as ei:
        await c.admit(tenant="hog", priority=0.9, has_room=no)
    e = ei.value
    assert e.status == 429 and e.code == "rate_limit_exceeded" and e.type == "requests"
    assert e.headers[ADMISSION_HEADER] == "over_share"
    assert int(e.response().headers["retry-after"]) >= 1
    assert ("refused", "", "1", "shed", "503") in rec.events
    assert ("refused", "", "9", "over_share", "429") in rec.events
    c.close()
    await asyncio.gather(hog, vip, return_exceptions=True)


async def test_disabling_live_releases_every_waiter() -> None:
    c = ctl()
    tasks = [
        asyncio.create_task(c.admit(tenant="t", priority=0.5, has_room=lambda: False))
        for _ in range(3)
    ]
    await settle()
    c.configure(AdmissionSettings(enabled=False))
    got = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(g.queued for g in got) and c.queued() == 0
    assert not (await c.admit(tenant="t", priority=0.5, has_room=lambda: False)).queued


async def test_a_reload_of_priority_levels_keeps_queued_waiters_in_priority_order() -> None:
    # Review finding: queued waiters kept tiers on the old scale; after 10 -> 100 levels a
    # priority-0.1 newcomer (tier 10) was served before a 0.9 request waiting since (tier 9).
    c = ctl(recheck_s=10.0, priority_levels=10)
    room = [0]
    order: list[str] = []

    async def request(name: str, priority: float) -> None:
        await c.admit(tenant=name, priority=priority, deadline_s=5.0, has_room=lambda: room[0])
        room[0] -= 1
        order.append(name)

    high = asyncio.create_task(request("high", 0.9))
    mid = asyncio.create_task(request("mid", 0.5))
    await settle()
    assert c.depth_by_tier() == {9: 1, 5: 1}
    c.configure(AdmissionSettings(recheck_s=10.0, priority_levels=100))
    low = asyncio.create_task(request("low", 0.1))
    await settle()
    assert c.depth_by_tier() == {90: 1, 50: 1, 10: 1, 9: 0, 5: 0}
    room[0] = 3
    c.kick()
    await asyncio.wait_for(asyncio.gather(high, mid, low), 5)
    assert order == ["high", "mid", "low"]
    c.close()


def test_retier_keeps_arrival_order_deadlines_and_time_queued() -> None:
    q = fq()
    a = push(q, "a", tier=5, deadline=50.0)
    b = push(q, "b", tier=5, deadline=20.0, now=1.0)
    a.priority, b.priority = 0.5, 0.5
    q.retier(lambda e: 50, now=3.0)
    assert q.depth_by_tier() == {50: 2} and len(q) == 2
    assert [e.tenant for e in q.expire(25.0)] == ["b"]  # its own deadline, still on the heap
    e = q.pop(30.0)
    assert e is a and e.wait_s == 30.0  # queued since 0, not since the reload
    assert len(q) == 0


async def test_pools_do_not_block_each_other() -> None:
    c = ctl(recheck_s=10.0)
    busy = asyncio.create_task(c.admit(tenant="t", priority=1.0, has_room=lambda: False, pool="a"))
    await settle()
    got = await c.admit(tenant="t", priority=0.0, has_room=lambda: True, pool="b")
    assert not got.queued and c.depth_by_tier("a") == {10: 1} and c.depth_by_tier("b") == {}
    busy.cancel()
    await asyncio.gather(busy, return_exceptions=True)


@pytest.mark.parametrize("predicate", ["bool", "int"])
async def test_random_traffic_loses_nothing_and_never_oversubscribes(predicate: str) -> None:
    rng = random.Random(1234)
    c = ctl(max_queued=40, max_queued_per_tenant=15, recheck_s=0.005)
    fleet = Fleet(4)
    room: Callable[[], int | bool] = fleet.has_room if predicate == "bool" else fleet.free
    outcomes: Counter[str] = Counter()

    async def request(i: int) -> None:
        tenant = rng.choice(["a", "b", "c", "d"])
        try:
            await c.admit(
                tenant=tenant,
                priority=rng.choice([0.1, 0.5, 0.9]),
                weight={"a": 1.0, "b": 2.0, "c": 1.0, "d": 0.5}[tenant],
                deadline_s=rng.choice([0.01, 0.05, 0.5, 5.0]),
                has_room=room,
            )
        except APIError as e:
            assert e.status in (429, 503) and e.retry_after_s is not None
            outcomes[f"refused_{e.status}"] += 1
            return
        fleet.dispatch()
        try:
            await asyncio.sleep(rng.random() * 0.004)
        finally:
            fleet.finish()
            c.kick()
        outcomes["served"] += 1

    tasks = []
    for i in range(400):
        tasks.append(asyncio.create_task(request(i)))
        if rng.random() < 0.15:
            victim = rng.choice(tasks)
            victim.cancel()
        if rng.random() < 0.3:
            await asyncio.sleep(0)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert not [r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)]
    assert outcomes["served"] + outcomes["refused_429"] + outcomes["refused_503"] + cancelled == 400
    assert outcomes["served"] > 0 and c.queued() == 0
    assert fleet.in_flight == 0 and fleet.peak <= 4
    q = c.pool_queue()
    assert q is not None
    q.check()
    assert all(s in TERMINAL for s in q.outcomes)
    assert c._granted == 0


def _no_room() -> int:
    return 0


async def _queue_two(
    adm: AdmissionController, first_s: float, second_s: float, gap_s: float
) -> tuple[asyncio.Task[Any], asyncio.Task[Any]]:
    """Two waiters for a fleet with no room, deadlines ``first_s`` then ``second_s``."""
    first = asyncio.create_task(
        adm.admit(tenant="a", priority=0.5, deadline_s=first_s, has_room=_no_room)
    )
    await asyncio.sleep(gap_s)
    second = asyncio.create_task(
        adm.admit(tenant="b", priority=0.5, deadline_s=second_s, has_room=_no_room)
    )
    return first, second


async def test_a_short_deadline_queued_behind_a_long_one_ends_at_its_own_deadline() -> None:
    # Review finding: the recheck timer was armed for the first waiter (min(recheck_s, 20 s) =
    # 5 s) and not moved for a newcomer due sooner, which waited until it fired.
    adm = AdmissionController(AdmissionSettings(recheck_s=5.0, max_deadline_s=30.0))
    long, short = await _queue_two(adm, 20.0, 0.2, 0.01)
    try:
        await asyncio.wait({short}, timeout=2.5)  # well before the 5 s timer, well after 0.2 s
        assert short.done(), "the 0.2 s waiter was still queued: ended only by the 5 s timer"
        with pytest.raises(APIError) as ei:
            short.result()
        assert ei.value.status == 503 and not long.done()
    finally:
        adm.close()
        await asyncio.gather(long, short, return_exceptions=True)


def test_a_waiter_due_within_a_millisecond_does_not_break_the_next_admit_under_uvloop() -> None:
    # uvloop turns call_later under 0.5 ms into call_soon, a Handle with no `when()`: reading
    # the timer's due time from it made the next queued admit a 500 (bench spike, 1 in 200).
    import uvloop

    now = [100.0]

    async def scenario() -> None:
        adm = AdmissionController(AdmissionSettings(recheck_s=5.0), clock=lambda: now[0])
        soon, later = await _queue_two(adm, 0.0002, 10.0, 0)
        await asyncio.sleep(0)
        try:
            assert not later.done() or not isinstance(later.exception(), AttributeError)
            assert adm.queued() >= 1
        finally:
            adm.close()
            await asyncio.gather(soon, later, return_exceptions=True)
        assert isinstance(later.exception(), APIError)  # refused by the close, not a crash

    uvloop.run(scenario())
