"""What other replicas write to the shared store is not trusted to be well formed (another
version, a bug, a replica killed mid-rollout), and nothing they write may break this replica's
sync or grow its memory: a learned batch whose tail layout does not fit its chain is skipped and
counted, a note that fails to replay costs that note alone (one log line, not a traceback a
sync), a snapshot field that does not decode is counted once and deleted once it stops moving.
And a reloaded ``op_timeout_s`` reaches the Redis client's sockets. Real redis-server."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from bench.redis_server import RedisServer
from gateway.cluster import ClusterSync
from gateway.config import ClusterSettings
from scoring.learned import Learned
from scoring.state import RoutingState
from workers.learned_share import encode_batch
from workers.registry import Registry
from workers.worker import WorkerSpec


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def replica(
    redis: RedisServer, prefix: str, **kw: Any
) -> tuple[ClusterSync, RoutingState, ClusterSettings]:
    cfg = ClusterSettings(enabled=True, key_prefix=prefix, op_timeout_s=5.0, **kw)
    state = RoutingState()
    reg = Registry([WorkerSpec("w0", "http://w0"), WorkerSpec("w1", "http://w1")])
    s = ClusterSync(cfg, reg, redis_url=redis.url, replica_id="me", state=state)
    return s, state, cfg


async def publish(redis: RedisServer, cfg: ClusterSettings, seq: int, blob: bytes) -> None:
    admin = Redis.from_url(redis.url)
    try:
        await admin.xadd(cfg.key_prefix + "learned", {"r": "peer", "s": seq, "b": blob})
    finally:
        await admin.aclose()


async def test_a_batch_whose_tails_do_not_fit_its_chain_is_skipped_and_the_sync_goes_on(
    redis: RedisServer,
) -> None:
    """Five entries past a one-block head, two tail ends: the index read past the list's end,
    the IndexError left the sync, and the batch's other rows and the ones behind it waited on a
    sync that raised again."""
    s, state, cfg = replica(redis, "kvt:{untrusted-short}:")
    short = Learned("w0", (1, 2, 3, 4, 5), 1, (2,), None, 10, 0.0)
    await publish(redis, cfg, 1, encode_batch(state.key, [short], 0.0))
    good = Learned("w1", (11, 12, 13), 3, (), "sess", 10, 0.0)
    await publish(redis, cfg, 2, encode_batch(state.key, [good], 0.0))
    try:
        for _ in range(3):
            assert await s.sync_once()
        assert s.learned_malformed == 1
        assert state.sessions.get("sess", time.monotonic()) == "w1"
        assert state.index.match((11, 12, 13)) == {"w1": 3}
        assert state.index.entries("w0") == 0
    finally:
        await s.stop()


async def test_tails_weighing_nothing_do_not_grow_the_index_past_its_capacity(
    redis: RedisServer,
) -> None:
    """Tail entries whose ends do not increase weighed 0 blocks: no capacity ever evicted them
    (2,000 such notes held 2,000,000 entries, 182 MB, on a 16,384-block worker)."""
    s, state, cfg = replica(redis, "kvt:{untrusted-flat}:")
    state.index.set_capacity("w0", 64)
    rows = [
        Learned("w0", tuple(range(b * 1000, b * 1000 + 100)), 0, (0,) * 100, None, 10, 0.0)
        for b in range(1, 21)
    ]
    await publish(redis, cfg, 1, encode_batch(state.key, rows, 0.0))
    try:
        for _ in range(3):
            assert await s.sync_once()
        assert state.index.entries("w0") <= 64
        assert s.learned_malformed == 1
    finally:
        await s.stop()


async def test_a_note_that_fails_to_replay_costs_that_note_alone(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever slips past the decoder and raises in the replay: before, the exception left the
    sync (the rest of its chunk lost, a traceback a sync from a peer that keeps writing such
    notes); now the note is skipped and counted, its neighbours applied, one line logged."""
    s, state, cfg = replica(redis, "kvt:{untrusted-raise}:")
    record = state.index.record
    poison = (666, 667)

    def record_or_raise(worker: str, chain: Any, **kw: Any) -> tuple[int, int]:
        if tuple(chain) == poison:
            raise ValueError("a note this version cannot replay")
        return record(worker, chain, **kw)

    state.index.record = record_or_raise  # type: ignore[method-assign]
    rows = [Learned("w0", (1, 2), 2, (), "s-first", 10, 0.0)]
    rows += [Learned("w1", poison, 2, (), None, 10, 0.0)] * 50
    rows += [Learned("w0", (3, 4), 2, (), "s-last", 10, 0.0)]
    await publish(redis, cfg, 1, encode_batch(state.key, rows, 0.0))
    caplog.set_level(logging.WARNING, logger="kvgate.cluster")
    try:
        for _ in range(3):
            assert await s.sync_once()
        now = time.monotonic()
        assert state.sessions.get("s-first", now) == "w0"
        assert state.sessions.get("s-last", now) == "w0"
        assert state.index.match((1, 2)) == {"w0": 2} and state.index.match((3, 4)) == {"w0": 2}
        assert s.learned_malformed == 50
        assert s.learned_applied == 2
        lines = [r for r in caplog.records if "could not be replayed" in r.getMessage()]
        assert len(lines) == 1 and lines[0].exc_info is None
    finally:
        await s.stop()


