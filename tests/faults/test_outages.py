"""Load through outages of the parts the gateway depends on: Redis restarting under load, and a
worker process crashing under load. Each ends with the fault suite's checks: only intended
outcomes reached clients (200, or a 503 with Retry-After where that is the configured answer),
every rejection is OpenAI-shaped, nothing is held anywhere (leases and reservations in Redis
included), and the heap is back near where it was before the fault.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from bench.redis_server import RedisServer
from tests.faults.conftest import (
    HEAP_LIMIT,
    KEY_CAPPED,
    KEY_OPEN,
    MODEL,
    Stack,
    assert_openai_error,
    fault_settings,
    memory_watch,
    run_stack,
)
from tests.gateway.conftest import run_gateway, start_sims, until


def chat(i: int, max_tokens: int = 32) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: " + "words " * 30}],
        "max_tokens": max_tokens,
        "stream": i % 4 != 0,
    }


async def one(c: httpx.AsyncClient, url: str, body: dict[str, Any], key: str) -> tuple[int, str]:
    """(status, how it ended: done / error_then_done / body / the error code)."""
    headers = {"authorization": f"Bearer {key}"}
    async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        raw = await r.aread()
    if r.status_code != 200:
        err = assert_openai_error(r.status_code, r.headers.get("content-type", ""), raw)
        if r.status_code in (429, 503):
            assert int(r.headers["retry-after"]) >= 1, r.headers
        return r.status_code, str(err["code"])
    if not body["stream"]:
        assert orjson.loads(raw)["choices"], raw[:300]
        return 200, "body"
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    return 200, "error_then_done" if b'"error"' in raw else "done"


async def load(
    url: str, n: int, concurrency: int, key_of: Callable[[int], str], start: int = 0
) -> list[tuple[str, int, str]]:
    """n requests, `concurrency` at a time: (key, status, ending) each."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(c: httpx.AsyncClient, i: int) -> tuple[str, int, str]:
        async with sem:
            key = key_of(i)
            return (key, *await one(c, url, chat(start + i), key))

    async with httpx.AsyncClient(timeout=60) as c:
        return await asyncio.gather(*(bounded(c, i) for i in range(n)))


async def test_load_through_a_redis_restart() -> None:
    # AOF with fsync per write: Redis comes back holding the reservations that were open when it
    # died, as one restarted or failed over with its data would. The settlements of requests
    # that finished during the outage must be replayed, or their leases stay until lease expiry.
    with RedisServer(extra_config=["appendonly yes", "appendfsync always"]) as redis:
        quota = {
            "backend": "redis",
            "redis_url": redis.url,
            "key_prefix": "faults:",
            "breaker_failures": 1,
            "breaker_cooldown_s": 0.3,
            "socket_timeout_s": 0.2,
            "op_timeout_s": 0.3,
        }
        # "capped" fails closed (503 while Redis is down), "open" fails open (local limiter).
        closed = {"capped": {"on_store_failure": "closed"}}
        async with run_stack(2, profile="default", quota=quota, tenants=closed) as st:

            def key_of(i: int) -> str:
                return KEY_OPEN if i % 2 else KEY_CAPPED

            with memory_watch() as heap:
                await load(st.url, 16, 8, key_of)  # warm-up: pools, metric children, scripts
                await st.assert_quiescent()
                heap.mark()

                async def outage() -> None:
                    await until(  # requests in flight (both tenants send from the start)
                        lambda: sum(w.in_flight for w in st.gw.registry.workers.values()) >= 4,
                        10,
                        "requests in flight",
                        step=0.001,
                    )
                    redis.kill()
                    await asyncio.sleep(1.5)
                    await asyncio.to_thread(redis.start)

                _, results = await asyncio.gather(outage(), load(st.url, 80, 8, key_of, start=1000))
                outcomes = Counter(results)
                allowed = {
                    (KEY_OPEN, 200, "done"),
                    (KEY_OPEN, 200, "body"),
                    (KEY_CAPPED, 200, "done"),
                    (KEY_CAPPED, 200, "body"),
                    (KEY_CAPPED, 503, "quota_store_unavailable"),
                }
                assert set(outcomes) <= allowed, outcomes
                # The outage was felt by the fail-closed tenant, not by the fail-open one.
                assert outcomes[(KEY_CAPPED, 503, "quota_store_unavailable")] >= 1, outcomes
                open_ok = sum(n for (k, s, _), n in outcomes.items() if k == KEY_OPEN and s == 200)
                assert open_ok == 40, outcomes

                # Settlements made while Redis was down were replayed: no lease or open
                # reservation is left in Redis, long before any lease could expire.
                await st.assert_quiescent(timeout=15)
                m = st.metrics()
                assert m['kvgate_quota_store_circuit{state="closed"}'] == 1
                replayed = m.get(
                    'kvgate_quota_deferred_settlements_outcomes_total{outcome="replayed"}', 0
                )
                assert replayed >= 1, m
                assert m['kvgate_quota_degraded_admissions_total{tenant="open"}'] >= 1
                # Usage records of requests that finished during the outage were buffered and
                # written once Redis answered: one per served request (at least once: dedupe).
                deadline = time.monotonic() + 10
                while st.gw.usage.buffered:  # type: ignore[attr-defined]
                    assert time.monotonic() < deadline, "usage buffer never flushed"
                    await asyncio.sleep(0.05)
                client = st.gw.quota.shared.client  # type: ignore[attr-defined]
                entries = await client.xrange(st.gw.settings.quota.usage_stream)
                served = {e[b"request_id"] for _, e in entries if e[b"status"] == b"200"}
                n_ok = sum(n for (_, s, _), n in outcomes.items() if s == 200)
                assert len(served) == 16 + n_ok, (len(served), n_ok)
                assert m["kvgate_usage_records_dropped_total"] == 0
                heap.assert_near_baseline(HEAP_LIMIT)


