"""The cluster sync shell driven tick by tick (real redis-server, injected clock): one log line per
outage and one at its end, peers' load lapsing while Redis is down, config rules."""

from __future__ import annotations

import asyncio
import logging

import pytest
from pydantic import ValidationError

from bench.redis_server import RedisServer, free_port
from gateway.cluster import ClusterSync, redact_url
from gateway.config import ClusterSettings
from workers.registry import Registry
from workers.worker import WorkerSpec


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_expiry_must_cover_several_heartbeats() -> None:
    with pytest.raises(ValidationError, match="4 x publish_interval_s"):
        ClusterSettings(publish_interval_s=1.0, expiry_s=2.0)
    assert ClusterSettings().enabled is False  # `make run` needs no Redis


def test_logged_urls_hide_the_password() -> None:
    assert redact_url("redis://:s3cret@cache:6380/0") == "redis://:***@cache:6380/0"
    assert redact_url("redis://user:pw@h/1") == "redis://user:***@h/1"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_outage_is_logged_once_remote_load_lapses_and_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    # A generous op timeout: the outages here are a killed server, refused at once; a loaded
    # host's slow round trip must not count as one more (the test counts failures exactly).
    cfg = ClusterSettings(enabled=True, expiry_s=3.0, op_timeout_s=5.0, key_prefix="kvt:{u}:")
    url = f"redis://127.0.0.1:{port}/0"
    clock = Clock()
    reg_a = Registry([WorkerSpec("w0", "http://x"), WorkerSpec("w1", "http://y")])
    reg_b = Registry([WorkerSpec("w0", "http://x"), WorkerSpec("w1", "http://y")])
    freed: list[int] = []
    a = ClusterSync(cfg, reg_a, redis_url=url, replica_id="a", clock=clock)
    b = ClusterSync(
        cfg, reg_b, redis_url=url, replica_id="b", clock=clock, on_freed=lambda: freed.append(1)
    )
    server = RedisServer(port)
    try:
        caplog.set_level(logging.WARNING, logger="kvgate.cluster")
        assert not await b.sync_once()  # nothing listens yet: starts degraded, no exception
        assert b.state == "degraded"
        server.start()
        reg_a.workers["w1"].in_flight, reg_a.workers["w1"].prefill_tokens = 4, 800
        assert await a.sync_once() and await b.sync_once()
        assert b.state == "ok"
        w1 = reg_b.workers["w1"]
        assert (w1.remote_in_flight, w1.remote_prefill_tokens) == (4, 800)
        assert reg_b.workers["w0"].remote_in_flight == 0
        assert w1.in_flight == 0  # local stays local
        caplog.clear()

        server.kill()
        for _ in range(5):  # many failed ticks, one line
            clock.t += 0.5
            assert not await b.sync_once()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "unreachable" in lines[0], lines
        assert b.state == "degraded" and b.failures == 6 and b.outages == 2  # + the start
        assert w1.remote_in_flight == 4  # 2.5 s since a's last heartbeat: still trusted
        clock.t += 0.6
        assert not await b.sync_once()
        assert (w1.remote_in_flight, w1.remote_prefill_tokens) == (0, 0)  # lapsed
        assert freed  # admission is told room appeared

        await asyncio.to_thread(server.start)  # same port, empty
        caplog.clear()
        assert await a.sync_once() and await b.sync_once()  # a reconnect, not a failure
        assert b.state == "ok" and w1.remote_in_flight == 4
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "answers again" in lines[0], lines

        # A clean stop leaves an empty snapshot: peers stop counting at once.
        await a.stop()
        assert await b.sync_once()
        assert w1.remote_in_flight == 0
    finally:
        await b.stop()
        server.close()


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_a_replica_back_from_its_own_outage_deletes_no_live_peers_load() -> None:
    """A replica whose own link to Redis was down past expiry_s saw every peer go quiet; on
    its first sync back it had deleted their snapshots, and a replica reading then (one
    starting, a `--processes` child) counted none of a live peer's load."""
    port = free_port()
    cfg = ClusterSettings(enabled=True, expiry_s=3.0, op_timeout_s=5.0, key_prefix="kvt:{h}:")
    url = f"redis://127.0.0.1:{port}/0"
    clock = _Clock()
    mk = lambda: Registry([WorkerSpec("w0", "http://x")])  # noqa: E731
    ra, rb, rc = mk(), mk(), mk()
    server = RedisServer(port)
    server.start()
    a = ClusterSync(cfg, ra, redis_url=url, replica_id="a", clock=clock)
    b = ClusterSync(cfg, rb, redis_url=url, replica_id="b", clock=clock)
    bad = ClusterSync(cfg, ra, redis_url=f"redis://127.0.0.1:{free_port()}/0", replica_id="x")
    c = ClusterSync(cfg, rc, redis_url=url, replica_id="c", clock=clock)
    try:
        rb.workers["w0"].in_flight = 7
        assert await a.sync_once() and await b.sync_once() and await a.sync_once()
        # A loses its own link to Redis for 4 s (> expiry_s) while B keeps publishing.
        good = a.client
        a.client = bad.client
        for _ in range(8):
            clock.t += 0.5
            assert not await a.sync_once()
            assert await b.sync_once()
        a.client = good
        assert await a.sync_once()  # first successful sync after A's outage
        # C (a replica starting now, or any reader between this and B's next tick) reads:
        assert await c.sync_once()
        assert rc.workers["w0"].remote_in_flight == 7, (
            "live peer b's snapshot was deleted by a's first sync after its own outage"
        )
    finally:
        for s in (a, b, c, bad):
            await s.stop()
        server.close()
