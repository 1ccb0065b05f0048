"""Concurrency leases are renewed by the process that holds them and pruned soon after it dies.

Review finding: leases were scored by admit time and pruned 900 s later, never renewed. A gateway
killed (SIGKILL, OOM) with a tenant's `max_concurrent` streams in flight left that tenant refused
for 15 minutes with nothing running; and a request running longer than the TTL stopped counting.

Real redis-server processes only. Time is not asserted on: TTLs and the renewal period are made
small (limits and store constructor), waits are bounded polls, and "a minute without renewal" is
simulated by aging a lease's score in Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis.asyncio as aioredis

from bench.redis_server import RedisServer
from gateway.config import QuotaSettings, TenantSettings
from gateway.metrics import GatewayMetrics
from gateway.quota import DEFAULT_LEASE_TTL_S, Reservation, TenantLimits
from gateway.quota_gate import QuotaGate
from gateway.quota_memory import MemoryQuotaStore
from gateway.quota_redis import RedisQuotaStore
from gateway.tenancy import Tenant, _limits
from tests.quota.conftest import FakeClock

RENEW_S = 0.05  # the renewal period in these tests (production: DEFAULT_LEASE_TTL_S / 6)


def store_at(url: str, prefix: str, renew_s: float = RENEW_S) -> RedisQuotaStore:
    return RedisQuotaStore(
        url, prefix=prefix, socket_timeout_s=2.0, op_timeout_s=5.0, lease_renew_s=renew_s
    )


def rq(limits: TenantLimits, rid: str, tokens: int = 1, tenant: str = "acme") -> Reservation:
    return Reservation(tenant, rid, "m", tokens, limits)


async def eventually(cond: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def hold_for(seconds: float, check: Callable[[], Awaitable[None]]) -> None:
    """Run `check` over and over for `seconds` (no assertion on time: it bounds the loop)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await check()
        await asyncio.sleep(0.05)


@pytest.fixture
def persistent_redis() -> Iterator[RedisServer]:
    with RedisServer(extra_config=["appendonly yes", "appendfsync always"]) as server:
        yield server


# -- 1. a dead owner's leases go -----------------------------------------------------------------


async def test_a_crashed_owners_lease_is_gone_a_minute_later_with_the_default_ttl(
    redis_server: RedisServer, prefix: str
) -> None:
    lim = TenantLimits(tpm=6000, max_concurrent=1)  # the default lease TTL
    crashed, live = store_at(redis_server.url, prefix), store_at(redis_server.url, prefix)
    try:
        assert (await crashed.admit(rq(lim, "a", 600))).allowed
        await crashed.close()  # the process dies: no settle, no more renewals
        assert not (await live.admit(rq(lim, "b"))).allowed
        r = live.client
        key = live.keys.leases("acme")
        # Nothing keeps an unrenewed lease's key for long (it was 15 minutes).
        assert 0 < await r.pttl(key) <= DEFAULT_LEASE_TTL_S * 1000 + 1000
        # 61 s without a renewal (the score is its last renewal, on Redis's clock).
        await r.zincrby(key, -61_000_000, "a")
        assert (await live.admit(rq(lim, "b"))).allowed
        assert (await live.usage("acme", lim))["in_flight"] == 1
        # The reservation record outlived the lease: a late settle (a replayed one) still refunds.
        late = await live.settle("acme", "a", 0, limits=lim)
        assert late.status == "settled" and late.delta_tokens == -600
        await live.settle("acme", "b", 1, limits=lim)
    finally:
        await live.close()


async def test_a_crashed_replica_frees_its_slots_while_a_live_one_keeps_its_own(
    redis_server: RedisServer, prefix: str
) -> None:
    lim = TenantLimits(max_concurrent=2, lease_ttl_s=1.0)
    crashed, live = store_at(redis_server.url, prefix), store_at(redis_server.url, prefix)
    try:
        assert (await crashed.admit(rq(lim, "a1"))).allowed
        assert (await live.admit(rq(lim, "b1"))).allowed
        assert not (await live.admit(rq(lim, "b2"))).allowed
        await crashed.close()

        async def b2_admitted() -> bool:
            return (await live.admit(rq(lim, "b2"))).allowed

        await eventually(b2_admitted)  # a1 expired
        # b1 was renewed all along: it and b2 hold both slots.
        assert not (await live.admit(rq(lim, "b3"))).allowed
        assert sorted(await live.client.zrange(live.keys.leases("acme"), 0, -1)) == [b"b1", b"b2"]
    finally:
        await live.close()


