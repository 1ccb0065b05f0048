"""Gateway replicas sharing per-worker load through a real Redis ([cluster]).

Two (or three) real gateways, simulated workers in a child process, one real redis-server: a
replica's queue signals and a worker's fleet-wide concurrency cap count the other replicas'
requests; a killed replica's load disappears within the expiry; Redis dying changes nothing a
client sees, and the shared view comes back with it. The staleness (a dispatch on one replica
until another counts it) is measured and printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

from bench.metrics import nearest_rank
from bench.redis_server import RedisServer
from gateway.app import Gateway
from tests.gateway.conftest import (
    MODEL,
    RunningGateway,
    free_ports,
    run_gateway,
    settings_for,
    until,
)

# Steps of 20-40 ms: a 2,000-token stream lasts a minute, yet costs the shared cores little.
SLOW = ("--time-scale", "20")
EXPIRY_S = 1.0


def cluster_settings(urls: list[str], redis_url: str, prefix: str, **sections: Any) -> Any:
    cluster = {
        "enabled": True,
        "redis_url": redis_url,
        "key_prefix": prefix,
        "publish_interval_s": 0.05,
        "expiry_s": EXPIRY_S,
        # Generous: a loaded CI host took over the default 0.5 s for one Redis round trip, and
        # a sync that times out is an outage these tests count. Outages here are killed
        # servers, refused at once whatever the timeout.
        "op_timeout_s": 5.0,
    }
    return settings_for(urls, cluster=cluster, **sections)


def prefix() -> str:
    """A key namespace per test: the module's Redis is shared."""
    return f"kvgate:{{t-{uuid.uuid4().hex[:8]}}}:"


