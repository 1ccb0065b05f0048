"""A non-streaming response is settled while the dispatch's disconnect watch is still armed. A
client that hung up while that settlement talked to Redis used to cancel it half way: the
ticket was already marked done, so nothing settled again, and the tenant's concurrency lease
stayed in Redis until `lease_ttl_s` (a false 429 at `max_concurrent` meanwhile).

The Redis round trip is made slow (0.3 s, under `op_timeout_s`) by a wrapper around the real
store's settle, standing in for a loaded Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.config import Settings
from tests.gateway.conftest import MODEL, run_gateway, settings_for, start_sims

pytestmark = pytest.mark.asyncio

KEY = "kvg-settle-key"


@pytest.fixture
def sim() -> Iterator[list[str]]:
    sp = start_sims(1)
    try:
        yield sp.urls
    finally:
        sp.kill()


async def test_a_client_leaving_during_a_whole_responses_settlement_leaks_no_lease(
    redis, sim
) -> None:  # type: ignore[no-untyped-def]
    # Generous Redis timeouts: a loaded host's slow round trip is not what this tests.
    quota = {
        "backend": "redis",
        "redis_url": redis.url,
        "socket_timeout_s": 2.0,
        "op_timeout_s": 5.0,
    }
    base = settings_for(sim, quota=quota)
    data = base.model_dump()
    data["tenants"] = {
        "t": {
            "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
            "rpm": 600,
            "tpm": 1_000_000,
            "max_concurrent": 1,
        }
    }
    s = Settings(**data)
    async with run_gateway(s) as g:
        await g.wait_healthy(1)
        store = g.gw.quota.shared
        real_settle = store.settle
        started = asyncio.Event()
        outcome: list[str] = []

        async def slow_settle(*a, **kw):  # type: ignore[no-untyped-def]
            started.set()
            try:
                await asyncio.sleep(0.3)  # a slow Redis round trip
                r = await real_settle(*a, **kw)
                outcome.append("settled")
                return r
            except asyncio.CancelledError:
                outcome.append("cancelled")
                raise

        store.settle = slow_settle  # type: ignore[method-assign]

        body = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        host, port = g.url.removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await asyncio.wait_for(started.wait(), 10)
        writer.transport.abort()  # the client goes away while the settle is in flight
        deadline = time.monotonic() + 10
        while not outcome:  # the settle ran to its end, or was cancelled half way
            assert time.monotonic() < deadline, "the settle never ended"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the walk's own handling of the disconnect, after it

        in_flight_redis = (await store.usage("t"))["in_flight"]

        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(
                g.url + "/v1/chat/completions",
                content=body,
                headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
            )
        assert outcome[0] == "settled"  # not cancelled half way
        # Counted once: the walk's own handling of the disconnect finds it recorded already.
        m = await g.metrics()
        assert sum(v for k, v in m.items() if k.startswith("kvgate_requests_total{")) == 2
        assert in_flight_redis == 0 and r.status_code == 200, (
            f"settle {outcome}; lease leaked ({in_flight_redis} in Redis); next request "
            f"{r.status_code}"
        )
