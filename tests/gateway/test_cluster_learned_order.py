"""What replicas learn from each other stays true to the fleet and the same on every replica:
a restarted worker is not credited again with its earlier process's cache (neither by a replica
that starts afterwards nor through a peer's outage backlog), concurrent turns of one session
through two replicas end pinned to the same worker on both, and catching up on KV-event mode
dispatches yields the event loop by work, not by dispatch count. Real redis-servers, real
`ClusterSync`s (and real `Gateway`s where the prober's restart handling matters)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

from bench.redis_server import RedisServer, free_port
from gateway.app import Gateway
from gateway.cluster import LEARNED_APPLY_CHUNK, ClusterSync
from gateway.config import ClusterSettings, Settings
from scoring.learned import Learned
from scoring.policy import make_policy
from scoring.precise import PreciseIndex
from scoring.state import RoutingState
from scoring.views import RouteRequest
from tests.gateway.test_cluster_backlog import catch_up
from workers.registry import Registry
from workers.worker import WorkerSpec

CHAIN = tuple(range(1000, 1016))
LATER = tuple(range(5000, 5016))
WORKERS = ("w0", "w1")


# -- helpers -------------------------------------------------------------------------------------
def gw_settings(url: str, prefix: str) -> Settings:
    return Settings(
        server={"host": "127.0.0.1", "port": 0},
        logging={"level": "warning"},
        workers=[{"name": f"w{i}", "url": f"http://127.0.0.1:{9 + i}"} for i in range(2)],
        cluster={"enabled": True, "redis_url": url, "key_prefix": prefix, "op_timeout_s": 5.0},
    )


def probe(gw: Gateway, name: str, started: float) -> None:
    """What the prober reports: the worker's /metrics process_start_time_seconds."""
    w = gw.registry.workers[name]
    w.metrics = dataclasses.replace(w.metrics, process_start=started)
    gw._on_probe(w, True, 0.001)


def gw_credits(gw: Gateway, chain: tuple[int, ...] = CHAIN, sid: str = "sess-1") -> Any:
    st = gw.routing_state
    return st.index.match(chain), st.sessions.get(sid, time.monotonic())


async def sync(*syncs: ClusterSync, times: int = 3) -> None:
    for _ in range(times):
        for s in syncs:
            assert await s.sync_once()


def replica(
    cfg: ClusterSettings,
    url: str,
    rid: str,
    *,
    kv: bool = False,
    workers: tuple[str, ...] = WORKERS,
) -> tuple[ClusterSync, Any, RoutingState]:
    state = RoutingState(precise=PreciseIndex() if kv else None)
    reg = Registry([WorkerSpec(w, f"http://{w}") for w in workers])
    sync_ = ClusterSync(cfg, reg, redis_url=url, replica_id=rid, state=state)
    return sync_, make_policy("kv_aware", state=state), state


def started(s: ClusterSync, name: str, at: float | None) -> None:
    """The worker's first probe: its process start (None: a server that exports none)."""
    w = s.registry.workers[name]
    w.metrics = dataclasses.replace(w.metrics, process_start=at)
    w.last_probe_at = time.monotonic()


def note(
    s: ClusterSync, chain: tuple[int, ...], sid: str, ago_s: float, worker: str = "w0"
) -> None:
    """A dispatch this replica made ``ago_s`` seconds ago, as its policy journals it."""
    assert s.routing is not None and s.routing.journal is not None
    s.routing.journal.note(
        Learned(worker, chain, len(chain), (), sid, 100, time.monotonic() - ago_s)
    )


def credits(state: RoutingState, chain: tuple[int, ...], sid: str) -> tuple[dict[str, int], Any]:
    return state.index.match(chain), state.sessions.get(sid, time.monotonic())


# -- finding 1: a restarted worker's earlier cache -----------------------------------------------
async def test_a_replica_started_after_a_worker_restart_does_not_credit_the_old_cache(
    redis: RedisServer,
) -> None:
    """Gateway A learns w0's cache, w0 restarts (A forgets it); gateway C starts afterwards and
    warms up from the stream's history, whose notes are about w0's earlier process."""
    a = Gateway(gw_settings(redis.url, "t:{restart-a}:"))
    probe(a, "w0", time.time() - 3600)  # w0's first process, up for an hour
    a.policy.on_dispatch("w0", RouteRequest("m", chain=CHAIN, session_id="sess-1"))
    assert a.cluster is not None
    await sync(a.cluster)
    new_start = time.time()
    probe(a, "w0", new_start)  # w0 restarted: A forgets what it held
    assert gw_credits(a) == ({}, None)

    c = Gateway(gw_settings(redis.url, "t:{restart-a}:"))
    probe(c, "w0", new_start)  # it only ever sees the new process
    assert c.cluster is not None
    try:
        await sync(a.cluster, c.cluster)
        assert c.cluster.learned_applied == 0
        assert c.cluster.learned_stale == 1
        assert gw_credits(c) == ({}, None)
    finally:
        await a.cluster.stop()
        await c.cluster.stop()


