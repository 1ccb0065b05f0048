"""What only the Redis backend has: key layout on the wire, script caching, outages, many gateways."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from bench.redis_server import RedisServer, ping
from gateway.quota import ModelLimits, QuotaStoreUnavailable, Reservation, TenantLimits
from gateway.quota_memory import MemoryQuotaStore
from gateway.quota_redis import _ADMIT, RedisQuotaStore

from .conftest import FakeClock

LIM = TenantLimits(
    rpm=60,
    tpm=6000,
    max_concurrent=10,
    per_model={"org/llama:lora-1": ModelLimits(rpm=30, tpm=3000)},
)


def store_at(url: str, prefix: str) -> RedisQuotaStore:
    """Production-short timeouts would make these tests flaky on a loaded machine; the outage
    tests below use short ones on purpose."""
    return RedisQuotaStore(url, prefix=prefix, socket_timeout_s=2.0, op_timeout_s=5.0)


def rq(rid: str, tenant: str = "acme", model: str = "org/llama:lora-1") -> Reservation:
    return Reservation(tenant, rid, model, 100, LIM)


async def test_keys_share_a_hash_tag_expire_and_match_the_memory_layout(
    redis_server: RedisServer, prefix: str, clock: FakeClock
) -> None:
    redis_store = store_at(redis_server.url, prefix)
    memory_store = MemoryQuotaStore(prefix=prefix, clock=clock)
    for store in (redis_store, memory_store):
        assert (await store.admit(rq("r1"))).allowed
        assert (await store.admit(rq("r2"))).allowed
        await store.settle("acme", "r1", 50, limits=LIM)
        assert (await store.admit(rq("x1", tenant="other", model="plain"))).allowed

    client = redis_store.client
    keys = sorted(k.decode() for k in await client.keys(f"{prefix}*"))
    acme = [k for k in keys if k.startswith(f"{prefix}{{t:acme}}:")]
    assert set(acme) == {
        f"{prefix}{{t:acme}}:rpm",
        f"{prefix}{{t:acme}}:tpm",
        f"{prefix}{{t:acme}}:m:org/llama:lora-1:rpm",
        f"{prefix}{{t:acme}}:m:org/llama:lora-1:tpm",
        f"{prefix}{{t:acme}}:leases",
        f"{prefix}{{t:acme}}:res:r1",
        f"{prefix}{{t:acme}}:res:r2",
    }
    # Redis Cluster hashes only the tag: one tenant, one slot.
    assert len({key_slot(k.encode()) for k in acme}) == 1
    assert all(k.startswith(f"{prefix}{{t:other}}:") for k in keys if k not in acme)
    # Nothing grows forever: every key carries a TTL.
    for k in keys:
        assert await client.pttl(k) > 0, k
    # The settled marker is short-lived; the open reservation outlives its lease.
    settled_ttl = await client.pttl(f"{prefix}{{t:acme}}:res:r1")
    open_ttl = await client.pttl(f"{prefix}{{t:acme}}:res:r2")
    assert settled_ttl < open_ttl
    assert open_ttl > LIM.lease_ttl_s * 1000
    # The memory backend is a faithful stand-in: same keys.
    assert memory_store.keys_in_use() == keys
    await redis_store.close()


async def test_script_flush_falls_back_to_eval_and_recaches(
    redis_server: RedisServer, prefix: str
) -> None:
    store = store_at(redis_server.url, prefix)
    assert (await store.admit(rq("a"))).allowed
    await store.client.script_flush()
    assert await store.client.script_exists(_ADMIT.sha) == [False]
    assert (await store.admit(rq("b"))).allowed
    assert store.use_evalsha  # NOSCRIPT is routine: keep using EVALSHA
    assert await store.client.script_exists(_ADMIT.sha) == [True]
    await store.close()


async def test_a_server_that_forbids_evalsha_and_script_gets_plain_eval(prefix: str) -> None:
    # What a restrictive proxy looks like to a client: the commands do not exist.
    cfg = ['rename-command EVALSHA ""', 'rename-command SCRIPT ""']
    with RedisServer(extra_config=cfg) as server:
        store = store_at(server.url, prefix)
        assert (await store.admit(rq("a"))).allowed
        assert not store.use_evalsha
        assert (await store.admit(rq("b"))).allowed
        assert (await store.settle("acme", "a", 10, limits=LIM)).status == "settled"
        await store.close()


async def test_redis_down_raises_unavailable_quickly_and_recovers_after_restart(
    own_redis: RedisServer, prefix: str
) -> None:
    store = store_at(own_redis.url, prefix)
    assert (await store.admit(rq("before"))).allowed
    own_redis.kill()
    for call in (
        store.admit(rq("during")),
        store.settle("acme", "before", 10, limits=LIM),
        store.usage("acme", LIM),
        store.ping(),
    ):
        t0 = time.monotonic()
        with pytest.raises(QuotaStoreUnavailable, match="unreachable"):
            await call
        assert time.monotonic() - t0 < 3.0  # refused connections fail at once; generous bound
    own_redis.start()
    assert ping(own_redis.host, own_redis.port)
    # Same store object, same pool: the dead connections are replaced transparently.
    assert (await store.admit(rq("after"))).allowed
    assert (await store.settle("acme", "after", 10, limits=LIM)).status == "settled"
    await store.close()


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port that accepts TCP connections and never answers: a hung Redis."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


async def test_a_hung_redis_times_out_as_unavailable(black_hole: int, prefix: str) -> None:
    store = RedisQuotaStore(
        f"redis://127.0.0.1:{black_hole}/0",
        prefix=prefix,
        socket_timeout_s=0.1,
        connect_timeout_s=0.1,
        op_timeout_s=0.3,
    )
    t0 = time.monotonic()
    with pytest.raises(QuotaStoreUnavailable):
        await store.admit(rq("a"))
    assert time.monotonic() - t0 < 3.0
    with contextlib.suppress(Exception):
        await store.close()


async def test_two_gateways_sharing_redis_enforce_one_global_limit(
    redis_server: RedisServer, prefix: str
) -> None:
    lim = TenantLimits(rpm=60, burst_requests=10)
    gateways = [store_at(redis_server.url, prefix) for _ in range(2)]
    t0 = time.monotonic()
    results = await asyncio.gather(
        *(gateways[i % 2].admit(Reservation("acme", f"r{i}", "m", 1, lim)) for i in range(200))
    )
    elapsed = time.monotonic() - t0
    per_gateway = [sum(a.allowed for a in results[i::2]) for i in range(2)]
    admitted = sum(per_gateway)
    assert admitted <= 60 + 10
    # Tighter: the burst, plus at most what one cell per second refilled meanwhile.
    assert 10 <= admitted <= 10 + 1 + int(elapsed)
    assert all(n > 0 for n in per_gateway)  # both really took part
    for g in gateways:
        await g.close()


async def test_a_separate_connection_sees_the_same_state(
    redis_server: RedisServer, prefix: str
) -> None:
    """Keys are plain Redis values other tools can inspect (dashboards, ops)."""
    store = store_at(redis_server.url, prefix)
    await store.admit(rq("a"))
    other = Redis.from_url(redis_server.url)
    assert await other.zrange(f"{prefix}{{t:acme}}:leases", 0, -1) == [b"a"]
    assert await other.hget(f"{prefix}{{t:acme}}:res:a", "state") == b"open"
    await other.aclose()
    await store.close()