async def test_a_worker_process_crashing_under_load() -> None:
    # Three worker processes; one exits (os._exit, like a segfaulting engine) on its 6th
    # request, with streams of its own in flight.
    healthy = [start_sims(1, profile="default") for _ in range(2)]
    crasher = start_sims(1, "--crash-after-requests", "6", profile="default")
    procs = [*healthy, crasher]
    try:
        urls = [u for p in procs for u in p.urls]
        s = fault_settings(
            urls,
            routing={"policy": "round_robin"},
            probes={"interval_s": 0.2, "timeout_s": 1.0, "unhealthy_after": 2},
        )
        async with run_gateway(s) as running:
            assert running.server is not None
            st = Stack(running.url, 0, running.gw, running.server, None)
            deadline = time.monotonic() + 10
            while len(st.gw.registry.healthy()) < 3:
                assert time.monotonic() < deadline, "workers never became healthy"
                await asyncio.sleep(0.02)
            with memory_watch() as heap:
                # Warm-up on the two survivors only, so the crasher's count is untouched.
                st.gw.registry.drain("w2")  # the crasher
                await load(st.url, 12, 6, lambda i: KEY_OPEN)
                await st.assert_quiescent()
                st.gw.registry.drain("w2", False)
                heap.mark()

                results = await load(st.url, 60, 8, lambda i: KEY_OPEN, start=1000)
                crasher.proc.wait(10)  # it really died
                outcomes = Counter((status, how) for _, status, how in results)
                # Failures before the first byte were retried on a survivor; streams cut by the
                # crash ended with an SSE error event and [DONE]; nothing else.
                assert set(outcomes) <= {
                    (200, "done"),
                    (200, "body"),
                    (200, "error_then_done"),
                }, outcomes
                assert outcomes[(200, "done")] + outcomes[(200, "body")] >= 45, outcomes
                assert st.gw.registry.workers["w2"].health != "healthy"
                await st.assert_quiescent(timeout=10)
                for p in healthy:
                    async with httpx.AsyncClient() as c:
                        text = (await c.get(p.urls[0] + "/metrics")).text
                    assert "vllm:num_requests_running{" in text
                    for line in text.splitlines():
                        if line.startswith(
                            ("vllm:num_requests_running{", "vllm:num_requests_waiting{")
                        ):
                            assert float(line.rsplit(" ", 1)[1]) == 0, line
                heap.assert_near_baseline(HEAP_LIMIT)
    finally:
        for p in procs:
            p.kill()
