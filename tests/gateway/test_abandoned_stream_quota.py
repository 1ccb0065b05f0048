"""A stream whose client hangs up after a worker had it, before its first token, is settled as
the quota conventions settle a disconnect (the prompt, plus nothing streamed): it counts against
the tenant's RPM and TPM. It used to be refunded whole, RPM included, so a tenant could fire
unlimited prefills at a rate-limited key by abandoning each one.

Worker: an in-process vLLM stand-in that takes 0.5 s to its first byte (a long prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.config import Settings
from tests.gateway.conftest import MODEL, SCRIPTED_EVENTS, run_gateway, settings_for

KEY = "kvg-abandon-rpm"


@contextlib.asynccontextmanager
async def slow_prefill_worker() -> AsyncIterator[tuple[str, list[int]]]:
    received: list[int] = []

    async def health(request: Request) -> Response:
        return Response(b"")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request: Request) -> Response:
        await request.body()
        received.append(1)

        async def gen() -> AsyncIterator[bytes]:
            await asyncio.sleep(0.5)  # prefill
            for ev in SCRIPTED_EVENTS:
                yield ev

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", received
    finally:
        server.should_exit = True
        await asyncio.wait({task}, timeout=10)
        sock.close()


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
            for _ in range(2):  # the whole burst, each attempt abandoned on the worker
                _reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    b"content-type: application/json\r\n"
                    + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                await asyncio.sleep(0.15)  # on the worker, prefilling
                writer.transport.abort()  # the client gives up before the first token
                await asyncio.sleep(0.1)
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(
                    g.url + "/v1/chat/completions",
                    content=body,
                    headers={"authorization": f"Bearer {KEY}"},
                )
            assert r.status_code == 429, "2 abandoned attempts with rpm=2/burst=2 consumed no RPM"
            assert len(received) == 2  # both reached the worker; the third did not
