"""A replica SIGKILLed with load in flight leaves its snapshot in Redis. Its siblings stop counting
it ``expiry_s`` after its last heartbeat and delete the field; a replica that starts in that
window (the supervisor's restart of that very child) used to count it as live for a full
``expiry_s`` from its own start, and kept counting it after the field was gone: phantom load for
up to twice ``expiry_s``, its workers full under `max_concurrency`. Real redis-server."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis

from bench.redis_server import RedisServer
from gateway.cluster import ClusterSync
from gateway.config import ClusterSettings
from workers.registry import Registry
from workers.worker import WorkerSpec


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cfg(prefix: str, expiry_s: float) -> ClusterSettings:
    return ClusterSettings(
        enabled=True,
        expiry_s=expiry_s,
        publish_interval_s=0.05,
        op_timeout_s=5.0,
        key_prefix=prefix,
        share_learned=False,
    )


def _registry() -> Registry:
    return Registry([WorkerSpec("w0", "http://x:1", max_concurrency=64)])


async def _fields(admin: Redis, key: str) -> set[str]:
    return {k.decode() for k in await admin.hkeys(key)}


async def test_a_restarted_child_drops_the_dead_peer_once_a_sibling_deleted_it(
    redis: RedisServer,
) -> None:
    """The reviewer's reproducer, on one injected clock: the dead child wrote once (its snapshot
    undated), the restart reads it 2.8 s after the death, and the sibling deletes it at ~3 s.
    Before, the restart counted it until 5.8 s."""
    prefix = "kvt:{dead-undated}:"
    key = prefix + "load"
    cfg = _cfg(prefix, 3.0)
    clock = Clock()
    rd, rb, rr = _registry(), _registry(), _registry()
    d = ClusterSync(cfg, rd, redis_url=redis.url, replica_id="child0-pid100", clock=clock)
    b = ClusterSync(cfg, rb, redis_url=redis.url, replica_id="child1-pid101", clock=clock)
    r = ClusterSync(cfg, rr, redis_url=redis.url, replica_id="child0-pid200", clock=clock)
    admin = Redis.from_url(redis.url)
    try:
        rd.workers["w0"].in_flight = 50
        assert await d.sync_once() and await b.sync_once()
        assert rb.workers["w0"].remote_in_flight == 50
        await d.client.aclose()  # SIGKILLed: no last write, its field stays
        for _ in range(28):
            clock.t += 0.1
            assert await b.sync_once()
        assert await r.sync_once()  # the restart's first read: the dead field is there
        assert "child0-pid100" in await _fields(admin, key)
        steps = 0
        while "child0-pid100" in await _fields(admin, key):  # until the sibling deletes it
            steps += 1
            assert steps < 20, "the sibling never deleted the dead peer's field"
            clock.t += 0.1
            assert await b.sync_once() and await r.sync_once()
        assert rb.workers["w0"].remote_in_flight == 0
        assert await r.sync_once()  # the restart's first read without it
        assert rr.workers["w0"].remote_in_flight == 0
        assert r.view.live() == ["child1-pid101"]
    finally:
        for s in (b, r):
            await s.stop()
        await admin.aclose()


async def test_a_new_reader_ages_a_dead_snapshot_on_redis_clock(redis: RedisServer) -> None:
    """Real clocks (Redis' TIME only moves in real time): the dead child wrote twice, so its last
    snapshot is dated; more than twice ``expiry_s`` passes with nobody reading (every replica
    died); a replica starting then counts none of it from its first read and deletes the field
    on its next, while a live peer's load counts at once."""
    prefix = "kvt:{dead-dated}:"
    key = prefix + "load"
    expiry_s = 1.0
    cfg = _cfg(prefix, expiry_s)
    rd, rb, rr = _registry(), _registry(), _registry()
    d = ClusterSync(cfg, rd, redis_url=redis.url, replica_id="dead", clock=time.monotonic)
    b = ClusterSync(cfg, rb, redis_url=redis.url, replica_id="live", clock=time.monotonic)
    r = ClusterSync(cfg, rr, redis_url=redis.url, replica_id="fresh", clock=time.monotonic)
    admin = Redis.from_url(redis.url)
    try:
        rd.workers["w0"].in_flight = 50
        assert await d.sync_once() and await d.sync_once()
        await d.client.aclose()  # SIGKILLed
        await asyncio.sleep(2.2 * expiry_s)
        rb.workers["w0"].in_flight = 7
        assert await b.sync_once()  # another replica starting: it reads the dead field too
        assert await r.sync_once()
        assert rr.workers["w0"].remote_in_flight == 7  # the live peer's alone
        assert r.view.expired() == ["dead"] and r.view.live() == ["live"]
        assert await r.sync_once()  # its second read deletes the field, alone
        assert await _fields(admin, key) == {"fresh", "live"}
        assert rr.workers["w0"].remote_in_flight == 7
        assert await b.sync_once()
        assert rb.workers["w0"].remote_in_flight == 0 and b.view.live() == ["fresh"]
    finally:
        for s in (b, r):
            await s.stop()
        await admin.aclose()
