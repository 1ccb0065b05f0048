"""QuotaGate's backlog of deferred settlements once the store answers again: an entry the store
refuses for a reason that is no outage does not stall the rest or trip the breaker shared by every
tenant, and the replay does not hold the breaker's half-open probe or run an entry twice.

Real redis-server processes only. A "poisoned" tenant is one whose key in Redis another app
overwrote with a value of another type: every script touching it answers WRONGTYPE, an error from
a healthy store. Where a test needs the breaker open, it opens it as an outage would (the gate's
own breaker, told of a failure): what is under test is what happens when it closes again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Literal

import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from bench.redis_server import RedisServer
from gateway.config import TenantSettings
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.quota_gate import QuotaGate, Ticket
from gateway.quota_redis import RedisQuotaStore
from gateway.tenancy import Tenant, _limits
from tests.gateway.conftest import flat_metrics
from tests.quota.test_gate import make_gate, wait_for

FAILED = 'kvgate_quota_deferred_settlements_outcomes_total{outcome="failed"}'
REPLAYED = 'kvgate_quota_deferred_settlements_outcomes_total{outcome="replayed"}'


def tenant(
    name: str,
    mode: Literal["open", "closed"] = "open",
    models: dict[str, object] | None = None,
    concurrent: int = 4,
) -> Tenant:
    cfg = TenantSettings(
        rpm=100_000,
        tpm=10_000_000,
        max_concurrent=concurrent,
        on_store_failure=mode,
        model_limits=models or {},  # type: ignore[arg-type]
    )
    return Tenant(name, cfg, _limits(cfg), "", "")


def redis_store(g: QuotaGate) -> RedisQuotaStore:
    assert isinstance(g.shared, RedisQuotaStore)
    return g.shared


def metric(metrics: GatewayMetrics, name: str) -> float:
    return flat_metrics(generate_latest(metrics.registry).decode()).get(name, 0.0)


def open_breaker(g: QuotaGate) -> None:
    """What a failed call does (these gates open at the first failure)."""
    g.breaker.record_failure(time.monotonic())
    assert g.breaker.state.value == "open"


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """The quota gate's log records (its own handler: a gateway started by an earlier test may
    have stopped the logger propagating to pytest's capture)."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append  # type: ignore[method-assign]
    logger = logging.getLogger("kvgate.quota")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


# -- a settlement the store refuses (not an outage) ------------------------------------------------


async def test_a_refused_settlement_neither_trips_the_breaker_nor_stalls_the_backlog(
    own_redis: RedisServer, records: list[logging.LogRecord]
) -> None:
    # Review finding: the WRONGTYPE entry stayed at the head of the backlog for ever; each retry
    # counted against the one breaker, so on a healthy Redis a fail-closed tenant got 503s and
    # the entries queued behind it (another tenant's lease) were never replayed.
    g, metrics = make_gate(own_redis.url)
    bad, good, hard = tenant("bad"), tenant("good"), tenant("hard", "closed")
    r = aioredis.from_url(own_redis.url)
    try:
        tg = await g.admit(good, "g-1", "m", 1000)
        tb = await g.admit(bad, "b-1", "m", 1000)
        leases = redis_store(g).keys.leases("bad")
        await r.delete(leases)
        await r.set(leases, "another app's value")
        await g.settle(tb, 500)  # WRONGTYPE: the store answered, it is not down
        assert g.breaker.state.value == "closed"
        assert g.deferred == 1  # kept for a retry, in case it was passing
        # An outage then defers the other tenant's settlement behind the poisoned one.
        open_breaker(g)
        await g.settle(tg, 100)
        assert g.deferred == 2
        # The replayer probes once the cooldown is over: the entry behind is replayed, the
        # poisoned one given up after a few tries, and the breaker closes.
        await wait_for(lambda: g.deferred == 0)
        assert await r.zrange(redis_store(g).keys.leases("good"), 0, -1) == []
        assert await r.hget(redis_store(g).keys.reservation("good", "g-1"), "state") == b"settled"
        assert g.breaker.state.value == "closed"
        assert metric(metrics, FAILED) == 1
        assert metric(metrics, REPLAYED) == 1
        # A fail-closed tenant is served by the healthy store, not refused for another's key.
        for i in range(3):
            t = await g.admit(hard, f"h-{i}", "m", 10)
            assert t.store is g.shared
            await g.settle(t, 10)
        assert g.breaker.state.value == "closed"
        # Given up loudly, naming whose settlement it was.
        dropped = [x.getMessage() for x in records if x.levelno >= logging.ERROR]
        assert any("b-1" in msg and "bad" in msg for msg in dropped), dropped
    finally:
        await r.aclose()
        await g.close()


