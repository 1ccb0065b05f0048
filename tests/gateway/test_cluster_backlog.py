"""What a replica learned while Redis was away, once it is back (real redis-server, sync driven
tick by tick): a KV-event mode backlog drains without failing the heartbeat, a batch whose publish
timed out after Redis stored it is learned once, catching up never stalls the event loop, and
the outage's backlog is kept packed within the journal's budget."""

from __future__ import annotations

import asyncio
import gc
import random
import tracemalloc
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from bench.redis_server import RedisServer, free_port
from gateway.cluster import LEARNED_APPLY_CHUNK, ClusterSync
from gateway.config import ClusterSettings
from scoring.learned import Learned
from scoring.policy import make_policy
from scoring.precise import PreciseIndex
from scoring.state import RoutingState
from scoring.views import RouteRequest
from workers.learned_share import encode_batch
from workers.registry import Registry
from workers.worker import WorkerSpec

WORKERS = [f"w{i}" for i in range(4)]


def registry() -> Registry:
    return Registry([WorkerSpec(w, f"http://{w}") for w in WORKERS])


def replica(
    cfg: ClusterSettings, port: int, rid: str, kv_events: bool, metrics: Any = None
) -> tuple[ClusterSync, Any]:
    """A cluster sync on a routing state, and the policy that dispatches through it."""
    state = RoutingState(precise=PreciseIndex(pending_ttl_s=0) if kv_events else None)
    sync = ClusterSync(
        cfg,
        registry(),
        redis_url=f"redis://127.0.0.1:{port}/0",
        replica_id=rid,
        state=state,
        metrics=metrics,
    )
    return sync, make_policy("kv_aware", state=state)


def kv_request(rng: random.Random, blocks: int) -> RouteRequest:
    """A prompt of ``blocks`` 16-token worker blocks, keys of its own (no other request's)."""
    base = rng.getrandbits(62)
    keys = tuple(range(base, base + blocks))
    return RouteRequest(
        "m", chain=keys[:64], dense_blocks=64, prompt_tokens=blocks * 16, block_chain=keys
    )


async def outage(
    sync: ClusterSync, dispatch: Callable[[int], None], n: int, every: int = 500
) -> None:
    """``n`` dispatches while Redis is down, the sync ticking (and failing) as the task would."""
    for i in range(n):
        dispatch(i)
        if i % every == every - 1:
            assert not await sync.sync_once()
    assert not await sync.sync_once()


def backlog(sync: ClusterSync) -> int:
    """Dispatches still waiting to be shared: in the journal, or packed for the stream."""
    journal = sync.routing.journal if sync.routing else None
    return (len(journal) if journal else 0) + getattr(sync, "outbox_bytes", 0)


def dropped(metrics: CollectorRegistry) -> float:
    return metrics.get_sample_value("kvgate_cluster_learned_dropped_total") or 0.0


async def test_a_kv_mode_backlog_drains_after_an_outage_while_the_heartbeat_stays_ok() -> None:
    """32k-token prompts (2048 worker blocks each) dispatched while Redis was down: once back,
    every sync's heartbeat succeeds (it used to share one timeout with a ~64 MB batch that
    could not make it, forever), the backlog drains, and a peer learns each shared dispatch
    once."""
    port = free_port()
    cfg = ClusterSettings(enabled=True, key_prefix="kvt:{backlog}:")
    metrics = CollectorRegistry()
    a, policy = replica(cfg, port, "a", kv_events=True, metrics=metrics)
    rng = random.Random(7)
    prompts = [kv_request(rng, 2048) for _ in range(16)]
    await outage(a, lambda i: policy.on_dispatch(WORKERS[i % 4], prompts[i % 16]), 8192)

    with RedisServer(port):
        results: list[bool] = []
        for _ in range(100):
            results.append(await a.sync_once())
            if not results[-1] or not backlog(a):
                break
        assert all(results), f"heartbeat failed after Redis came back: {results}"
        assert a.state == "ok" and backlog(a) == 0
        assert a.learned_published > 0
        assert a.learned_published + dropped(metrics) == 8192  # each one shared or counted

        b, _ = replica(cfg, port, "b", kv_events=True)
        b_results: list[bool] = []
        for _ in range(100):
            b_results.append(await b.sync_once())
            if not b_results[-1] or b.learned_applied >= a.learned_published:
                break
        b_results.append(await b.sync_once())  # nothing more to learn
        await a.stop()
        await b.stop()
        assert all(b_results), f"a peer could not sync on the stream: {b_results}"
        assert b.learned_applied == a.learned_published


