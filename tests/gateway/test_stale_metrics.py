"""End to end: what a worker's `/metrics` does must not cost the requests it would serve.

- A `/metrics` that trickles (a busy frontend, a dribbling proxy) ejected a worker that answered
  `/health` and `/v1/models` at once: every chat got a 503.
- A "KV 95% full" from before `/metrics` broke stayed for good: the worker had no room and every
  request waited out its deadline (503), long after the worker emptied.

The workers are Starlette apps on real sockets; the gateway probes them every 0.2 s with a 1 s
timeout (`settings_for`). Only bounded polling, no fixed sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    until,
)
from workers.worker import Health

FULL = (
    b'vllm:kv_cache_usage_perc{engine="0",model_name="sim-llama"} 0.95\n'
    b'vllm:num_requests_running{engine="0",model_name="sim-llama"} 3\n'
)


def worker(metrics: Callable[[int], Awaitable[Response]], scrapes: list[int]) -> Starlette:
    """A worker whose `/metrics` answers ``metrics(n)`` for its n-th scrape."""

    async def health(request: Request) -> Response:
        return Response(b"")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request: Request) -> Response:
        await request.body()
        return JSONResponse(chat_completion())

    async def scrape(request: Request) -> Response:
        scrapes.append(1)
        return await metrics(len(scrapes))

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/metrics", scrape),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


async def chat_status(url: str) -> int:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
    return r.status_code


async def test_a_trickling_metrics_keeps_the_worker_in_and_serving() -> None:
    async def trickle(n: int) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for _ in range(600):  # a minute of 4 bytes every 100 ms
                yield b"# x\n"
                await asyncio.sleep(0.1)

        return StreamingResponse(body(), media_type="text/plain")

    scrapes: list[int] = []
    async with serve_app(worker(trickle, scrapes), force_exit=True) as url:
        settings = settings_for([url])
        async with run_gateway(settings) as g:
            await g.wait_healthy(1)
            w = g.gw.registry.workers["w0"]
            # Past unhealthy_after (2) probes, each of which would have timed out before (and
            # an ejected worker is probed with backoff: fewer scrapes, still bounded here).
            await until(lambda: len(scrapes) >= 5, 30, "5 scrapes")
            assert w.health is Health.HEALTHY, w.last_error
            assert (w.consecutive_failures, w.last_error) == (0, "")
            assert await chat_status(g.url) == 200


async def test_a_kv_full_reading_from_before_metrics_broke_stops_holding_requests() -> None:
    async def full_then_broken(n: int) -> Response:
        if n <= 2:
            return Response(FULL, media_type="text/plain")
        return Response(b"boom", status_code=500)

    scrapes: list[int] = []
    async with serve_app(worker(full_then_broken, scrapes)) as url:
        settings = settings_for([url], admission={"default_deadline_s": 2.0})
        async with run_gateway(settings) as g:
            await g.wait_healthy(1)
            w = g.gw.registry.workers["w0"]
            await until(lambda: len(scrapes) >= 2, 10, "the full reading")
            # Dropped a few probes into the outage: unknown, not full; the worker has room.
            await until(lambda: g.gw.slots.worker_room(w) > 0, 10, "room on w0")
            assert w.metrics.kv_usage == 0.0
            assert w.in_flight_at_scrape is None
            assert w.health is Health.HEALTHY
            for _ in range(3):
                assert await chat_status(g.url) == 200
