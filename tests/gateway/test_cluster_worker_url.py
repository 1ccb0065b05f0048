"""A rollout points worker w0 at a new server: replica A has reloaded, B has not and still sends
w0's traffic to the old server. A's w0 (the new server, idle) counts none of B's load on the old
one, and B's w0 none of A's on the new one. Before, shared load matched by name alone: A's new
server showed B's 4 requests (room 0), and A's requests queued or were refused while it sat
idle. A peer of the previous version names workers alone, and still counts by name (a rolling
upgrade). Real redis-server, two in-process gateways synced tick by tick."""

from __future__ import annotations

import orjson
from redis.asyncio import Redis

from bench.redis_server import RedisServer
from tests.gateway.cluster_pair import (
    CAP,
    CARDS,
    NEW,
    OLD,
    pair_settings,
    replicas,
    tick,
)


async def test_a_peers_load_on_another_server_of_the_same_name_is_not_counted(
    redis: RedisServer,
) -> None:
    prefix = "kvt:{url-rollout}:"
    # A has reloaded (w0 is the new server); B not yet.
    async with replicas(redis.url, prefix, NEW, OLD) as (a, b):
        wa, wb = a.registry.workers["w0"], b.registry.workers["w0"]
        for _ in range(CAP):
            wb.dispatched(100)  # B fills the old server
        wa.dispatched(100)  # A runs one on the new
        for w in (a.registry.workers["w1"], b.registry.workers["w1"]):
            w.dispatched(10)  # w1 is the same server on both: shared as before
        await tick(a, b)
        await tick(a, b)
        assert (wa.remote_in_flight, wa.remote_prefill_tokens) == (0, 0)
        assert a.slots.worker_room(wa) == CAP - 1
        assert (wb.remote_in_flight, wb.remote_prefill_tokens) == (0, 0)
        assert b.slots.worker_room(wb) == 0
        assert a.registry.workers["w1"].remote_in_flight == 1
        assert b.registry.workers["w1"].remote_in_flight == 1
        # B reloads too: both now run w0 at the new server, and count each other there.
        b.apply(pair_settings(redis.url, prefix, NEW))
        b.registry.probe_ok("w0", CARDS, None)
        nb = b.registry.workers["w0"]
        nb.dispatched(100)
        await tick(a, b)
        await tick(a, b)
        assert wa.remote_in_flight == 1 and nb.remote_in_flight == 1


async def test_an_older_peer_that_names_no_url_counts_by_name(redis: RedisServer) -> None:
    """A replica of the previous version (rolling upgrade) publishes name -> load only: its
    load counts into this replica's worker of that name, whatever its URL, as it did."""
    prefix = "kvt:{url-older}:"
    admin = Redis.from_url(redis.url)
    async with replicas(redis.url, prefix, NEW) as (a,):
        for seq in (1, 2):  # the older replica's heartbeat moves
            await admin.hset(
                prefix + "load",
                "older-replica",
                orjson.dumps({"v": 1, "seq": seq, "w": {"w0": [3, 300], "w1": [1, 0]}}),
            )
            await tick(a)
        wa = a.registry.workers["w0"]
        assert (wa.remote_in_flight, wa.remote_prefill_tokens) == (3, 300)
        assert a.slots.worker_room(wa) == CAP - 3
        assert a.registry.workers["w1"].remote_in_flight == 1
    await admin.aclose()
