"""The quota store contract, run against both backends (`h` is parametrized: memory and redis).

Rates are chosen so that Redis's real clock moving between calls cannot change a verdict: where
a test counts exact boundaries without sleeping, a cell takes 10 s (rpm 6, tpm 6), so even a
badly stalled shared machine does not refill one. Tests that sleep past a retry-after use 1 s
cells. Exact timing is asserted on the memory backend (fake clock); Redis gets bounds.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from gateway.quota import (
    CONCURRENCY_RETRY_S,
    Admission,
    ModelLimits,
    Reservation,
    TenantLimits,
)
from gateway.quota_memory import MemoryQuotaStore

from .conftest import FakeClock, Harness

_ids = itertools.count()


def rq(
    limits: TenantLimits,
    tokens: int = 1,
    *,
    model: str = "m",
    rid: str | None = None,
    tenant: str = "acme",
) -> Reservation:
    return Reservation(tenant, rid or f"req-{next(_ids)}", model, tokens, limits)


async def admit_n(
    h: Harness, limits: TenantLimits, n: int, tokens: int = 1, **kw: str
) -> list[Admission]:
    return [await h.store.admit(rq(limits, tokens, **kw)) for _ in range(n)]


def assert_wait(h: Harness, got: float, exact: float) -> None:
    """Exact on the fake clock; on Redis, no more than exact and not much less (time passed)."""
    if h.exact:
        assert got == pytest.approx(exact, abs=1e-5)
    else:
        assert exact - min(exact / 2, 3.0) < got <= exact + 1e-5


# -- RPM ----------------------------------------------------------------------------------------


async def test_rpm_admits_exactly_the_burst_back_to_back_then_refuses(h: Harness) -> None:
    lim = TenantLimits(rpm=6, burst_requests=5)
    got = await admit_n(h, lim, 5)
    assert all(a.allowed for a in got)
    assert [a.remaining_requests for a in got] == [4, 3, 2, 1, 0]
    refused = await h.store.admit(rq(lim))
    assert not refused.allowed
    assert (refused.reason, refused.dimension, refused.scope) == ("requests", "requests", "tenant")
    assert not refused.never
    # One cell of a 6/min limit comes back every 10 s.
    assert_wait(h, refused.retry_after_s, 10.0)
    retry_header = int(refused.headers()["retry-after"])
    assert retry_header == 10 if h.exact else 7 <= retry_header <= 10
    assert refused.remaining_requests == 0


async def test_refused_requests_consume_nothing(h: Harness) -> None:
    lim = TenantLimits(rpm=60, burst_requests=2)
    await admit_n(h, lim, 2)
    refusals = await admit_n(h, lim, 20)
    assert not any(a.allowed for a in refusals)
    await h.sleep(refusals[-1].retry_after_s + 0.05)
    # Had the 20 refusals been charged, nothing would pass for another 20 s.
    assert (await h.store.admit(rq(lim))).allowed
    assert not (await h.store.admit(rq(lim))).allowed


async def test_retry_after_is_exact(h: Harness) -> None:
    lim = TenantLimits(rpm=60, burst_requests=1)
    assert (await h.store.admit(rq(lim))).allowed
    first = await h.store.admit(rq(lim))
    assert not first.allowed
    if h.exact:
        await h.sleep(first.retry_after_s - 0.001)
        just_before = await h.store.admit(rq(lim))
        assert not just_before.allowed
        assert just_before.retry_after_s == pytest.approx(0.001, abs=1e-5)
        await h.sleep(0.001)
        assert (await h.store.admit(rq(lim))).allowed
    else:
        again = await h.store.admit(rq(lim))
        assert not again.allowed
        assert again.retry_after_s <= first.retry_after_s
        await h.sleep(again.retry_after_s + 0.05)
        assert (await h.store.admit(rq(lim))).allowed


async def test_burst_refills_at_the_steady_rate(h: Harness) -> None:
    lim = TenantLimits(rpm=600, burst_requests=3)  # one request per 100 ms
    assert all(a.allowed for a in await admit_n(h, lim, 3))
    await h.sleep(0.25)
    after = await admit_n(h, lim, 4)
    admitted = sum(a.allowed for a in after)
    if h.exact:
        assert admitted == 2
    else:
        assert 2 <= admitted <= 3  # a slow sleep may refill one more cell, never the burst


async def test_default_request_burst_is_ten_seconds_worth(h: Harness) -> None:
    lim = TenantLimits(rpm=30)  # 5 requests' worth of burst, one back every 2 s
    got = await admit_n(h, lim, 6)
    assert [a.allowed for a in got] == [True] * 5 + [False]
    assert got[0].limit_requests == 30


# -- TPM ----------------------------------------------------------------------------------------


async def test_tpm_charges_weighted_cost(h: Harness) -> None:
    lim = TenantLimits(tpm=6, burst_tokens=100)  # one token per 10 s
    a = await h.store.admit(rq(lim, 70))
    assert a.allowed and a.remaining_tokens == 30 and a.limit_tokens == 6
    too_big = await h.store.admit(rq(lim, 40))
    assert not too_big.allowed and too_big.reason == "tokens" and not too_big.never
    assert_wait(h, too_big.retry_after_s, 100.0)  # 10 missing tokens x 10 s
    fits = await h.store.admit(rq(lim, 30))
    assert fits.allowed and fits.remaining_tokens == 0


async def test_limits_are_all_or_nothing(h: Harness) -> None:
    lim = TenantLimits(rpm=6, burst_requests=3, tpm=6, burst_tokens=100)
    assert (await h.store.admit(rq(lim, 80))).allowed
    refused = await h.store.admit(rq(lim, 50))
    assert not refused.allowed and refused.reason == "tokens"
    # The request cell the refused call would have taken is still there.
    assert refused.remaining_requests == 2
    ok = await h.store.admit(rq(lim, 20))
    assert ok.allowed and ok.remaining_requests == 1


async def test_longest_wait_is_reported_when_several_limits_refuse(h: Harness) -> None:
    lim = TenantLimits(rpm=6, burst_requests=1, tpm=6, burst_tokens=10)
    assert (await h.store.admit(rq(lim, 10))).allowed
    refused = await h.store.admit(rq(lim, 5))
    # requests need 10 s, tokens 50 s: only after 50 s do both pass.
    assert refused.reason == "tokens"
    assert_wait(h, refused.retry_after_s, 50.0)


async def test_request_larger_than_the_whole_budget_is_never_admissible(h: Harness) -> None:
    lim = TenantLimits(rpm=60, tpm=600, burst_tokens=100)
    never = await h.store.admit(rq(lim, 101))
    assert not never.allowed and never.never
    assert (never.reason, never.dimension) == ("insufficient_quota", "tokens")
    assert never.headers()["x-should-retry"] == "false"
    assert "retry-after" not in never.headers()
    # ...and it took nothing: the full budget is still there.
    assert (await h.store.admit(rq(lim, 100))).allowed


async def test_default_token_burst_is_one_minute(h: Harness) -> None:
    lim = TenantLimits(tpm=1000)
    assert (await h.store.admit(rq(lim, 1000))).allowed
    assert (await h.store.admit(rq(lim, 1001))).never


async def test_suspended_tenant_is_never_admitted(h: Harness) -> None:
    never = await h.store.admit(rq(TenantLimits(rpm=60, max_concurrent=0)))
    assert never.never and never.dimension == "concurrency"


# -- settlement ---------------------------------------------------------------------------------


async def test_settle_refunds_unused_tokens(h: Harness) -> None:
    lim = TenantLimits(tpm=6, burst_tokens=100)  # one token per 10 s
    a = await h.store.admit(rq(lim, 100, rid="r1"))
    assert a.allowed and a.remaining_tokens == 0
    s = await h.store.settle("acme", "r1", 20, limits=lim)
    assert (s.status, s.reserved_tokens, s.actual_tokens, s.delta_tokens) == (
        "settled",
        100,
        20,
        -80,
    )
    assert (await h.store.admit(rq(lim, 80))).allowed
    assert not (await h.store.admit(rq(lim, 1))).allowed


async def test_settle_with_more_tokens_than_reserved_is_debt(h: Harness) -> None:
    lim = TenantLimits(tpm=6, burst_tokens=100)
    assert (await h.store.admit(rq(lim, 50, rid="r1"))).allowed
    s = await h.store.settle("acme", "r1", 150, limits=lim)
    assert s.delta_tokens == 100
    usage = await h.store.usage("acme", lim)
    assert usage["tokens"]["remaining"] == 0
    refused = await h.store.admit(rq(lim, 1))
    assert not refused.allowed and refused.reason == "tokens"
    # 150 used of 100: 50 tokens of debt plus the one asked for, at one token per 10 s.
    assert_wait(h, refused.retry_after_s, 510.0)


async def test_refund_cannot_exceed_the_full_budget(h: Harness) -> None:
    lim = TenantLimits(tpm=6000, burst_tokens=100)  # full again 1 s after being emptied
    assert (await h.store.admit(rq(lim, 100, rid="r1"))).allowed
    await h.sleep(1.1)
    await h.store.settle("acme", "r1", 0, limits=lim)  # refunds 100 into a full bucket
    got = await admit_n(h, lim, 2, 100)
    assert [a.allowed for a in got] == [True, False]


async def test_duplicate_settle_changes_nothing(h: Harness) -> None:
    lim = TenantLimits(tpm=6, burst_tokens=100, max_concurrent=5)
    assert (await h.store.admit(rq(lim, 100, rid="r1"))).allowed
    assert (await h.store.admit(rq(lim, 0, rid="r2"))).allowed
    assert (await h.store.settle("acme", "r1", 20, limits=lim)).status == "settled"
    dup = await h.store.settle("acme", "r1", 20, limits=lim)
    assert (dup.status, dup.delta_tokens) == ("duplicate", 0)
    assert (await h.store.settle("acme", "r1", 0, limits=lim)).status == "duplicate"
    assert (await h.store.release("acme", "r1", limits=lim, refund_all=True)).status == "duplicate"
    # One refund of 80, not four: exactly 80 tokens are free, and r2's lease is untouched.
    assert (await h.store.usage("acme", lim))["in_flight"] == 1
    assert (await h.store.admit(rq(lim, 80))).allowed
    assert not (await h.store.admit(rq(lim, 1))).allowed


async def test_racing_callbacks_settle_exactly_once(h: Harness) -> None:
    lim = TenantLimits(tpm=6, burst_tokens=100, max_concurrent=5)
    assert (await h.store.admit(rq(lim, 100, rid="r1"))).allowed
    got = await asyncio.gather(
        *(h.store.settle("acme", "r1", 20, limits=lim) for _ in range(5)),
        *(h.store.release("acme", "r1", limits=lim, refund_all=True) for _ in range(5)),
    )
    assert sorted(s.status for s in got) == ["duplicate"] * 9 + ["settled"]
    winner = next(s for s in got if s.status == "settled")
    free = -winner.delta_tokens  # 80 if a settle won, 100 if a release did
    assert (await h.store.admit(rq(lim, free))).allowed
    assert not (await h.store.admit(rq(lim, 1))).allowed


async def test_settle_of_an_unknown_request_changes_nothing(h: Harness) -> None:
    lim = TenantLimits(tpm=6, burst_tokens=100)
    assert (await h.store.admit(rq(lim, 100))).allowed
    s = await h.store.settle("acme", "never-admitted", 0, limits=lim)
    assert (s.status, s.delta_tokens) == ("unknown", 0)
    assert not (await h.store.admit(rq(lim, 1))).allowed


async def test_release_refunds_tokens_and_only_refund_all_refunds_the_request(h: Harness) -> None:
    lim = TenantLimits(rpm=6, burst_requests=2, tpm=6, burst_tokens=100)
    assert (await h.store.admit(rq(lim, 50, rid="client-fault"))).allowed
    r = await h.store.release("acme", "client-fault", limits=lim, refund_all=False)
    assert r.status == "settled" and r.delta_tokens == -50
    u = await h.store.usage("acme", lim)
    assert (u["requests"]["remaining"], u["tokens"]["remaining"]) == (1, 100)

    assert (await h.store.admit(rq(lim, 50, rid="upstream-fault"))).allowed
    await h.store.release("acme", "upstream-fault", limits=lim, refund_all=True)
    u = await h.store.usage("acme", lim)
    assert (u["requests"]["remaining"], u["tokens"]["remaining"]) == (1, 100)


async def test_readmitting_a_request_id_is_idempotent(h: Harness) -> None:
    lim = TenantLimits(rpm=6, burst_requests=5, max_concurrent=3)
    first = await h.store.admit(rq(lim, rid="same"))
    again = await h.store.admit(rq(lim, rid="same"))
    assert again.allowed and again.duplicate
    assert again.remaining_requests == first.remaining_requests == 4
    assert again.in_flight == 1
    await h.store.settle("acme", "same", 1, limits=lim)
    reused = await h.store.admit(rq(lim, rid="same"))
    assert not reused.allowed and reused.reason == "duplicate" and reused.never


# -- concurrency leases -------------------------------------------------------------------------


async def test_max_concurrent_is_enforced_and_released_by_settle_and_release(h: Harness) -> None:
    lim = TenantLimits(max_concurrent=2)
    assert (await h.store.admit(rq(lim, rid="a"))).allowed
    b = await h.store.admit(rq(lim, rid="b"))
    assert b.allowed and b.in_flight == 2
    c = await h.store.admit(rq(lim, rid="c"))
    assert not c.allowed and c.reason == "concurrency" and not c.never
    assert c.retry_after_s == CONCURRENCY_RETRY_S
    await h.store.settle("acme", "a", 5, limits=lim)
    assert (await h.store.admit(rq(lim, rid="c"))).allowed
    await h.store.release("acme", "b", limits=lim, refund_all=False)
    assert (await h.store.admit(rq(lim, rid="d"))).allowed
    assert not (await h.store.admit(rq(lim, rid="e"))).allowed
    assert (await h.store.usage("acme", lim))["in_flight"] == 2


async def test_stale_leases_are_pruned_and_a_late_settle_still_refunds(h: Harness) -> None:
    lim = TenantLimits(tpm=6, burst_tokens=100, max_concurrent=1, lease_ttl_s=0.3)
    assert (await h.store.admit(rq(lim, 60, rid="crashed"))).allowed
    assert not (await h.store.admit(rq(lim, 10, rid="b"))).allowed
    await h.sleep(0.4)  # the gateway that held "crashed" never came back
    assert (await h.store.admit(rq(lim, 10, rid="b"))).allowed
    late = await h.store.settle("acme", "crashed", 0, limits=lim)
    assert late.status == "settled" and late.delta_tokens == -60
    # The late settle freed its tokens but not b's slot.
    assert (await h.store.usage("acme", lim))["in_flight"] == 1
    assert not (await h.store.admit(rq(lim, 1, rid="c"))).allowed
    await h.store.settle("acme", "b", 10, limits=lim)
    assert (await h.store.admit(rq(lim, 90, rid="c"))).allowed


async def test_concurrent_admissions_are_atomic(h: Harness) -> None:
    lim = TenantLimits(rpm=6, burst_requests=10, max_concurrent=100)
    got = await asyncio.gather(*(h.store.admit(rq(lim)) for _ in range(60)))
    assert sum(a.allowed for a in got) == 10


# -- per-model limits and headers ---------------------------------------------------------------


async def test_per_model_limits_apply_on_top_of_the_tenant_limits(h: Harness) -> None:
    lim = TenantLimits(
        rpm=6, burst_requests=50, per_model={"small": ModelLimits(rpm=6, burst_requests=2)}
    )
    assert all(a.allowed for a in await admit_n(h, lim, 2, model="small"))
    refused = await h.store.admit(rq(lim, model="small"))
    assert not refused.allowed
    assert (refused.reason, refused.scope) == ("requests", "model")
    assert (refused.limit_requests, refused.remaining_requests) == (6, 0)
    assert_wait(h, refused.retry_after_s, 10.0)
    other = await h.store.admit(rq(lim, model="big"))
    assert other.allowed
    # Two small + one big charged the tenant; the refused one did not.
    assert other.remaining_requests == 47


async def test_per_model_tokens_are_refunded_on_settle(h: Harness) -> None:
    lim = TenantLimits(tpm=6000, per_model={"small": ModelLimits(tpm=6, burst_tokens=100)})
    assert (await h.store.admit(rq(lim, 100, model="small", rid="r1"))).allowed
    assert not (await h.store.admit(rq(lim, 10, model="small"))).allowed
    await h.store.settle("acme", "r1", 30, limits=lim)
    assert (await h.store.admit(rq(lim, 70, model="small"))).allowed
    assert not (await h.store.admit(rq(lim, 1, model="small"))).allowed
    u = await h.store.usage("acme", lim)
    assert u["model:small:tokens"]["remaining"] == 0


async def test_headers_report_the_tightest_limit(h: Harness) -> None:
    lim = TenantLimits(
        rpm=60,
        burst_requests=10,
        tpm=6000,
        burst_tokens=1000,
        per_model={"m": ModelLimits(rpm=30, burst_requests=3)},
    )
    # Fresh limits, one atomic call: the values are exact on both backends.
    a = await h.store.admit(rq(lim, 100, model="m"))
    # Tenant: 9 of 10 requests left; model m: 2 of 3 (tighter), full again in 2 s.
    assert (a.limit_requests, a.remaining_requests) == (30, 2)
    assert a.reset_requests_s == pytest.approx(2.0)
    assert (a.limit_tokens, a.remaining_tokens) == (6000, 900)
    assert a.reset_tokens_s == pytest.approx(1.0)  # 100 tokens x 10 ms
    assert a.headers() == {
        "x-ratelimit-limit-requests": "30",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "2s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "1s",
    }


async def test_unlimited_tenant_has_no_rate_headers(h: Harness) -> None:
    a = await h.store.admit(rq(TenantLimits()))
    assert a.allowed and a.headers() == {}


# -- memory-only (needs a minute of clock) ------------------------------------------------------


async def test_any_minute_admits_at_most_rate_plus_burst(clock: FakeClock) -> None:
    store = MemoryQuotaStore(clock=clock)
    lim = TenantLimits(rpm=60, burst_requests=10)
    times: list[float] = []
    for _ in range(1800):  # 3 minutes of attempts every 100 ms
        if (await store.admit(rq(lim))).allowed:
            times.append(clock.now)
        clock.advance(0.1)
    worst = max(sum(1 for t in times if start <= t < start + 60) for start in times)
    assert worst <= 60 + 10
    assert worst >= 60  # and the limit is usable, not over-strict


def test_memory_store_is_safe_across_threads(clock: FakeClock) -> None:
    """A bench driver or a sync admin call may touch the store from another thread."""
    store = MemoryQuotaStore(clock=clock)
    lim = TenantLimits(rpm=6, burst_requests=50)
    allowed: list[bool] = []

    def worker() -> None:
        async def run() -> list[bool]:
            return [(await store.admit(rq(lim))).allowed for _ in range(40)]

        allowed.extend(asyncio.run(run()))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(allowed) == 320 and sum(allowed) == 50
