"""A stream that outlived its worker's ejection takes no trial slot: a request sent while the worker
is half-open is its trial, served at once, not held until that stream ends (review: 23 requests
refused in 12 s while the worker streamed at 1 of 256 slots)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
    until,
)
from workers.worker import Health

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ADMISSION = {"default_deadline_s": 20, "max_deadline_s": 30}
PROBES = {"interval_s": 0.1, "unhealthy_after": 2, "backoff_initial_s": 0.2}
CHUNK = {
    "id": "x",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}],
}


async def test_a_stream_from_before_the_ejection_leaves_the_trial_slot_free() -> None:
    end_stream = asyncio.Event()

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        if not body.get("stream"):
            return JSONResponse(chat_completion())

        async def gen() -> AsyncIterator[bytes]:
            while not end_stream.is_set():  # a token every 0.5 s: never idle long enough to cut
                yield b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(end_stream.wait(), 0.5)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async with serve_app(stub_app(chat), force_exit=True) as url:
        s = settings_for([url], probes=PROBES, admission=ADMISSION)
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(1)
            reg = g.gw.registry
            w = reg.workers["w0"]
            first_chunk = asyncio.Event()

            async def stream() -> int:
                body = {**BODY, "stream": True}
                async with c.stream("POST", g.url + "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        first_chunk.set()
                    return r.status_code

            old = asyncio.create_task(stream())
            await first_chunk.wait()
            for _ in range(reg.unhealthy_after):
                reg.passive_failure("w0", "HTTP 502")
            await until(lambda: w.health is Health.HALF_OPEN, 10, "half-open")
            assert w.in_flight == 1  # the old stream, still running
            trial = asyncio.create_task(c.post(g.url + "/v1/chat/completions", json=BODY))
            done, _ = await asyncio.wait({trial}, timeout=10)
            assert done, "the trial waited for the old stream to end"
            assert trial.result().status_code == 200 and w.health is Health.HEALTHY
            assert not old.done()
            end_stream.set()
            assert await old == 200