# -- 2. a live owner's lease survives -----------------------------------------------------------


async def test_a_request_longer_than_the_ttl_keeps_counting(
    redis_server: RedisServer, prefix: str
) -> None:
    lim = TenantLimits(max_concurrent=1, lease_ttl_s=0.3)
    owner, other = store_at(redis_server.url, prefix), store_at(redis_server.url, prefix)
    try:
        assert (await owner.admit(rq(lim, "long"))).allowed
        n = 0

        async def still_counted() -> None:
            nonlocal n
            n += 1
            refused = await other.admit(rq(lim, f"x{n}"))
            assert not refused.allowed and refused.reason == "concurrency"
            assert (await other.usage("acme", lim))["in_flight"] == 1

        await hold_for(6 * lim.lease_ttl_s, still_counted)  # many TTLs
        await owner.settle("acme", "long", 1, limits=lim)
        assert (await other.admit(rq(lim, "after"))).allowed
    finally:
        await owner.close()
        await other.close()


async def test_renewal_keeps_a_long_requests_reservation_record(
    redis_server: RedisServer, prefix: str
) -> None:
    lim = TenantLimits(tpm=6000, max_concurrent=4)
    owner = store_at(redis_server.url, prefix)
    try:
        assert (await owner.admit(rq(lim, "long", 600))).allowed
        r = owner.client
        rec = owner.keys.reservation("acme", "long")
        await r.pexpire(rec, 2000)  # as if RECORD_GRACE_S had nearly run out

        async def renewed() -> bool:
            return await r.pttl(rec) > 60_000

        await eventually(renewed)
        done = await owner.settle("acme", "long", 100, limits=lim)
        assert done.status == "settled" and done.delta_tokens == -500
    finally:
        await owner.close()


async def test_memory_store_a_request_longer_than_the_ttl_keeps_counting(
    prefix: str, clock: FakeClock
) -> None:
    lim = TenantLimits(tpm=6000, max_concurrent=1)  # default TTL: a minute
    store = MemoryQuotaStore(prefix=prefix, clock=clock)
    assert (await store.admit(rq(lim, "long", 600))).allowed
    for i in range(24):  # four minutes
        clock.advance(10.0)
        assert not (await store.admit(rq(lim, f"x{i}"))).allowed
    clock.advance(2 * 3600.0)  # longer than the record's grace, in one step
    assert not (await store.admit(rq(lim, "y"))).allowed
    done = await store.settle("acme", "long", 100, limits=lim)
    assert done.status == "settled" and done.delta_tokens == -500
    assert (await store.admit(rq(lim, "after"))).allowed


# -- 3. the renewal registry only holds requests that run ----------------------------------------


async def test_settle_and_release_stop_the_renewal(redis_server: RedisServer, prefix: str) -> None:
    lim = TenantLimits(max_concurrent=2)
    store = store_at(redis_server.url, prefix)
    try:
        assert (await store.admit(rq(lim, "a"))).allowed
        assert (await store.admit(rq(lim, "b"))).allowed
        assert (await store.admit(rq(lim, "c", tenant="other"))).allowed
        assert not (await store.admit(rq(lim, "refused"))).allowed
        dup = await store.admit(rq(lim, "a"))  # a retried admit whose first reply was lost
        assert dup.allowed and dup.duplicate
        assert store.held_leases == 3
        await store.settle("acme", "a", 1, limits=lim)
        await store.release("acme", "b", limits=lim, refund_all=True)
        assert store.held_leases == 1
        assert not (await store.admit(rq(lim, "a"))).allowed  # settled: a duplicate
        await store.release("other", "c", limits=lim, refund_all=False)
        assert store.held_leases == 0
        # A lease settled by another path (a replayed settlement) drops out at the next renewal.
        assert (await store.admit(rq(lim, "d"))).allowed
        peer = store_at(redis_server.url, prefix)
        await peer.settle("acme", "d", 1, limits=lim)
        await peer.close()

        async def dropped() -> bool:
            return store.held_leases == 0

        await eventually(dropped)
    finally:
        await store.close()


