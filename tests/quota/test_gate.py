"""QuotaGate across a Redis outage: settlements that could not reach Redis are replayed when it
answers again, so leases and token charges come right without waiting for lease expiry.

Real redis-server processes only. The persistent one (AOF, fsync on every write) comes back with
the open reservations it held, as a Redis restarted or failed over with its data would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from bench.redis_server import RedisServer
from gateway.config import QuotaSettings, TenantSettings
from gateway.metrics import GatewayMetrics
from gateway.quota import Admission, Reservation
from gateway.quota_gate import QuotaGate, Ticket, _refusal
from gateway.quota_redis import RedisQuotaStore
from gateway.tenancy import Tenant, _limits
from tests.gateway.conftest import flat_metrics

# Small enough that what was charged is still visible after the restart (decays 100 tokens/s).
TPM = 6000


def tenant(name: str = "a") -> Tenant:
    cfg = TenantSettings(rpm=1000, tpm=TPM, max_concurrent=4)
    return Tenant(name, cfg, _limits(cfg), "", "")


@pytest.fixture
def persistent_redis() -> Iterator[RedisServer]:
    with RedisServer(extra_config=["appendonly yes", "appendfsync always"]) as server:
        yield server


def make_gate(url: str, **over: object) -> tuple[QuotaGate, GatewayMetrics]:
    cfg = QuotaSettings(
        backend="redis",
        redis_url=url,
        key_prefix="gate:",
        breaker_failures=1,
        breaker_cooldown_s=0.2,
        # Generous: one slow round trip (a loaded host, an fsync per write here) must not open
        # the breaker; the outages in these tests are a killed server, refused at once.
        socket_timeout_s=2.0,
        op_timeout_s=5.0,
        **over,  # type: ignore[arg-type]
    )
    metrics = GatewayMetrics()
    return QuotaGate(cfg, metrics), metrics


@pytest.fixture
async def gate(persistent_redis: RedisServer) -> AsyncIterator[tuple[QuotaGate, GatewayMetrics]]:
    g, m = make_gate(persistent_redis.url)
    yield g, m
    await g.close()


async def open_states(url: str) -> list[str]:
    """The state of every reservation record still in Redis."""
    r = aioredis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter("gate:*")]
        states = []
        for k in keys:
            if await r.type(k) == b"hash":
                states.append((await r.hget(k, "state") or b"").decode())
        return states
    finally:
        await r.aclose()


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def admit_n(g: QuotaGate, t: Tenant, n: int, tokens: int = 1000) -> list[Ticket]:
    return [await g.admit(t, f"req-{i}", "m", tokens) for i in range(n)]


async def finish_during_an_outage(
    g: QuotaGate, server: RedisServer, t: Tenant, n: int, actual: int
) -> None:
    """n requests admitted, Redis killed, all n settled with `actual` tokens while it is down."""
    tickets = await admit_n(g, t, n)
    server.kill()
    for x in tickets:
        await g.settle(x, actual)


async def test_settlements_during_an_outage_are_replayed_when_redis_is_back(
    gate: tuple[QuotaGate, GatewayMetrics], persistent_redis: RedisServer
) -> None:
    g, metrics = gate
    t = tenant()
    tickets = await admit_n(g, t, 4)  # the tenant's whole max_concurrent
    assert (await g.shared.usage("a"))["in_flight"] == 4
    persistent_redis.kill()
    # The streams finish while Redis is down: two settled with real usage, two released.
    await g.settle(tickets[0], 100)
    await g.settle(tickets[1], 200)
    await g.release(tickets[2], refund_all=True)
    await g.release(tickets[3], refund_all=False)
    assert g.deferred == 4
    m = flat_metrics(generate_latest(metrics.registry).decode())
    assert m["kvgate_quota_deferred_settlements"] == 4
    assert m['kvgate_quota_store_circuit{state="closed"}'] == 0
    assert m['kvgate_tenant_in_flight{tenant="a"}'] == 0  # the gateway's own view is right

    persistent_redis.start()  # back with its data: four open reservations, four leases
    # No request arrives: the replayer itself probes the store and drains the backlog.
    await wait_for(lambda: g.deferred == 0)
    assert (await g.shared.usage("a"))["in_flight"] == 0
    assert sorted(await open_states(persistent_redis.url)) == ["settled"] * 4
    m = flat_metrics(generate_latest(metrics.registry).decode())
    assert m['kvgate_quota_deferred_settlements_outcomes_total{outcome="replayed"}'] == 4
    assert m["kvgate_quota_deferred_settlements"] == 0
    assert m['kvgate_quota_store_circuit{state="closed"}'] == 1
    # The tokens charged are the real ones (100 + 200), not four whole reservations.
    # Unreplayed, the four reservations (4,000) would still be charged.
    tokens = (await g.shared.usage("a", t.limits))["tokens"]
    assert tokens["remaining"] >= TPM - 300 - 5, tokens
    # And the tenant can use its four slots again at once, not after lease expiry.
    again = [await g.admit(t, f"after-{i}", "m", 10) for i in range(4)]
    for x in again:
        await g.settle(x, 10)


async def test_a_redis_that_came_back_empty_takes_the_replay_harmlessly() -> None:
    with RedisServer() as server:  # no persistence: a restart forgets everything
        g, _ = make_gate(server.url)
        try:
            await finish_during_an_outage(g, server, tenant(), 2, 50)
            assert g.deferred == 2
            server.start()
            await wait_for(lambda: g.deferred == 0)
            # Unknown reservations: nothing charged, no lease created by the replay.
            assert (await g.shared.usage("a"))["in_flight"] == 0
            assert await open_states(server.url) == []
        finally:
            await g.close()


async def test_the_backlog_is_bounded_and_the_oldest_fall_back_to_lease_expiry(
    persistent_redis: RedisServer,
) -> None:
    g, metrics = make_gate(persistent_redis.url, max_deferred_settlements=2)
    try:
        await finish_during_an_outage(g, persistent_redis, tenant(), 3, 10)
        assert g.deferred == 2
        m = flat_metrics(generate_latest(metrics.registry).decode())
        assert m['kvgate_quota_deferred_settlements_outcomes_total{outcome="dropped"}'] == 1
        persistent_redis.start()
        await wait_for(lambda: g.deferred == 0)
        # The dropped one (the oldest) keeps its lease until it expires; the others are free.
        assert (await g.shared.usage("a"))["in_flight"] == 1
        assert sorted(await open_states(persistent_redis.url)) == ["open", "settled", "settled"]
    finally:
        await g.close()


async def test_a_tenants_backlog_is_settled_before_its_next_admission(
    gate: tuple[QuotaGate, GatewayMetrics], persistent_redis: RedisServer
) -> None:
    # Right after Redis is back the replayer may not have run yet; the tenant's own stale
    # leases must not make its first new request a 429.
    g, _ = gate
    # The replayer then sleeps 1 s between tries: this admission comes before it wakes.
    g.cfg = g.cfg.model_copy(update={"breaker_cooldown_s": 60.0})
    t = tenant()
    await finish_during_an_outage(g, persistent_redis, t, 4, 10)  # 4 = max_concurrent
    assert g.deferred == 4
    persistent_redis.start()
    g.breaker.record_success(time.monotonic())  # as a successful probe would
    fresh = await g.admit(t, "after", "m", 10)  # would be refused: 4 stale leases of 4
    assert fresh.admission is not None and fresh.admission.allowed
    assert g.deferred == 0
    assert (await g.shared.usage("a"))["in_flight"] == 1
    await g.settle(fresh, 10)


def test_a_concurrency_refusal_names_the_keys_limit_not_the_leases_it_counted() -> None:
    # Several replicas can count more leases than the limit: the message names the limit.
    adm = Admission(allowed=False, dimension="concurrency", in_flight=5, retry_after_s=1.0)
    e = _refusal(adm, "m", 10, max_concurrent=2)
    assert e.status == 429 and "(limit 2)" in e.message


async def store_snapshot(url: str) -> dict[bytes, object]:
    """Every key under the gate's prefix with its value, whatever its type: what a store
    operation changed shows as a difference (the rate cells hold absolute times, which do not
    move by themselves as the remaining budget a `usage` computes does)."""
    r = aioredis.from_url(url)
    try:
        out: dict[bytes, object] = {}
        async for k in r.scan_iter("gate:*"):
            kind = await r.type(k)
            if kind == b"string":
                out[k] = await r.get(k)
            elif kind == b"hash":
                out[k] = await r.hgetall(k)
            elif kind == b"zset":
                out[k] = await r.zrange(k, 0, -1, withscores=True)
            else:
                out[k] = kind
        return out
    finally:
        await r.aclose()


async def test_an_admit_cancelled_after_the_store_ran_it_is_refunded_by_shutdown(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review finding: a drain whose grace ends cancels walks not yet sent to a worker, one of
    # them inside `admit` after Redis ran the admission script but before its reply arrived.
    # No ticket came back to release it, so its reservation and lease stayed until the lease
    # TTL (15 min), counted against the tenant's `max_concurrent` on every replica.
    g, _ = make_gate(own_redis.url)
    # The replayer then sleeps 1 s between tries: the shutdown's own flush (`close`) is what
    # frees it here, as it is when a drain ends the process.
    g.cfg = g.cfg.model_copy(update={"breaker_cooldown_s": 60.0})
    t = tenant()
    real_admit = g.shared.admit
    ran = asyncio.Event()

    async def reply_pending(res: Reservation) -> Admission:
        adm = await real_admit(res)  # the script ran: reservation and lease are in Redis
        ran.set()
        await asyncio.Event().wait()  # its reply is still on the wire when the cut comes
        return adm

    monkeypatch.setattr(g.shared, "admit", reply_pending)
    try:
        walk = asyncio.create_task(g.admit(t, "cut", "m", 1000))
        await ran.wait()
        assert (await g.shared.usage("a"))["in_flight"] == 1
        walk.cancel()
        with pytest.raises(asyncio.CancelledError):
            await walk
        assert g.breaker.state.value == "closed"  # a cancel is not a store failure
    finally:
        await g.close()
    check = RedisQuotaStore(own_redis.url, prefix="gate:")
    try:
        assert (await check.usage("a"))["in_flight"] == 0  # the lease is free
    finally:
        await check.close()
    assert await open_states(own_redis.url) == ["settled"]  # the reservation refunded


async def test_an_admit_cancelled_before_the_store_ran_it_changes_nothing_there(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cut may also land before the script reached Redis: the refund sent when in doubt
    # must then find nothing to refund. Were it credited, a client's cut requests would buy it
    # budget back for tokens it never reserved.
    g, _ = make_gate(own_redis.url)
    t = tenant()
    spent = await g.admit(t, "spent", "m", 3000)
    await g.settle(spent, 3000)  # the tenant has used half its TPM: a refund would show
    before = await store_snapshot(own_redis.url)
    reached = asyncio.Event()

    async def never_sent(res: Reservation) -> Admission:
        reached.set()
        await asyncio.Event().wait()  # cancelled before the script is sent
        raise AssertionError("unreachable")

    monkeypatch.setattr(g.shared, "admit", never_sent)
    try:
        walk = asyncio.create_task(g.admit(t, "cut", "m", 3000))
        await reached.wait()
        walk.cancel()
        with pytest.raises(asyncio.CancelledError):
            await walk
        assert g.deferred == 1
    finally:
        await g.close()  # applies the refund for "cut", which Redis never saw
    assert g.deferred == 0  # it was applied, not dropped
    assert await store_snapshot(own_redis.url) == before


@pytest.mark.parametrize("kind", ["release", "settle"])
async def test_a_settlement_cancelled_on_its_way_to_the_store_is_sent_later(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # Review finding: a release (or settle) cancelled while its call to a slow Redis was on the
    # wire was lost: the ticket was done, so a second call did nothing, and the tenant's lease
    # (max_concurrent 1: its next request a 429) and reservation stayed until the lease TTL.
    g, _ = make_gate(own_redis.url)
    g.cfg = g.cfg.model_copy(update={"breaker_cooldown_s": 60.0})
    t = tenant()
    ticket = await g.admit(t, "cut", "m", 1000)
    sent = asyncio.Event()
    real = getattr(g.shared, kind)

    async def slow(*args: object, **kw: object) -> object:
        if not sent.is_set():  # the first call: the store has not answered when the cut comes
            sent.set()
            await asyncio.Event().wait()
        return await real(*args, **kw)  # the replay (by the replayer or `close`)

    monkeypatch.setattr(g.shared, kind, slow)
    try:
        if kind == "release":
            call = asyncio.create_task(g.release(ticket, refund_all=True))
        else:
            call = asyncio.create_task(g.settle(ticket, 400))
        await sent.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert g.breaker.state.value == "closed"  # a cancel is not a store failure
    finally:
        await g.close()  # sends what was deferred
    assert g.deferred == 0
    check = RedisQuotaStore(own_redis.url, prefix="gate:")
    try:
        assert (await check.usage("a"))["in_flight"] == 0  # the lease is free
    finally:
        await check.close()
    assert await open_states(own_redis.url) == ["settled"]


async def test_a_settlement_whose_metric_raises_still_frees_the_lease(
    gate: tuple[QuotaGate, GatewayMetrics],
) -> None:
    # Review finding: a worker's usage of 1e308 tokens made the settled-tokens counter raise
    # OverflowError after the ticket was closed, so the lease stayed until its TTL (900 s) and
    # max_concurrent such answers locked the tenant out. Usage counts are now bounded
    # (gateway.call.MAX_COUNT); the lease is freed whatever a metric raises.
    g, m = gate
    t = tenant()
    tickets = await admit_n(g, t, 4)  # max_concurrent=4: the tenant is full
    child = m.child

    def overflowing(family: object, *labels: str) -> object:
        if family is m.tenant_tokens and labels[-1] == "settled":
            raise OverflowError("int too large to convert to float")
        return child(family, *labels)  # type: ignore[arg-type]

    m.child = overflowing  # type: ignore[method-assign]
    with pytest.raises(OverflowError):
        await g.settle(tickets[0], 10)
    m.child = child  # type: ignore[method-assign]
    for k in tickets[1:]:
        await g.settle(k, 10)
    again = [await g.admit(t, f"again-{i}", "m", 1000) for i in range(4)]
    assert len(again) == 4  # every lease came back
