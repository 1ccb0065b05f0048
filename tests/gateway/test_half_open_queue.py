"""Requests for a model whose worker is half-open, its trial slots taken, wait in the admission
queue for the trial's verdict; they are not refused as if nothing served the model.

Review finding: a half-open worker left `Registry.candidates` while its trial request ran, so the
walk answered every other request for the model 503 "no healthy worker is serving model" at once
(5 of 5 within 0.2 s of a 3 s trial that then passed), and a worker going down elsewhere meanwhile
failed the requests already queued with that 503 too. And a stream that outlived its worker's
ejection took the only trial slot itself: 23 requests were refused in 12 s while the worker
streamed at 1 of 256 slots; a request sent while it is half-open is now its trial.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
    until,
)
from workers.registry import Registry
from workers.worker import Health

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# Nothing here waits for a deadline: 20 s only keeps a queued request from expiring first.
ADMISSION = {"default_deadline_s": 20, "max_deadline_s": 30}
PROBES = {"interval_s": 0.1, "unhealthy_after": 2, "backoff_initial_s": 0.2}


class Held:
    """A worker whose answers wait for `release`, counting what reached it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.received = 0
        self.healthy = True

    def app(self) -> Any:
        async def chat(request: Request) -> Response:
            await request.body()
            self.received += 1
            await self.release.wait()
            return JSONResponse(chat_completion())

        async def health(request: Request) -> Response:
            return Response(b"", status_code=200 if self.healthy else 500)

        app = stub_app(chat)
        app.router.routes[0] = Route("/health", health)
        return app


async def _half_open(registry: Registry, name: str) -> None:
    """Eject `name` for failed requests (as the proxy reports them), then wait out its hold."""
    w = registry.workers[name]
    for _ in range(registry.unhealthy_after):
        registry.passive_failure(name, "HTTP 502")
    assert w.health is Health.UNHEALTHY and w.ejection_reason == "failures"
    await until(lambda: w.health is Health.HALF_OPEN, 10, f"{name} half-open")


def _post(c: httpx.AsyncClient, url: str) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(c.post(url + "/v1/chat/completions", json=BODY))


async def test_requests_queue_behind_a_half_open_workers_trial_and_go_once_it_passes() -> None:
    worker = Held()
    async with serve_app(worker.app(), force_exit=True) as url:
        s = settings_for([url], probes=PROBES, admission=ADMISSION)
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(1)
            reg = g.gw.registry
            w = reg.workers["w0"]
            await _half_open(reg, "w0")
            trial = _post(c, g.url)
            await until(lambda: worker.received == 1, 10, "the trial request at the worker")
            others = [_post(c, g.url) for _ in range(3)]
            await until(
                lambda: g.gw.admission.queued() == 3 or any(t.done() for t in others),
                10,
                "the others queued or answered",
            )
            answered = [t.result() for t in others if t.done()]
            assert not answered, [(r.status_code, r.text) for r in answered]
            # Queued, not sent: the trial budget (one request) holds.
            assert worker.received == 1 and w.health is Health.HALF_OPEN
            worker.release.set()
            assert (await trial).status_code == 200
            for r in await asyncio.gather(*others):
                assert r.status_code == 200, r.text
            assert w.health is Health.HEALTHY and worker.received == 4


async def test_another_worker_going_down_leaves_requests_queued_for_the_half_open_one() -> None:
    w0, w1 = Held(), Held()
    async with (
        serve_app(w0.app(), force_exit=True) as u0,
        serve_app(w1.app(), force_exit=True) as u1,
    ):
        s = settings_for(
            [u0, u1],
            probes=PROBES,
            admission=ADMISSION,
            workers=[
                {"name": "w0", "url": u0},
                {"name": "w1", "url": u1, "max_concurrency": 1},
            ],
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(2)
            reg = g.gw.registry
            # Drained meanwhile, so that the first request takes w1's only slot, whenever w0's
            # hold ends.
            reg.drain("w0")
            first = _post(c, g.url)
            await until(lambda: w1.received == 1, 10, "w1 full")
            reg.drain("w0", False)
            await _half_open(reg, "w0")
            trial = _post(c, g.url)
            await until(lambda: w0.received == 1, 10, "w0's trial request")
            others = [_post(c, g.url) for _ in range(3)]
            await until(lambda: g.gw.admission.queued() == 3, 10, "three queued")
            w1.healthy = False
            await until(lambda: reg.workers["w1"].health is Health.UNHEALTHY, 10, "w1 down")
            # w0 still serves the model (its trial runs): nothing is refused.
            assert g.gw.admission.queued() == 3
            assert not any(t.done() for t in others)
            w0.release.set()
            assert (await trial).status_code == 200
            for r in await asyncio.gather(*others):
                assert r.status_code == 200, r.text
            assert w0.received == 4
            w1.release.set()
            assert (await first).status_code == 200


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
