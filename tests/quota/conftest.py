"""Quota fixtures: one real redis-server per session, and every store test run on both backends.

Redis tests isolate by key prefix (one per test) instead of FLUSHALL, so they stay cheap. The
memory backend runs on a fake clock, so its tests check exact values; the Redis backend uses the
server's own clock, so its assertions leave room for a noisy shared machine.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from bench.redis_server import RedisServer
from gateway.quota import QuotaStore
from gateway.quota_memory import MemoryQuotaStore
from gateway.quota_redis import RedisQuotaStore

EPOCH = 1_750_000_000.0  # a realistic wall-clock magnitude, so float precision is as in prod


class FakeClock:
    """Seconds since the epoch that only move when told to."""

    def __init__(self, start: float = EPOCH) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Harness:
    kind: str
    store: QuotaStore
    clock: FakeClock | None

    @property
    def exact(self) -> bool:
        """True when time only moves on `sleep` (memory backend, fake clock)."""
        return self.clock is not None

    async def sleep(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "redis"])
async def h(
    request: pytest.FixtureRequest, prefix: str, clock: FakeClock
) -> AsyncIterator[Harness]:
    if request.param == "memory":
        store: QuotaStore = MemoryQuotaStore(prefix=prefix, clock=clock)
        yield Harness("memory", store, clock)
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        store = RedisQuotaStore(server.url, prefix=prefix, socket_timeout_s=2.0, op_timeout_s=5.0)
        yield Harness("redis", store, None)
    await store.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server this test may stop, kill and restart."""
    with RedisServer() as server:
        yield server
