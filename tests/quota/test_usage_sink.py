"""The Redis usage-record sink across an outage: records are buffered in order, bounded, and
written when Redis answers again. A real redis-server, killed and restarted on its port."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from bench.redis_server import RedisServer
from gateway.usage import RedisStreamSink


async def wait_empty(sink: RedisStreamSink, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sink.buffered:
        assert time.monotonic() < deadline, "buffer never flushed"
        await asyncio.sleep(0.02)


async def ids(client: aioredis.Redis, stream: str) -> list[str]:
    return [e[b"request_id"].decode() for _, e in await client.xrange(stream)]


@contextlib.asynccontextmanager
async def sink_on_redis(
    **kw: Any,
) -> AsyncIterator[tuple[RedisServer, aioredis.Redis, RedisStreamSink]]:
    """A fresh redis-server (no persistence), a client, a sink on "usage". Generous timeouts: a
    write that a loaded host answers late must not count as an outage (the outages here are a
    killed server, refused at once)."""
    with RedisServer() as server:
        client = aioredis.from_url(server.url, socket_timeout=2.0, socket_connect_timeout=2.0)
        sink = RedisStreamSink(client, "usage", 1000, **kw)
        try:
            yield server, client, sink
        finally:
            await sink.close()
            await client.aclose()


async def test_records_written_during_an_outage_arrive_in_order_after_it() -> None:
    async with sink_on_redis(retry_s=0.05) as (server, client, sink):
        await sink.write({"request_id": "a", "tokens": 1, "worker": None})
        server.kill()
        for rid in ("b", "c", "d"):
            await sink.write({"request_id": rid, "tokens": 2})
        assert sink.buffered == 3
        server.start()  # empty: no persistence
        await sink.write({"request_id": "e", "tokens": 3})  # queued behind the backlog
        await wait_empty(sink)
        assert await ids(client, "usage") == ["b", "c", "d", "e"]
        rec = (await client.xrange("usage"))[0][1]
        assert rec == {b"request_id": b"b", b"tokens": b"2"}
        assert sink.dropped == 0


async def test_the_buffer_is_bounded_and_drops_the_oldest() -> None:
    async with sink_on_redis(buffer_max=2, retry_s=0.05) as (server, client, sink):
        server.kill()
        for rid in ("a", "b", "c"):
            await sink.write({"request_id": rid})
        assert (sink.buffered, sink.dropped) == (2, 1)
        server.start()
        await wait_empty(sink)
        assert await ids(client, "usage") == ["b", "c"]


async def test_close_writes_what_it_can_and_stops_the_flusher() -> None:
    async with sink_on_redis(retry_s=60) as (server, client, sink):  # the flusher would wait
        server.kill()
        await sink.write({"request_id": "a"})
        server.start()
        await sink.close()  # flushes once on the way out
        assert await ids(client, "usage") == ["a"]