def chat(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@contextlib.asynccontextmanager
async def two_replicas(
    s: Any, healthy: int = 2
) -> AsyncIterator[tuple[RunningGateway, RunningGateway, httpx.AsyncClient]]:
    """Two gateway replicas on the same settings (one Redis), both seeing `healthy` workers,
    and a client."""
    async with (
        run_gateway(s) as a,
        run_gateway(s) as b,
        httpx.AsyncClient(timeout=60) as c,
    ):
        await a.wait_healthy(healthy)
        await b.wait_healthy(healthy)
        yield a, b, c


async def hold(c: httpx.AsyncClient, url: str, started: asyncio.Event | None = None) -> None:
    """A long stream, read to the end (or until cancelled, which hangs up on the gateway)."""
    async with c.stream("POST", url + "/v1/chat/completions", json=chat(2000)) as r:
        assert r.status_code == 200
        async for _ in r.aiter_raw():
            if started is not None:
                started.set()


def local(gw: Gateway) -> dict[str, int]:
    return {w.name: w.in_flight for w in gw.registry.workers.values()}


def remote(gw: Gateway) -> dict[str, int]:
    return {w.name: w.remote_in_flight for w in gw.registry.workers.values()}


async def cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Hang up every client stream; bounded, so a stream that ignored its cancellation is a
    failure that names itself, not a test that waits for the suite's timeout."""
    for t in tasks:
        t.cancel()
    if tasks:
        _done, stuck = await asyncio.wait(tasks, timeout=15)
        assert not stuck, f"{len(stuck)} client streams still running 15 s after cancel"


async def test_replicas_count_each_others_load_and_share_the_concurrency_cap(
    sims: Any, redis: RedisServer
) -> None:
    fleet = sims(2, *SLOW)
    ns = prefix()
    adm = {"worker_concurrency": 3, "priority_reserve": 0.0}
    s = cluster_settings(fleet.urls, redis.url, ns, admission=adm)
    async with two_replicas(s) as (a, b, c):
        assert a.gw.cluster is not None and b.gw.cluster is not None
        assert a.gw.cluster.replica_id != b.gw.cluster.replica_id
        streams = [asyncio.create_task(hold(c, a.url)) for _ in range(4)]
        try:
            await until(lambda: sum(local(a.gw).values()) == 4, 10, "A dispatched 4 streams")
            # B counts exactly A's requests, on the workers A sent them to.
            await until(lambda: remote(b.gw) == local(a.gw), 5, "B sees A's in-flight")
            assert sum(local(b.gw).values()) == 0 and sum(remote(a.gw).values()) == 0
            for w in b.gw.registry.workers.values():
                # The routing view and the cap both see the whole gateway's load.
                assert w.view().in_flight == local(a.gw)[w.name]
                assert w.remote_prefill_tokens >= 0
                assert b.gw.slots.worker_room(w) == 3 - local(a.gw)[w.name]
            # Two more through B fill the fleet (3 per worker, 6 in all, across two replicas).
            streams += [asyncio.create_task(hold(c, b.url)) for _ in range(2)]
            await until(lambda: sum(local(b.gw).values()) == 2, 10, "B dispatched 2 streams")
            await until(
                lambda: all(
                    local(a.gw)[n] + remote(a.gw)[n] == 3 and local(b.gw)[n] + remote(b.gw)[n] == 3
                    for n in local(a.gw)
                ),
                5,
                "both replicas see both workers full",
            )
            # A seventh request on either replica waits for room it cannot see locally: queued
            # until its deadline, then a 503 (without [cluster] each replica would send it).
            r = await c.post(
                b.url + "/v1/chat/completions",
                json=chat(4, stream=False),
                headers={"x-kvgate-deadline-ms": "300"},
            )
            assert r.status_code == 503, r.text
            # Room freed on A reaches B's admission queue: a waiting request goes through.
            waiting = asyncio.create_task(
                c.post(
                    b.url + "/v1/chat/completions",
                    json=chat(4, stream=False),
                    headers={"x-kvgate-deadline-ms": "10000"},
                )
            )
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await cancel(streams[:1])  # one of A's streams ends
            r = await asyncio.wait_for(waiting, 10)
            assert r.status_code == 200, r.text
            # The sync age is the time since B's last sync: ordered, not timed, it is at most
            # the time since a mark before a sync that B both started and finished.
            cb = b.gw.cluster
            mark, seq = time.monotonic(), cb.seq
            await until(lambda: cb.seq >= seq + 2, 10, "B synced again")
            m = await b.metrics()
            since_mark = time.monotonic() - mark
            assert m['kvgate_cluster_state{state="ok"}'] == 1
            assert m["kvgate_cluster_replicas"] == 2
            assert 0 <= m["kvgate_cluster_sync_age_seconds"] <= since_mark, since_mark
            assert m[f'kvgate_cluster_replica{{id="{b.gw.cluster.replica_id}"}}'] == 1
        finally:
            await cancel(streams)
        # Everything released everywhere: no replica keeps counting finished requests.
        await until(lambda: sum(remote(a.gw).values()) == 0, 5, "A's view drained")
        await until(lambda: sum(remote(b.gw).values()) == 0, 5, "B's view drained")


async def test_staleness_a_dispatch_on_one_replica_reaches_the_other(
    sims: Any, redis: RedisServer
) -> None:
    """Measured: from the moment replica A's worker count grows until replica B counts it.
    Target 100 ms at the default 50 ms interval; asserted only loosely (shared CI cores)."""
    fleet = sims(2, *SLOW)
    s = cluster_settings(fleet.urls, redis.url, prefix())
    delays: list[float] = []
    async with two_replicas(s) as (a, b, c):
        streams: list[asyncio.Task[None]] = []
        # ~3 s on an idle box; on a loaded one, stop measuring after 20 s (with a few samples)
        # rather than run into the suite's timeout.
        stop_at = time.monotonic() + 20
        try:
            for k in range(1, 25):
                if len(delays) >= 3 and time.monotonic() > stop_at:
                    break
                streams.append(asyncio.create_task(hold(c, a.url)))
                await until(
                    lambda k=k: sum(local(a.gw).values()) == k, 10, "A dispatched", step=0.001
                )
                t = time.monotonic()
                await until(
                    lambda k=k: sum(remote(b.gw).values()) == k, 5, "B counts it", step=0.001
                )
                delays.append(time.monotonic() - t)
                await asyncio.sleep(0.01 + (k % 7) * 0.013)  # spread over the sync phase
            m = await b.metrics()
        finally:
            await cancel(streams)
    delays.sort()
    p99 = nearest_rank(delays, 99)
    rtt = m["kvgate_cluster_sync_seconds_sum"] / m["kvgate_cluster_sync_seconds_count"]
    print(
        f"\ncluster staleness over {len(delays)} dispatches: median "
        f"{statistics.median(delays) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max "
        f"{delays[-1] * 1000:.0f} ms; sync round trip mean {rtt * 1000:.2f} ms"
    )
    assert p99 < 2.0


async def test_a_killed_replica_stops_counting_within_the_expiry(
    sims: Any, redis: RedisServer, tmp_path: Path
) -> None:
    fleet = sims(2, *SLOW)
    ns = prefix()
    port = free_ports(1)
    cfg = tmp_path / "replica.toml"
    workers = "".join(
        f'[[workers]]\nname = "w{i}"\nurl = "{u}"\n' for i, u in enumerate(fleet.urls)
    )
    cfg.write_text(
        f'[server]\nport = {port}\n[logging]\nlevel = "warning"\n[probes]\ninterval_s = 0.2\n'
        f'[cluster]\nenabled = true\nredis_url = "{redis.url}"\nkey_prefix = "{ns}"\n'
        f"publish_interval_s = 0.05\nexpiry_s = {EXPIRY_S}\nop_timeout_s = 5.0\n{workers}"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), start_new_session=True
    )
    a_url = f"http://127.0.0.1:{port}"
    s = cluster_settings(fleet.urls, redis.url, ns)
    streams: list[asyncio.Task[None]] = []
    try:
        async with run_gateway(s) as b, httpx.AsyncClient(timeout=60) as c:
            await b.wait_healthy(2)
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(a_url + "/ready")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            streams = [asyncio.create_task(hold(c, a_url)) for _ in range(3)]
            await until(lambda: sum(remote(b.gw).values()) == 3, 10, "B sees the other replica")
            assert (await b.metrics())["kvgate_cluster_replicas"] == 2
            os.killpg(proc.pid, signal.SIGKILL)  # no shutdown, no last write
            gone = await until(lambda: sum(remote(b.gw).values()) == 0, EXPIRY_S + 3, "expired")
            print(f"\nkilled replica's load gone from the survivor after {gone:.2f}s")
            assert (await b.metrics())["kvgate_cluster_replicas"] == 1
            # The survivor also deletes the dead replica's field from Redis.
            client = Redis.from_url(redis.url)
            try:
                key = ns + "load"
                mine = b.gw.cluster.replica_id  # type: ignore[union-attr]
                for _ in range(100):
                    fields = {k.decode() for k in await client.hkeys(key)}
                    if fields == {mine}:
                        break
                    await asyncio.sleep(0.05)
                assert fields == {mine}
            finally:
                await client.aclose()
            # B still routes: its own requests go through on the local view.
            r = await c.post(b.url + "/v1/chat/completions", json=chat(4, stream=False))
            assert r.status_code == 200
    finally:
        await cancel(streams)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def test_redis_dying_mid_run_changes_nothing_clients_see(sims: Any) -> None:
    fleet = sims(2, *SLOW)
    with RedisServer() as redis:
        s = cluster_settings(fleet.urls, redis.url, prefix())
        async with two_replicas(s) as (a, b, c):
            statuses: list[int] = []
            stop = asyncio.Event()

            async def traffic(g: RunningGateway) -> None:
                while not stop.is_set():
                    r = await c.post(g.url + "/v1/chat/completions", json=chat(2, stream=False))
                    statuses.append(r.status_code)

            load = [asyncio.create_task(traffic(g)) for g in (a, b)]
            streams = [asyncio.create_task(hold(c, a.url)) for _ in range(2)]
            try:
                await until(lambda: sum(remote(b.gw).values()) >= 2, 10, "B sees A's streams")
                redis.kill()
                await until(
                    lambda: (
                        a.gw.cluster.state == "degraded"  # type: ignore[union-attr]
                        and b.gw.cluster.state == "degraded"
                    ),  # type: ignore[union-attr]
                    5,
                    "both replicas degraded",
                )
                m = await b.metrics()
                assert m['kvgate_cluster_state{state="degraded"}'] == 1
                assert m['kvgate_cluster_state{state="ok"}'] == 0
                # Peers' load lapses after the expiry: routing goes local, not stale.
                await until(lambda: sum(remote(b.gw).values()) == 0, EXPIRY_S + 3, "lapsed")
                n_down = len(statuses)
                # Requests kept flowing while Redis was down (polled: how many finish in a
                # fixed pause depends on the host's load).
                await until(lambda: len(statuses) > n_down, 10, "a request served, Redis down")
                await asyncio.to_thread(redis.start)  # same port, empty
                await until(
                    lambda: (
                        a.gw.cluster.state == "ok"  # type: ignore[union-attr]
                        and b.gw.cluster.state == "ok"
                    ),  # type: ignore[union-attr]
                    10,
                    "both replicas resynced",
                )
                # The shared view is back: B counts A's streams again.
                await until(lambda: remote(b.gw) == local(a.gw), 5, "B sees A's streams again")
                assert sum(remote(b.gw).values()) >= 2
            finally:
                stop.set()
                await asyncio.gather(*load, return_exceptions=True)
                await cancel(streams)
            assert statuses and set(statuses) == {200}, statuses
            m = await b.metrics()
            assert m["kvgate_cluster_outages_total"] == 1
            assert m["kvgate_cluster_sync_failures_total"] >= 1


async def test_off_by_default_needs_no_redis(sims: Any) -> None:
    fleet = sims(1)
    async with run_gateway(settings_for(fleet.urls)) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)
        assert g.gw.cluster is None
        r = await c.post(g.url + "/v1/chat/completions", json=chat(2, stream=False))
        assert r.status_code == 200
        assert not any(k.startswith("kvgate_cluster") for k in await g.metrics())
