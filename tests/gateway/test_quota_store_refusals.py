"""Finding 1: a Redis that cannot take writes (a demoted master after a failover: READONLY; a
failed RDB save: MISCONF; min-replicas-to-write unmet: NOREPLICAS) answers the quota *scripts*
with an error the store does not recognise as an outage: on Redis 5/6 every in-script error is
wrapped as "Error running script ...: -READONLY ...", and MISCONF/NOREPLICAS are not in
the store's list on any version. `RedisQuotaStore._run` turned them into QuotaStoreError, which
QuotaGate neither counted against the breaker nor deferred (token accounting review):

* admit: every limited tenant's request is a 500 internal_error (no fail-open, no fail-closed
  503 with Retry-After, breaker stays closed);
* settle: the exception escapes `Settlement.settle` with the ticket already `done`: the stream
  never gets its [DONE], no usage record is written, and the lease + full reservation stay in
  Redis until lease_ttl_s even after Redis is writable again.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis.asyncio as aioredis

from bench.redis_server import RedisServer, free_port
from tests.gateway.accounting_stubs import (
    DONE,
    HEADERS,
    ROLE,
    chat_body,
    completion_doc,
    content,
    streaming_worker,
    tenant_settings,
    usage_chunk,
    wait_for,
    whole_worker,
)
from tests.gateway.conftest import run_gateway, serve_app


@pytest.fixture
def redis_srv():  # type: ignore[no-untyped-def]
    srv = RedisServer(free_port())
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


def quota(srv: RedisServer, tmp_path) -> dict:  # type: ignore[no-untyped-def]
    return {
        "backend": "redis",
        "redis_url": srv.url,
        "socket_timeout_s": 1.0,
        "op_timeout_s": 2.0,
        "breaker_failures": 1,
        "breaker_cooldown_s": 0.5,
    }


async def demote(srv: RedisServer) -> None:
    """What a failover does to the old master: it becomes a read-only replica."""
    r = aioredis.from_url(srv.url)
    await r.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
    await r.aclose()


async def promote(srv: RedisServer) -> None:
    r = aioredis.from_url(srv.url)
    await r.execute_command("REPLICAOF", "NO", "ONE")
    await r.aclose()


async def test_admission_on_a_read_only_redis_fails_open_not_500(redis_srv, tmp_path) -> None:  # type: ignore[no-untyped-def]
    app = whole_worker(
        lambda body: (
            200,
            completion_doc({"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}),
        )
    )
    async with serve_app(app) as wurl:
        s = tenant_settings([wurl], quota(redis_srv, tmp_path), on_store_failure="open")
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=15) as c:
                ok = await c.post(
                    g.url + "/v1/chat/completions", content=chat_body(False), headers=HEADERS
                )
                assert ok.status_code == 200, ok.text
                await demote(redis_srv)
                r = await c.post(
                    g.url + "/v1/chat/completions", content=chat_body(False), headers=HEADERS
                )
            # on_store_failure = "open": the documented answer is the degraded local limiter.
            assert r.status_code == 200, (
                f"Redis read-only (failover) gave HTTP {r.status_code} {r.text[:160]}; "
                f"breaker={g.gw.quota.breaker.state.value}"
            )


async def test_a_settlement_on_a_read_only_redis_is_deferred_not_lost(redis_srv, tmp_path) -> None:  # type: ignore[no-untyped-def]
    gate = asyncio.Event()
    app = streaming_worker(
        [ROLE, content("a"), content("b")], [content("c", "length"), usage_chunk(5, 3), DONE], gate
    )
    async with serve_app(app) as wurl:
        s = tenant_settings([wurl], quota(redis_srv, tmp_path), on_store_failure="open")
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            store = g.gw.quota.shared
            limits = g.gw.tenants.by_name["t"].limits
            async with httpx.AsyncClient(timeout=15) as c:
                body = b""
                broke = ""
                async with c.stream(
                    "POST", g.url + "/v1/chat/completions", content=chat_body(True), headers=HEADERS
                ) as resp:
                    assert resp.status_code == 200
                    it = resp.aiter_bytes()
                    body += await it.__anext__()  # the stream is admitted and running
                    await demote(redis_srv)  # failover while it streams
                    gate.set()
                    try:
                        async for chunk in it:
                            body += chunk
                    except httpx.HTTPError as e:
                        broke = type(e).__name__
            await promote(redis_srv)  # the new master is writable again

            async def freed() -> bool:
                return (await store.usage("t", limits))["in_flight"] == 0

            released = await wait_for(freed, 8.0)
            in_flight = (await store.usage("t", limits))["in_flight"]
            assert body.endswith(DONE) and released, (
                f"stream ended with [DONE]: {body.endswith(DONE)} (client error: {broke!r}); "
                f"Redis writable again for 8 s, tenant still holds {in_flight} lease(s); "
                f"deferred settlements: {g.gw.quota.deferred}"
            )


@pytest.mark.parametrize("fault", ["READONLY", "MISCONF", "NOREPLICAS"])
async def test_write_refusals_from_the_scripts_are_unavailable(redis_srv, tmp_path, fault) -> None:  # type: ignore[no-untyped-def]
    import os

    from gateway.quota import QuotaStoreUnavailable, Reservation, TenantLimits
    from gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore(redis_srv.url, socket_timeout_s=1.0, op_timeout_s=2.0)
    lim = TenantLimits(rpm=100, tpm=100_000, max_concurrent=4)
    r = aioredis.from_url(redis_srv.url)
    try:
        if fault == "READONLY":
            await r.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        elif fault == "NOREPLICAS":
            await r.execute_command("CONFIG", "SET", "min-replicas-to-write", "1")
        else:  # a failed RDB save with stop-writes-on-bgsave-error (the default)
            d = tmp_path / "rdb"
            d.mkdir()
            await r.execute_command("CONFIG", "SET", "dir", str(d))
            await r.execute_command("CONFIG", "SET", "save", "3600 1")
            os.rmdir(d)
            await r.execute_command("BGSAVE")
            for _ in range(50):
                if (await r.info("persistence"))["rdb_last_bgsave_status"] == "err":
                    break
                await asyncio.sleep(0.05)
        try:
            await store.admit(Reservation("t", "rid-1", "m", 10, lim))
        except QuotaStoreUnavailable:
            pass
        except Exception as e:
            pytest.fail(
                f"{fault}: admit raised {type(e).__name__}, not QuotaStoreUnavailable: "
                f"{str(e)[:140]}"
            )
    finally:
        await r.aclose()
        await store.close()
