"""The priority reserve: free slots lower tiers may not take, kept as headroom for the high tiers
whatever they already run (bench/spike.py measured why it is headroom and not a quota)."""

from __future__ import annotations

import asyncio
import functools

from gateway.app import Gateway
from gateway.config import TenantSettings
from tests.gateway.conftest import MODEL, settings_for
from workers.worker import Health


def _gateway(top_priority: float | None = 0.9) -> Gateway:
    s = settings_for(
        ["http://127.0.0.1:9", "http://127.0.0.1:10"],
        admission={"priority_reserve": 0.25, "reserve_min_priority": 0.7},
    )
    tenants = {}
    if top_priority is not None:
        tenants = {
            "low": {"keys_sha256": ["0" * 64], "priority": 0.2},
            "top": {"keys_sha256": ["1" * 64], "priority": top_priority},
        }
    s = s.model_copy(
        update={
            "workers": [w.model_copy(update={"max_concurrency": 4}) for w in s.workers],
            "tenants": {k: TenantSettings(**v) for k, v in tenants.items()},
        }
    )
    gw = Gateway(s)
    for w in gw.registry.workers.values():
        w.health = Health.HEALTHY
        w.models = frozenset({MODEL})
    return gw


def test_low_priority_never_takes_the_last_reserved_slots() -> None:
    gw = _gateway()  # 8 slots, 2 kept free for priority >= 0.7
    assert gw.slots.free(MODEL, 0.9) == 8
    assert gw.slots.free(MODEL, 0.2) == 6
    w0, w1 = gw.registry.workers.values()
    w0.in_flight = 4
    w1.in_flight = 2  # 2 free: both kept for the high tiers
    assert gw.slots.free(MODEL, 0.2) == 0
    assert gw.slots.free(MODEL, 0.7) == 2


def test_a_full_or_saturated_worker_offers_no_room() -> None:
    gw = _gateway()
    w0, w1 = gw.registry.workers.values()
    w0.in_flight = 9  # over its cap (a reload lowered it): counts as 0, never negative
    assert gw.slots.free(MODEL, 0.9) == 4
    w1.metrics = w1.metrics.__class__(kv_usage=0.95)  # KV saturated: new sequences would preempt
    assert gw.slots.free(MODEL, 0.9) == 0


def test_a_reserve_nobody_can_use_is_not_kept() -> None:
    # An open gateway (everyone is the default tenant, priority 0.5), or tenants all below
    # reserve_min_priority: withholding the reserve would only leave a share of the fleet idle.
    for gw in (_gateway(top_priority=None), _gateway(top_priority=0.6)):
        assert gw.slots.free(MODEL, 0.5) == 8
        assert gw.slots.free(MODEL, 0.2) == 8


def test_a_stale_kv_saturation_lapses_as_the_requests_behind_it_finish() -> None:
    gw = _gateway(top_priority=None)
    w0, w1 = gw.registry.workers.values()
    w1.health = Health.UNHEALTHY
    w0.metrics = w0.metrics.__class__(kv_usage=0.95)
    w0.in_flight_at_scrape = 4  # what the scrape saw running
    w0.in_flight = 4
    assert gw.slots.free(MODEL, 0.5) == 0  # nothing finished since: still saturated
    w0.in_flight = 1  # three finished and freed their blocks: ~0.24 of the cache in use
    assert gw.slots.free(MODEL, 0.5) == 3
    w0.in_flight = 0  # idle: the saturated figure is history
    assert gw.slots.free(MODEL, 0.5) == 4
    w0.in_flight_at_scrape = None  # no scrape to scale from: trust the figure
    assert gw.slots.free(MODEL, 0.5) == 0


def test_the_reserve_goes_by_admission_tier_like_the_queue() -> None:
    # 10 levels: tier 7 holds priorities 0.65..0.75, so with reserve_min_priority 0.7 the whole
    # tier may take the reserve (the queue serves a tier as one) and tier 6 may not.
    gw = _gateway()
    w0, w1 = gw.registry.workers.values()
    w0.in_flight, w1.in_flight = 4, 2  # 2 free: exactly the reserve
    assert gw.slots.free(MODEL, 0.65) == gw.slots.free(MODEL, 0.7) == 2
    assert gw.slots.free(MODEL, 0.64) == 0


async def test_a_tier_sharing_the_reserve_is_not_held_up_by_its_lowest_priority_head() -> None:
    """0.65 and 0.7 share tier 7, queued in that order behind a tier-6 waiter: the 2 reserved
    slots go to them (the 0.7 one used to wait behind a 0.65 head that saw no room, until its
    deadline, while those slots sat idle); the tier below still may not take the reserve."""
    gw = _gateway()
    w0, w1 = gw.registry.workers.values()
    w0.in_flight, w1.in_flight = 4, 2

    async def request(priority: float, deadline_s: float) -> None:
        await gw.admission.admit(
            tenant=f"p{priority}",
            priority=priority,
            deadline_s=deadline_s,
            has_room=functools.partial(gw.slots.free, MODEL, priority),
            pool=MODEL,
        )
        w1.in_flight += 1  # the dispatch (the proxy picks the worker with room)
        assert w1.in_flight <= 4

    low = asyncio.create_task(request(0.6, 5.0))
    await asyncio.sleep(0.01)
    mid = asyncio.create_task(request(0.65, 30.0))
    # Deadlines far beyond the bound below: the right behaviour admits both at once, the old
    # one left `hi` queued behind `mid` (a short deadline only made a loaded host's pause fatal).
    hi = asyncio.create_task(request(0.7, 30.0))
    await asyncio.wait_for(asyncio.gather(mid, hi), 10)
    assert not low.done() and gw.admission.queued() == 1 and w1.in_flight == 4
    low.cancel()
    await asyncio.gather(low, return_exceptions=True)
    gw.admission.close()
