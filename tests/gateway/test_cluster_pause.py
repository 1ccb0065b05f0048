"""A replica whose process was paused past ``expiry_s`` (SIGSTOP, a long GC, a CPU-starved
container) with Redis reachable all along: on its first sync back every peer looks expired to its
view, which read nothing meanwhile. It deleted their live snapshots then, and a replica starting
in that window (a restarted `--processes` child) counted none of their load. A peer that really
went quiet is still deleted. Real redis-server; each replica on a clock of its own."""

from __future__ import annotations

from redis.asyncio import Redis

from bench.redis_server import RedisServer
from gateway.cluster import ClusterSync
from gateway.config import ClusterSettings
from workers.registry import Registry
from workers.worker import WorkerSpec

EXPIRY_S = 3.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cfg(prefix: str) -> ClusterSettings:
    return ClusterSettings(
        enabled=True, expiry_s=EXPIRY_S, op_timeout_s=5.0, key_prefix=prefix, share_learned=False
    )


def _registry() -> Registry:
    return Registry([WorkerSpec("w0", "http://w0", max_concurrency=4)])


async def _fields(admin: Redis, key: str) -> set[str]:
    return {k.decode() for k in await admin.hkeys(key)}


async def test_a_replica_back_from_a_pause_deletes_no_live_peers_load(redis: RedisServer) -> None:
    prefix = "kvt:{pause-live}:"
    cfg = _cfg(prefix)
    ca, cb, cc = Clock(), Clock(), Clock()
    ra, rb, rc = _registry(), _registry(), _registry()
    a = ClusterSync(cfg, ra, redis_url=redis.url, replica_id="a", clock=ca)
    b = ClusterSync(cfg, rb, redis_url=redis.url, replica_id="b", clock=cb)
    c = ClusterSync(cfg, rc, redis_url=redis.url, replica_id="c", clock=cc)
    admin = Redis.from_url(redis.url)
    try:
        rb.workers["w0"].in_flight = 4
        for _ in range(2):
            assert await a.sync_once() and await b.sync_once()
        assert ra.workers["w0"].remote_in_flight == 4 and a.state == "ok"
        # A is paused 4 s (> expiry_s): its clock jumps, B syncs every 50 ms meanwhile.
        for _ in range(80):
            cb.t += 0.05
            assert await b.sync_once()
        ca.t += 4.0
        assert await a.sync_once()  # A's first sync after the pause
        assert await _fields(admin, prefix + "load") == {"a", "b"}
        assert await c.sync_once()  # a replica starting right then
        assert rc.workers["w0"].remote_in_flight == 4
        # ... and A, reading again, counts B as it did.
        ca.t += 0.05
        assert await a.sync_once()
        assert ra.workers["w0"].remote_in_flight == 4
        assert await _fields(admin, prefix + "load") == {"a", "b", "c"}
    finally:
        for s in (a, b, c):
            await s.stop()
        await admin.aclose()


async def test_a_peer_that_went_quiet_is_still_deleted_after_a_pause(redis: RedisServer) -> None:
    """D dies (no last write) while A runs; A is then paused. D's field goes once A has read
    Redis again and still finds D's heartbeat where it stopped; B's live one stays."""
    prefix = "kvt:{pause-dead}:"
    cfg = _cfg(prefix)
    ca, cb, cd = Clock(), Clock(), Clock()
    ra, rb, rd = _registry(), _registry(), _registry()
    a = ClusterSync(cfg, ra, redis_url=redis.url, replica_id="a", clock=ca)
    b = ClusterSync(cfg, rb, redis_url=redis.url, replica_id="b", clock=cb)
    d = ClusterSync(cfg, rd, redis_url=redis.url, replica_id="d", clock=cd)
    admin = Redis.from_url(redis.url)
    key = prefix + "load"
    try:
        rd.workers["w0"].in_flight = 2
        # Twice: A and B see D's heartbeat move (a peer seen once, undated, and then deleted by
        # another reader is dropped at once: test_cluster_dead_peer_new_reader.py).
        for _ in range(2):
            assert await d.sync_once() and await a.sync_once() and await b.sync_once()
        assert ra.workers["w0"].remote_in_flight == 2
        await d.client.aclose()  # D is killed: its field stays, its heartbeat stops
        for _ in range(10):  # 1 s of A and B reading
            ca.t += 0.1
            cb.t += 0.1
            assert await a.sync_once() and await b.sync_once()
        ca.t += 4.0  # A paused past expiry_s; B's clock moves little: A alone can delete D
        assert await a.sync_once() and await b.sync_once()
        assert "b" in await _fields(admin, key)
        for _ in range(3):
            ca.t += 0.05
            cb.t += 0.05
            assert await a.sync_once() and await b.sync_once()
        assert await _fields(admin, key) == {"a", "b"}
        assert ra.workers["w0"].remote_in_flight == 0
        assert rb.workers["w0"].remote_in_flight == 2  # B has not seen D quiet for expiry_s
    finally:
        for s in (a, b):
            await s.stop()
        await admin.aclose()