async def test_a_batch_whose_publish_timed_out_after_redis_stored_it_is_learned_once() -> None:
    """Sent again under the same sequence, and skipped by the reader; an older publisher's
    entries (no sequence: a rolling upgrade) are still learned."""
    port = free_port()
    cfg = ClusterSettings(enabled=True, key_prefix="kvt:{dup}:")
    a, policy = replica(cfg, port, "a", kv_events=False)
    b, _ = replica(cfg, port, "b", kv_events=False)
    rng = random.Random(1)
    with RedisServer(port):
        assert await b.sync_once()
        for i in range(100):
            chain = tuple(rng.getrandbits(63) for _ in range(8))
            policy.on_dispatch(WORKERS[i % 4], RouteRequest("m", chain=chain, session_id=f"s{i}"))
        real = a.client.pipeline

        def reply_lost(*args: Any, **kwargs: Any) -> Any:
            pipe = real(*args, **kwargs)
            execute = pipe.execute

            async def execute_then_lose_the_reply(*a2: Any, **k2: Any) -> Any:
                await execute(*a2, **k2)  # Redis ran every command ...
                raise RedisTimeoutError("reply lost")  # ... the client never heard

            pipe.execute = execute_then_lose_the_reply
            return pipe

        a.client.pipeline = reply_lost  # type: ignore[method-assign]
        assert not await a.sync_once()
        a.client.pipeline = real  # type: ignore[method-assign]
        assert await a.sync_once()  # the same batch, again
        admin = Redis.from_url(f"redis://127.0.0.1:{port}/0")
        copies = await admin.xlen(cfg.key_prefix + "learned")
        old_version = encode_batch(
            b.routing.key if b.routing else (), [Learned("w1", (), 0, (), "old", 0, 1.0)], 1.0
        )
        await admin.xadd(cfg.key_prefix + "learned", {"r": "old", "b": old_version})
        await admin.aclose()
        assert await b.sync_once() and await b.sync_once()
        await a.stop()
        await b.stop()
    assert copies == 2  # the duplicate is in the stream ...
    assert a.learned_published == 100
    assert b.learned_applied == 100 + 1  # ... and learned once; the older publisher's too


async def test_catching_up_on_a_backlog_does_not_stall_the_event_loop() -> None:
    """A replica starting after a peer published a full journal (50,000 dispatches, ~4,000-
    character prompts) replays the stream's history over several syncs; requests on its event
    loop wait at most a fraction of a second (one sync replayed all of it: 1.8 s)."""
    port = free_port()
    # a generous timeout: a loaded CI host took over 0.5 s for one read, and a failed sync is not
    # what this test is about
    cfg = ClusterSettings(enabled=True, key_prefix="kvt:{stall}:", op_timeout_s=5.0)
    a, policy = replica(cfg, port, "a", kv_events=False)
    rng = random.Random(3)
    n = cfg.learned_journal_max

    def dispatch(i: int) -> None:
        base = rng.getrandbits(62)
        chain = tuple(range(base, base + 62))
        policy.on_dispatch(WORKERS[i % 4], RouteRequest("m", chain=chain, session_id=f"s{i}"))

    await outage(a, dispatch, n, every=2000)
    with RedisServer(port):
        for _ in range(100):
            await a.sync_once()
            if not backlog(a):
                break
        assert a.learned_published == n

        b, _ = replica(cfg, port, "b", kv_events=False)
        synced, bursts = await catch_up(b, n)
        await asyncio.sleep(0.05)
        await a.stop()
        await b.stop()
    assert all(synced)
    assert b.learned_applied == n
    # Counted, not timed: other tasks get the loop after every LEARNED_APPLY_CHUNK dispatches
    # (one sync applied all 50,000 without yielding: 1.8 s on a quiet host).
    assert len(synced) > 1
    assert max(bursts) <= LEARNED_APPLY_CHUNK, f"{max(bursts)} dispatches applied without yielding"


