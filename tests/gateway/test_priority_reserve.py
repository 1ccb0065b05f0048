"""The priority reserve: free slots lower tiers may not take, kept as headroom for the high tiers
whatever they already run (bench/spike.py measured why it is headroom and not a quota)."""

from __future__ import annotations

from gateway.app import Gateway
from tests.gateway.conftest import MODEL, settings_for
from workers.registry import Health


def _gateway() -> Gateway:
    s = settings_for(
        ["http://127.0.0.1:9", "http://127.0.0.1:10"],
        admission={"priority_reserve": 0.25, "reserve_min_priority": 0.7},
    )
    s = s.model_copy(
        update={"workers": [w.model_copy(update={"max_concurrency": 4}) for w in s.workers]}
    )
    gw = Gateway(s)
    for w in gw.registry.workers.values():
        w.health = Health.HEALTHY
        w.models = frozenset({MODEL})
    return gw


def test_low_priority_never_takes_the_last_reserved_slots() -> None:
    gw = _gateway()  # 8 slots, 2 kept free for priority >= 0.7
    assert gw._room(MODEL, 0.9) == 8
    assert gw._room(MODEL, 0.2) == 6
    w0, w1 = gw.registry.workers.values()
    w0.in_flight = 4
    w1.in_flight = 2  # 2 free: both kept for the high tiers
    assert gw._room(MODEL, 0.2) == 0
    assert gw._room(MODEL, 0.7) == 2


def test_a_full_or_saturated_worker_offers_no_room() -> None:
    gw = _gateway()
    w0, w1 = gw.registry.workers.values()
    w0.in_flight = 9  # over its cap (retries can overshoot): counts as 0, never negative
    assert gw._room(MODEL, 0.9) == 4
    w1.metrics = w1.metrics.__class__(kv_usage=0.95)  # KV saturated: new sequences would preempt
    assert gw._room(MODEL, 0.9) == 0
