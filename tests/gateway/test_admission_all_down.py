"""Requests waiting in the admission queue when the last worker of their model goes down get the
503 a new request gets, not the whole of their deadline.

Review finding: a new request for a model with no healthy worker was refused at once, but the
ones already queued waited out their deadline (20 s here; `max_deadline_s` 30 s by default) and
then read "No worker became free within this request's deadline" with a Retry-After of 1 s.
"""

from __future__ import annotations

import asyncio

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
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

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_queued_requests_are_refused_when_their_models_last_worker_goes_down() -> None:
    healthy = True
    hold = asyncio.Event()

    async def chat(request: Request) -> Response:
        await hold.wait()
        return JSONResponse(chat_completion())

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200 if healthy else 500)

    app = stub_app(chat)
    app.router.routes[0] = Route("/health", health)
    async with serve_app(app, force_exit=True) as url:
        s = settings_for([url], admission={"default_deadline_s": 20, "max_deadline_s": 30})
        workers = [w.model_copy(update={"max_concurrency": 1}) for w in s.workers]
        s = s.model_copy(update={"workers": workers})
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(1)
            tasks = [
                asyncio.create_task(c.post(g.url + "/v1/chat/completions", json=BODY))
                for _ in range(4)
            ]
            await until(lambda: g.gw.admission.queued() == 3, 10, "three queued")
            healthy = False
            await until(lambda: not g.gw.registry.healthy(), 15, "the worker down")
            done, _pending = await asyncio.wait(tasks, timeout=10)
            hold.set()
            refused = [t.result() for t in done]
            assert len(refused) >= 3, "the queued requests waited on"
            for r in refused:
                err = r.json()["error"]
                assert r.status_code == 503 and "no healthy worker" in err["message"], r.text
            assert g.gw.admission.queued() == 0
            await asyncio.gather(*tasks, return_exceptions=True)
