"""A stream whose client hangs up after a worker had it, before its first token, is settled as
the quota conventions settle a disconnect (the prompt, plus nothing streamed): it counts against
the tenant's RPM and TPM. It used to be refunded whole, RPM included, so a tenant could fire
unlimited prefills at a rate-limited key by abandoning each one.

Worker: an in-process vLLM stand-in that takes 5 s to its first byte (a long prefill: far more than
the test needs to hang up before it, even on a loaded host).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.config import Settings
from tests.gateway.conftest import (
    MODEL,
    SCRIPTED_EVENTS,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
    until,
)

KEY = "kvg-abandon-rpm"


@contextlib.asynccontextmanager
async def slow_prefill_worker() -> AsyncIterator[tuple[str, list[int]]]:
    received: list[int] = []

    async def chat(request: Request) -> Response:
        await request.body()
        received.append(1)

        async def gen() -> AsyncIterator[bytes]:
            await asyncio.sleep(5.0)  # prefill
            for ev in SCRIPTED_EVENTS:
                yield ev

        return StreamingResponse(gen(), media_type="text/event-stream")

    async with serve_app(stub_app(chat)) as url:
        yield url, received


async def settled(g: Any, n: int) -> None:
    """Until the gateway has recorded ``n`` requests (polled: the walk notices the hang-up and
    settles on its own time, later on a loaded host)."""
    deadline = time.monotonic() + 10
    while True:
        m = await g.metrics()
        done = sum(v for k, v in m.items() if k.startswith("kvgate_requests_total{"))
        if done >= n:
            return
        assert time.monotonic() < deadline, f"{done} of {n} requests recorded"
        await asyncio.sleep(0.05)


async def test_streams_abandoned_before_their_first_token_count_against_rpm() -> None:
    async with slow_prefill_worker() as (url, received):
        base = settings_for([url])
        data = base.model_dump()
        data["tenants"] = {
            "t": {
                "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                "rpm": 2,
                "burst_requests": 2,
            }
        }
        async with run_gateway(Settings(**data)) as g:
            await g.wait_healthy(1)
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                    "max_tokens": 4,
                }
            )
            host, port = g.url.removeprefix("http://").split(":")
            for i in range(2):  # the whole burst, each attempt abandoned on the worker
                _reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    b"content-type: application/json\r\n"
                    + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                await until(lambda n=i + 1: len(received) == n, 10, "on the worker, prefilling")
                writer.transport.abort()  # the client gives up before the first token
                await settled(g, i + 1)
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(
                    g.url + "/v1/chat/completions",
                    content=body,
                    headers={"authorization": f"Bearer {KEY}"},
                )
            assert r.status_code == 429, "2 abandoned attempts with rpm=2/burst=2 consumed no RPM"
            assert len(received) == 2  # both reached the worker; the third did not