def gate_tenant() -> Tenant:
    cfg = TenantSettings(rpm=1000, tpm=6000, max_concurrent=4)
    return Tenant("a", cfg, _limits(cfg), "", "")


def make_gate(url: str) -> QuotaGate:
    cfg = QuotaSettings(
        backend="redis",
        redis_url=url,
        key_prefix="gate:",
        breaker_failures=1,
        breaker_cooldown_s=0.2,
        socket_timeout_s=2.0,
        op_timeout_s=5.0,
    )
    return QuotaGate(cfg, GatewayMetrics())


async def test_a_deferred_settlement_stops_the_renewal_and_an_outage_is_logged_once(
    persistent_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    g = make_gate(persistent_redis.url)
    shared = g.shared
    assert isinstance(shared, RedisQuotaStore)
    shared.lease_renew_s = RENEW_S
    t = gate_tenant()
    try:
        done = await g.admit(t, "done", "m", 100)
        running = await g.admit(t, "running", "m", 100)
        cut = await g.admit(t, "cut", "m", 100)
        assert shared.held_leases == 3
        await g.settle(done, 10)
        assert shared.held_leases == 2
        caplog.set_level(logging.INFO, logger="kvgate.quota")
        persistent_redis.kill()
        await g.release(cut, refund_all=True)  # Redis is down: deferred
        assert g.deferred == 1
        assert shared.held_leases == 1  # only "running" is still renewed
        await asyncio.sleep(20 * RENEW_S)  # renewals fail meanwhile, quietly
        failed = [r for r in caplog.records if "lease renewal failed" in r.getMessage()]
        assert len(failed) == 1
        assert shared._renewer is not None and not shared._renewer.done()
        persistent_redis.start()

        async def replayed_and_renewed() -> bool:
            return g.deferred == 0 and any(
                "lease renewal works again" in r.getMessage() for r in caplog.records
            )

        await eventually(replayed_and_renewed)
        r = aioredis.from_url(persistent_redis.url)
        try:
            key = shared.keys.leases("a")
            assert await r.zrange(key, 0, -1) == [b"running"]
            before = await r.zscore(key, "running")

            async def rescored() -> bool:
                return await r.zscore(key, "running") != before

            await eventually(rescored)
        finally:
            await r.aclose()
        await g.settle(running, 10)
        assert shared.held_leases == 0
    finally:
        await g.close()
    assert shared._renewer is None


# -- 4. the server lost its data ----------------------------------------------------------------


async def test_running_requests_count_again_after_redis_lost_its_data(
    redis_server: RedisServer, prefix: str
) -> None:
    # Review finding: after a restart without persistence (or a failover to a replica behind)
    # the renewal found no record for the requests still running, stopped renewing them, and
    # the tenant ran past max_concurrent; their settles found nothing and charged nothing.
    lim = TenantLimits(tpm=60_000, max_concurrent=2)
    st = store_at(redis_server.url, prefix, renew_s=3600.0)  # renewed by hand below
    try:
        assert (await st.admit(rq(lim, "r1", 600))).allowed
        assert (await st.admit(rq(lim, "r2", 600))).allowed
        await st.client.flushdb()  # the data is gone; r1 and r2 still run here
        await st.renew_leases()
        assert st.held_leases == 2
        assert not (await st.admit(rq(lim, "n1"))).allowed  # both slots are taken again
        full = (await st.usage("acme", lim))["tokens"]["remaining"]
        done = await st.settle("acme", "r1", 250, limits=lim)
        assert done.status == "settled"  # the lost reservation held nothing: charged its use
        left = (await st.usage("acme", lim))["tokens"]["remaining"]
        assert full - left == pytest.approx(250, abs=5)
        released = await st.release("acme", "r2", limits=lim, refund_all=True)
        assert released.status == "settled"
        assert (await st.usage("acme", lim))["in_flight"] == 0
        # A renewal pass that read its ids before a settle does not bring that request back.
        assert (await st.admit(rq(lim, "r3", 10))).allowed
        pass_ids = list(st._held["acme"].rids.items())
        await st.client.flushdb()
        assert (await st.settle("acme", "r3", 5, limits=lim)).status == "unknown"
        await st._renew("acme", lim.lease_ttl_s, pass_ids)
        assert (await st.usage("acme", lim))["in_flight"] == 0
    finally:
        await st.close()