async def test_a_warm_start_keeps_what_was_learned_of_the_current_process(
    redis: RedisServer,
) -> None:
    """The history holds notes from before w0's restart and after it: only the later ones are
    credited to the running process; w1, which never restarted, keeps everything."""
    cfg = ClusterSettings(enabled=True, key_prefix="t:{restart-b}:", op_timeout_s=5.0)
    a, _, _ = replica(cfg, redis.url, "a")
    note(a, CHAIN, "old", ago_s=120)  # w0's earlier process, two minutes ago
    note(a, CHAIN, "w1-old", ago_s=120, worker="w1")
    note(a, LATER, "new", ago_s=10)  # w0's current process, started a minute ago
    c, _, sc = replica(cfg, redis.url, "c")
    started(c, "w0", time.time() - 60)
    started(c, "w1", time.time() - 3600)
    try:
        await sync(a, c)
        assert credits(sc, CHAIN, "old") == ({"w1": 16}, None)
        assert credits(sc, LATER, "new") == ({"w0": 16}, "w0")
        assert sc.sessions.get("w1-old", time.monotonic()) == "w1"
        assert (c.learned_applied, c.learned_stale) == (2, 1)
    finally:
        await a.stop()
        await c.stop()


async def test_notes_taken_before_a_workers_start_was_known_go_once_it_is(
    redis: RedisServer,
) -> None:
    """A replica that replayed history before its first probe of w0 (w0 down at its start, or
    Redis faster than the worker) forgets the notes that turn out to predate w0's process."""
    cfg = ClusterSettings(enabled=True, key_prefix="t:{restart-c}:", op_timeout_s=5.0)
    a, _, _ = replica(cfg, redis.url, "a")
    note(a, CHAIN, "old", ago_s=120)
    c, _, sc = replica(cfg, redis.url, "c")
    try:
        await sync(a, c)
        assert credits(sc, CHAIN, "old") == ({"w0": 16}, "w0")  # unknown start: taken
        started(c, "w0", time.time() - 60)  # the probe: w0 started after that note
        await sync(c, times=1)
        assert credits(sc, CHAIN, "old") == ({}, None)
    finally:
        await a.stop()
        await c.stop()


async def test_a_started_replica_reads_the_history_after_the_first_probes(
    redis: RedisServer,
) -> None:
    cfg = ClusterSettings(enabled=True, key_prefix="t:{restart-d}:", publish_interval_s=0.01)
    a, _, _ = replica(cfg, redis.url, "a")
    note(a, CHAIN, "old", ago_s=120)
    await sync(a)
    c, _, sc = replica(cfg, redis.url, "c")
    started(c, "w1", time.time() - 3600)  # w0 not probed yet
    await c.start()
    try:
        for _ in range(10):
            await asyncio.sleep(0.02)
        assert c.state == "ok" and credits(sc, CHAIN, "old") == ({}, None)  # nothing read yet
        assert c.learned_applied == c.learned_stale == 0
        started(c, "w0", time.time() - 60)
        for _ in range(200):
            if getattr(c, "learned_stale", 0) or c.learned_applied:
                break
            await asyncio.sleep(0.01)
        assert credits(sc, CHAIN, "old") == ({}, None)
        assert (c.learned_applied, c.learned_stale) == (0, 1)
    finally:
        await a.stop()
        await c.stop()


async def test_an_outage_backlog_does_not_recredit_a_worker_already_forgotten() -> None:
    """B's dispatch to w0's earlier process waits in its outbox while Redis is down; w0
    restarts meanwhile and both gateways forget it; B's backlog, published when Redis returns,
    teaches neither of them the old cache back (the start times here are not on the epoch
    scale: the forget time alone has to tell)."""
    port = free_port()
    srv = RedisServer(port)
    srv.start()
    url = f"redis://127.0.0.1:{port}/0"
    a = Gateway(gw_settings(url, "t:{backlog}:"))
    b = Gateway(gw_settings(url, "t:{backlog}:"))
    assert a.cluster is not None and b.cluster is not None
    try:
        for g in (a, b):
            probe(g, "w0", 100.0)
        await sync(a.cluster, b.cluster)
        srv.stop()  # Redis down
        b.policy.on_dispatch("w0", RouteRequest("m", chain=CHAIN, session_id="sess-1"))
        assert not await b.cluster.sync_once()  # b's note waits in its outbox
        # A restart takes seconds to notice (a probe interval, a model load); half a second
        # leaves room for a loaded host's publish latency, which places the note late.
        await asyncio.sleep(0.5)
        for g in (a, b):
            probe(g, "w0", 200.0)  # w0 restarts; both replicas forget it
        assert gw_credits(a) == gw_credits(b) == ({}, None)
        srv.start()  # Redis back: b shares its backlog
        await sync(b.cluster, a.cluster)
        assert b.cluster.learned_published == 1
        assert gw_credits(a) == gw_credits(b) == ({}, None)
        assert a.cluster.learned_stale == 1
    finally:
        for g in (a, b):
            if g.cluster:
                await g.cluster.stop()
        srv.close()


