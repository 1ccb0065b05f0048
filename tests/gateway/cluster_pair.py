"""Two (or more) in-process gateways on one real redis-server, synced tick by tick: the set-up of
the [cluster] tests that follow one worker across replicas (a removal, a move to a new URL)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from gateway.app import Gateway
from gateway.cluster import ClusterSync
from gateway.config import Settings
from tests.gateway.conftest import MODEL, settings_for

CARDS = [{"id": MODEL, "object": "model"}]
CAP = 4
OLD = "http://127.0.0.1:9"
NEW = "http://127.0.0.1:11"


def pair_settings(redis_url: str, prefix: str, w0: str | None) -> Settings:
    """w0 at ``w0`` (None: not in the fleet) and w1, each capped at CAP, sharing load only."""
    workers = [{"name": "w1", "url": "http://127.0.0.1:8", "max_concurrency": CAP}]
    if w0 is not None:
        workers.insert(0, {"name": "w0", "url": w0, "max_concurrency": CAP})
    return settings_for(
        [],
        workers=workers,
        cluster={
            "enabled": True,
            "redis_url": redis_url,
            "key_prefix": prefix,
            # Synced by hand, a few ms apart: no peer may expire between two ticks on a slow box.
            "expiry_s": 30.0,
            "op_timeout_s": 5.0,
            "share_learned": False,
        },
    )


def probed(gw: Gateway) -> Gateway:
    """``gw`` with every worker answering its probe, serving MODEL."""
    for name in gw.registry.workers:
        gw.registry.probe_ok(name, CARDS, None)
    return gw


def sync_of(gw: Gateway) -> ClusterSync:
    assert gw.cluster is not None
    return gw.cluster


async def tick(*gws: Gateway) -> None:
    """One round trip of each gateway's sync, in order."""
    for gw in gws:
        assert await sync_of(gw).sync_once()


@contextlib.asynccontextmanager
async def replicas(redis_url: str, prefix: str, *w0s: str | None) -> AsyncIterator[list[Gateway]]:
    """One probed gateway per entry of ``w0s`` (where each has w0), their syncs stopped after."""
    gws = [probed(Gateway(pair_settings(redis_url, prefix, w0))) for w0 in w0s]
    try:
        yield gws
    finally:
        for gw in gws:
            await sync_of(gw).stop()