async def catch_up(b: ClusterSync, n: int) -> tuple[list[bool], list[int]]:
    """Sync ``b`` until it applied ``n`` dispatches; returns each sync's result and how many
    dispatches it applied between two turns of its event loop (seen by another task on it, as a
    request or a probe would be)."""
    bursts: list[int] = []

    async def ticker() -> None:
        seen = b.learned_applied
        while True:
            await asyncio.sleep(0)
            bursts.append(b.learned_applied - seen)
            seen = b.learned_applied

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    synced = []
    try:
        for _ in range(200):
            synced.append(await b.sync_once())
            await asyncio.sleep(0)
            if b.learned_applied >= n:
                break
    finally:
        t.cancel()
    return synced, bursts


async def retained_by_outage(
    cfg: ClusterSettings, dispatches: int, journal: bool = True
) -> tuple[float, float]:
    """Bytes kept for ``dispatches`` KV-event mode requests of 2048 blocks made while Redis is
    down (each request's own tuples gone, as when it ends), and the drops counted."""
    metrics = CollectorRegistry()
    a, policy = replica(cfg, free_port(), "a", kv_events=True, metrics=metrics)
    if not journal:
        assert a.routing is not None
        a.routing.journal = None
    rng = random.Random(0)
    assert not await a.sync_once()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await outage(
            a,
            lambda i: policy.on_dispatch(WORKERS[i % 4], kv_request(rng, 2048)),
            dispatches,
            every=50,
        )
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    await a.stop()
    return used, dropped(metrics)


async def kept_for_sharing(cfg: ClusterSettings, dispatches: int) -> tuple[float, float]:
    """What sharing alone keeps (the routing state's own learning is the same without it)."""
    used, lost = await retained_by_outage(cfg, dispatches)
    control, _ = await retained_by_outage(cfg, dispatches, journal=False)
    return used - control, lost


async def test_an_outage_keeps_kv_mode_dispatches_packed_at_about_8_bytes_a_block() -> None:
    """The journal used to pin each request's tuples, ~40 bytes a block (86 KB for a 32k-token
    prompt, 4 GiB for a full journal); what waits for Redis is packed instead."""
    used, lost = await kept_for_sharing(ClusterSettings(enabled=True), 300)
    assert lost == 0
    per_entry = used / 300
    assert per_entry < 8 * (2048 + 64) + 2048, f"{per_entry / 1024:.1f} KiB kept per dispatch"


async def test_an_outage_holds_no_more_than_the_journal_budget_and_counts_the_rest() -> None:
    """``learned_journal_max`` dispatches of ~1 KB each: KV-event mode dispatches are far
    bigger, so fewer are kept (the newest), and the others are counted as dropped."""
    cfg = ClusterSettings(enabled=True, learned_journal_max=2000)  # a budget of ~2 MB
    used, lost = await kept_for_sharing(cfg, 600)
    assert used < 2000 * 1024, f"{used / 2**20:.1f} MiB kept for a 2 MB budget"
    assert lost > 0


async def test_a_replica_that_stops_publishes_the_dispatches_since_its_last_sync() -> None:
    port = free_port()
    cfg = ClusterSettings(enabled=True, key_prefix="kvt:{stop}:")
    a, policy = replica(cfg, port, "a", kv_events=False)
    b, _ = replica(cfg, port, "b", kv_events=False)
    with RedisServer(port):
        assert await a.sync_once() and await b.sync_once()
        chain = tuple(range(100, 108))
        policy.on_dispatch("w2", RouteRequest("m", chain=chain, session_id="s"))
        await a.stop()  # no sync in between: only the stop can share it
        assert await b.sync_once()
        await b.stop()
    assert b.learned_applied == 1
    assert b.routing is not None and b.routing.index.match(chain) == {"w2": len(chain)}