# -- finding 2: concurrent turns of one session --------------------------------------------------
async def test_concurrent_turns_of_one_session_leave_both_replicas_agreeing(
    redis: RedisServer,
) -> None:
    cfg = ClusterSettings(enabled=True, key_prefix="t:{sess}:", op_timeout_s=5.0)
    a, pa, sa = replica(cfg, redis.url, "a")
    b, pb, sb = replica(cfg, redis.url, "b")
    try:
        assert await a.sync_once() and await b.sync_once()
        n = 10
        for i in range(n):
            sid = f"user-{i}"
            # Two concurrent turns of one session, one through each replica, A's first.
            pa.on_dispatch("w0", RouteRequest("m", session_id=sid, prompt_tokens=100))
            pb.on_dispatch("w1", RouteRequest("m", session_id=sid, prompt_tokens=100))
        for _ in range(4):  # publish, read, replay: well past convergence
            await asyncio.gather(a.sync_once(), b.sync_once())
        now = time.monotonic()
        pins = [
            (sa.sessions.get(f"user-{i}", now), sb.sessions.get(f"user-{i}", now)) for i in range(n)
        ]
    finally:
        await a.stop()
        await b.stop()
    split = [p for p in pins if p[0] != p[1]]
    assert not split, f"{len(split)}/{n} sessions pinned differently (A, B): {split[:3]}"
    assert all(p[0] in WORKERS for p in pins)


async def test_an_older_turn_published_late_does_not_undo_a_newer_one(redis: RedisServer) -> None:
    """Turn 1 of a session went through B five seconds before turn 2 through A, but reaches the
    stream after it (B's outage backlog): turn 2's worker stays pinned everywhere."""
    cfg = ClusterSettings(enabled=True, key_prefix="t:{late}:", op_timeout_s=5.0)
    a, pa, sa = replica(cfg, redis.url, "a")
    b, _, sb = replica(cfg, redis.url, "b")
    c, _, sc = replica(cfg, redis.url, "c")
    try:
        await sync(a, b, c, times=1)
        sb.sessions.put("s", "w1", time.monotonic() - 5, 100)  # B's turn 1, routed 5 s ago
        note(b, (), "s", ago_s=5, worker="w1")
        pa.on_dispatch("w0", RouteRequest("m", session_id="s", prompt_tokens=100))  # turn 2
        await sync(a, c, times=2)  # A's turn 2 is in the stream first
        await sync(b, a, c, times=3)
        now = time.monotonic()
        assert [st.sessions.get("s", now) for st in (sa, sb, sc)] == ["w0", "w0", "w0"]
    finally:
        for s in (a, b, c):
            await s.stop()


# -- finding 3: KV-event mode catch-up -----------------------------------------------------------
async def test_kv_mode_catch_up_yields_the_event_loop_by_work() -> None:
    """A replica warm-starting from 600 KV-event mode dispatches of 2048 worker blocks each (a
    32k-token prompt; ~61 a 1 MB stream entry) replays them in chunks of bounded work: between
    two turns of its event loop no more keys than a full text-mode chunk (512 x 64). Counted,
    not timed (it replayed a whole entry, ~125k keys and ~0.2 s, without yielding)."""
    blocks = 2048
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cfg = ClusterSettings(enabled=True, key_prefix="t:{kvstall}:", op_timeout_s=5.0)
    workers = tuple(f"w{i}" for i in range(4))
    with RedisServer(port):
        a, policy, _ = replica(cfg, url, "a", kv=True, workers=workers)
        rng = random.Random(5)
        n = 600
        for i in range(n):
            base = rng.getrandbits(62)
            keys = tuple(range(base, base + blocks))
            policy.on_dispatch(
                workers[i % 4],
                RouteRequest(
                    "m",
                    chain=keys[:64],
                    dense_blocks=64,
                    prompt_tokens=blocks * 16,
                    block_chain=keys,
                ),
            )
        for _ in range(50):
            assert await a.sync_once()
            if a.learned_published >= n:
                break
        assert a.learned_published == n

        b, _, sb = replica(cfg, url, "b", kv=True, workers=workers)
        synced, bursts = await catch_up(b, n)
        await a.stop()
        await b.stop()
    assert all(synced) and b.learned_applied == n
    assert sb.precise is not None and sb.precise.pending_size() > 0
    assert max(bursts) * blocks <= LEARNED_APPLY_CHUNK * 64, (
        f"{max(bursts)} KV-mode dispatches ({max(bursts) * blocks} keys) replayed without yielding"
    )