async def test_an_undecodable_snapshot_field_counts_once_and_is_deleted_once_dead(
    redis: RedisServer,
) -> None:
    """A newer replica's field (SIGKILLed during a rollback) and a field whose name is not even
    UTF-8: each counted once, and deleted after ``expiry_s`` without a change, like a silent
    peer's. Before: counted on every sync, and kept in Redis for good (the hash's PEXPIRE,
    renewed every sync, kept it alive)."""
    clock = Clock()
    prefix = "kvt:{untrusted-load}:"
    cfg = ClusterSettings(enabled=True, key_prefix=prefix, op_timeout_s=5.0, share_learned=False)
    reg = Registry([WorkerSpec("w0", "http://w0")])
    s = ClusterSync(cfg, reg, redis_url=redis.url, replica_id="me", clock=clock)
    admin = Redis.from_url(redis.url)
    key = prefix + "load"
    await admin.hset(key, "newer-replica", orjson.dumps({"v": 2, "seq": 5, "w": {}}))
    await admin.hset(key, b"\xff\xfe", b"\x00 garbage")
    try:
        for _ in range(20):
            assert await s.sync_once()
            clock.t += 0.5  # 10 s in all: past the 3 s expiry
        assert s.view.malformed == 2
        assert await admin.hkeys(key) == [b"me"]
    finally:
        await s.stop()
        await admin.aclose()


async def test_a_reloaded_op_timeout_reaches_the_clients_sockets(redis: RedisServer) -> None:
    """op_timeout_s 0.3 -> 5.0 by a reload, then Redis stalls 1 s: the round trip must wait for
    it. Before, the client's socket timeout stayed 0.3 s (fixed when it was built), and the
    sync failed (degraded) whatever the reload said."""
    prefix = "kvt:{untrusted-timeout}:"
    reg = Registry([WorkerSpec("w0", "http://w0")])
    cfg = ClusterSettings(enabled=True, key_prefix=prefix, op_timeout_s=0.3, share_learned=False)
    s = ClusterSync(cfg, reg, redis_url=redis.url, replica_id="me")
    stall = Redis.from_url(redis.url, socket_timeout=30)
    sleeping: asyncio.Task[Any] | None = None
    try:
        assert await s.sync_once()
        s.configure(cfg.model_copy(update={"op_timeout_s": 5.0}))
        sleeping = asyncio.create_task(stall.execute_command("DEBUG", "SLEEP", "1.0"))
        await asyncio.sleep(0.1)  # the stall is under way
        assert await s.sync_once()
        assert s.state == "ok" and s.failures == 0
        assert s.client.connection_pool.connection_kwargs["socket_timeout"] == 5.0
    finally:
        if sleeping is not None:
            await sleeping
        await s.stop()
        await stall.aclose()
