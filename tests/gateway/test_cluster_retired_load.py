"""A replica that drops a worker (file reload, DELETE /admin/workers) or points its name at a new
URL while its requests still run there keeps publishing that load, attributed to the server they
run on, until they end. Before, [cluster] published the fleet's records only: the load vanished
from Redis at once, and a replica that still routed to the worker saw it empty and filled it past
its cap (cap 4: 8 ran). Real redis-server, two in-process gateways synced tick by tick."""

from __future__ import annotations

import asyncio

import pytest

from bench.redis_server import RedisServer
from gateway.call import Call
from scoring.views import RouteRequest
from tests.gateway.cluster_pair import CAP, NEW, OLD, pair_settings, probed, replicas, sync_of, tick
from tests.gateway.conftest import MODEL
from workers.worker import Worker


def _dispatch(w: Worker, prefill: int = 100) -> Call:
    """One request on `w`, as the lifecycle counts it (its prefill still queued)."""
    call = Call("r", MODEL, "/v1/chat/completions", b"{}", True, False, RouteRequest(MODEL))
    w.dispatched(prefill)
    call.prefill_tokens = prefill
    return call


@pytest.mark.parametrize("how", ["file", "admin"])
async def test_a_removed_workers_running_requests_still_count_on_other_replicas(
    redis: RedisServer, how: str
) -> None:
    prefix = f"kvt:{{retired-{how}}}:"
    async with replicas(redis.url, prefix, OLD, OLD) as (a, b):
        old = a.registry.workers["w0"]
        calls = [_dispatch(old) for _ in range(CAP)]
        await tick(a, b)
        wb = b.registry.workers["w0"]
        assert wb.remote_in_flight == CAP and b.slots.worker_room(wb) == 0
        if how == "file":
            a.apply(pair_settings(redis.url, prefix, None))
        else:  # DELETE /admin/workers/w0 goes through sync_workers
            a.sync_workers([w.spec for w in a.registry.workers.values() if w.name != "w0"])
        assert "w0" not in a.registry.workers and a._in_flight() == CAP
        await tick(a, b)
        # B (not reloaded yet, or an admin change on A alone) still routes to w0: A's 4 run there.
        assert (wb.remote_in_flight, wb.remote_prefill_tokens) == (CAP, CAP * 100)
        assert b.slots.worker_room(wb) == 0
        # As they end, B sees room come back, one slot each.
        for i, call in enumerate(calls, 1):
            a.life.first_byte(old, call, 0.01)
            a.life.released(old, call)
            await tick(a, b)
            assert wb.remote_in_flight == CAP - i and b.slots.worker_room(wb) == i
        assert wb.remote_prefill_tokens == 0


async def test_a_moved_workers_load_counts_at_the_server_it_runs_on(redis: RedisServer) -> None:
    """A points w0 at a new server while 3 of its requests run on the old one; B has not
    reloaded. B, still sending w0 to the old server, counts A's 3 there (they were dropped from
    the snapshot); A's new server counts none of them, nor B's requests on the old one."""
    prefix = "kvt:{retired-moved}:"
    async with replicas(redis.url, prefix, OLD, OLD) as (a, b):
        old = a.registry.workers["w0"]
        calls = [_dispatch(old) for _ in range(3)]
        a.apply(pair_settings(redis.url, prefix, NEW))
        probed(a)
        new = a.registry.workers["w0"]
        assert new is not old and new.url == NEW
        _dispatch(b.registry.workers["w0"])  # B's own request on the old server
        await tick(a, b)
        await tick(a, b)
        wb = b.registry.workers["w0"]
        assert wb.remote_in_flight == 3 and b.slots.worker_room(wb) == CAP - 3 - 1
        assert new.remote_in_flight == 0 and a.slots.worker_room(new) == CAP
        for call in calls:
            a.life.released(old, call)
        await tick(a, b)
        assert wb.remote_in_flight == 0 and b.slots.worker_room(wb) == CAP - 1


async def test_nothing_is_published_for_a_removed_worker_once_its_requests_end(
    redis: RedisServer,
) -> None:
    prefix = "kvt:{retired-ended}:"
    async with replicas(redis.url, prefix, OLD, OLD) as (a, b):
        old = a.registry.workers["w0"]
        call = _dispatch(old)
        a.apply(pair_settings(redis.url, prefix, None))
        a.life.released(old, call)
        await asyncio.sleep(0)
        await tick(a, b)
        assert b.registry.workers["w0"].remote_in_flight == 0
        assert sync_of(a).local_loads() == {}