async def test_a_tenants_refused_admissions_do_not_open_the_breaker_for_everyone(
    own_redis: RedisServer, records: list[logging.LogRecord]
) -> None:
    # Review finding: an admission the store refused (WRONGTYPE at one tenant's key) counted on
    # the breaker every tenant shares, so on a healthy Redis a fail-closed tenant got 503s.
    g, _metrics = make_gate(own_redis.url)  # opens at the first failure it is told of
    bad, hard = tenant("bad"), tenant("hard", "closed")
    r = aioredis.from_url(own_redis.url)
    try:
        leases = redis_store(g).keys.leases("bad")
        await r.set(leases, "another app's value")
        for i in range(3):  # the poisoned tenant: its failure mode (open) answers, locally
            t = await g.admit(bad, f"b-{i}", "m", 10)
            assert t.store is g.degraded
            await g.settle(t, 10)
        assert g.breaker.state.value == "closed"
        assert g.deferred == 0  # a refused script wrote nothing: no refund to replay per admit
        said = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
        assert len(said) == 1 and "tenant bad" in said[0], said  # one line, not one a request
        t = await g.admit(hard, "h-1", "m", 10)  # the store is healthy: it serves the others
        assert t.store is g.shared
        await g.settle(t, 10)
    finally:
        await r.aclose()
        await g.close()


async def test_a_tenants_refused_settlement_does_not_lock_it_out(own_redis: RedisServer) -> None:
    # Review finding: a wrong-typed key of one of the tenant's model limits (X) poisoned one
    # deferred settlement, and every later admission of the tenant, for any model, first replayed
    # it, failed, and answered 503 (fail-closed) on a healthy Redis.
    g, metrics = make_gate(own_redis.url)
    t = tenant("acme", "closed", {"X": {"tpm": 50_000}, "Y": {"tpm": 50_000}})
    r = aioredis.from_url(own_redis.url)
    try:
        tx = await g.admit(t, "x-1", "X", 100)
        key = redis_store(g).keys.model_tpm("acme", "X")
        await r.delete(key)
        await r.hset(key, "another", "app")
        await g.settle(tx, 50)
        assert g.deferred == 1
        for i in range(4):
            ty = await g.admit(t, f"y-{i}", "Y", 10)  # model Y's keys are fine
            assert ty.store is g.shared and ty.admission is not None and ty.admission.allowed
            await g.settle(ty, 10)
        assert g.breaker.state.value == "closed"
        await wait_for(lambda: g.deferred == 0)  # given up, not retried for ever
        assert metric(metrics, FAILED) == 1
    finally:
        await r.aclose()
        await g.close()


# -- the replay after an outage --------------------------------------------------------------------


async def backlog(g: QuotaGate, t: Tenant, n: int) -> None:
    """n of `t`'s requests finish while the breaker is open: n deferred settlements."""
    tickets = [await g.admit(t, f"{t.name}-{i}", "m", 100) for i in range(n)]
    open_breaker(g)
    for x in tickets:
        await g.settle(x, 50)
    assert g.deferred == n


async def test_the_first_admission_after_an_outage_does_not_hold_the_probe_for_its_backlog(
    own_redis: RedisServer,
) -> None:
    # Review finding: the first admission after the cooldown took the breaker's one half-open
    # probe and replayed its tenant's whole backlog, one round trip each, before its own admit
    # and before telling the breaker: every other request of every tenant was refused (503, or
    # degraded limits) meanwhile; 10,000 deferred settlements blocked the fleet's tenants ~3 s.
    g, _ = make_gate(own_redis.url)
    # The replayer sleeps 1 s between tries, and the breaker lets a probe through 1.5 s after it
    # opened: the replayer's tries come at 1 s (too early) and 2 s, and the admission below, at
    # 1.5 s, is the probe. Long enough too that the probe is not replaced (a probe that never
    # reports is, after a cooldown) while the old code replayed the whole backlog.
    g.cfg = g.cfg.model_copy(update={"breaker_cooldown_s": 60.0})
    g.breaker.cooldown_s = 1.5
    n = 300
    a, b = tenant("a", "closed", concurrent=n + 1), tenant("b", "closed", concurrent=1000)
    try:
        await backlog(g, a, n)
        await wait_for(lambda: g.breaker.retry_after_s(time.monotonic()) == 0)  # its cooldown

        async def other(i: int) -> tuple[bool, Ticket | None]:
            """(whether `a`'s admission was still running when this one began, its ticket)"""
            during = not probe.done()
            try:
                return during, await g.admit(b, f"b-{i}", "m", 10)
            except APIError as e:
                assert e.code == "quota_store_unavailable"
                return during, None

        probe = asyncio.create_task(g.admit(a, "a-new", "m", 10))
        others: list[asyncio.Task[tuple[bool, Ticket | None]]] = []
        while not probe.done():  # one request of the other tenant per turn of the event loop
            others.append(asyncio.create_task(other(len(others))))
            await asyncio.sleep(0)
        left = g.deferred
        mine = await probe
        assert mine.store is g.shared
        answers = await asyncio.gather(*others)
        served = [x for _, x in answers if x is not None]
        assert any(during and x is not None for during, x in answers), (
            f"all {sum(during for during, _ in answers)} requests of b that came while a's "
            "admission ran were refused"
        )
        # The admission replayed a few of its tenant's backlog, not all of it ...
        assert left > n // 2, left
        for x in [mine, *served]:
            await g.settle(x, 10)
        # ... and the replayer does the rest.
        await wait_for(lambda: g.deferred == 0)
        assert (await g.shared.usage("a"))["in_flight"] == 0
    finally:
        await g.close()


async def test_an_entry_is_replayed_once_by_admissions_and_the_replayer_together(
    own_redis: RedisServer,
) -> None:
    # An admission replaying its tenant's backlog while the replayer walks the same entries sent
    # each settlement twice (harmless to the counts, settlement is idempotent, but twice the
    # round trips right after an outage, when the store is the busiest).
    g, metrics = make_gate(own_redis.url)
    n = 400
    a = tenant("a", "closed", concurrent=n + 1)
    r = aioredis.from_url(own_redis.url)
    try:
        warm = await g.admit(a, "warm", "m", 10)
        await g.settle(warm, 10)  # both scripts are loaded: every call below is one EVALSHA
        await backlog(g, a, n)
        await r.config_resetstat()
        g.breaker.record_success(time.monotonic())  # as a successful probe would
        # Until the replayer (0.2 s between tries) is under way; each turn of the event loop.
        while g.deferred == n:  # noqa: ASYNC110 (no event to wait on, and none needed)
            await asyncio.sleep(0)
        admitted = 0
        while g.deferred:  # meanwhile the tenant's own requests replay its backlog too
            x = await g.admit(a, f"again-{admitted}", "m", 10)
            await g.settle(x, 10)
            admitted += 1
        assert admitted > 0
        stats = await r.info("commandstats")
        calls = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))
        assert calls == n + 2 * admitted  # each deferred settlement once, each admission's two
        assert metric(metrics, REPLAYED) == n
        assert (await g.shared.usage("a"))["in_flight"] == 0
    finally:
        await r.aclose()
        await g.close()
