"""A worker whose model list changes (restarted serving other models, still healthy) takes its
queued requests' answer with it: requests queued for a model nothing serves any more get at once
what a new request gets, 404 where no worker lists the model, else 503. So do requests queued
for a model whose last worker a reload removed, unless a worker still starting may serve it.

Review finding: no health changed, so nothing refused them: they waited out their whole deadline
(10 s) and read "No worker became free" with a Retry-After of 1 s, while a new request for the
model was answered 404 model_not_found at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    until,
)
from workers.worker import Health, WorkerSpec

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OTHER = "other-model"
# The queued requests' deadline: far beyond the bounded waits below, so only a refusal ends them.
ADMISSION = {"default_deadline_s": 20, "max_deadline_s": 30}


class Worker:
    """A stand-in whose /v1/models and /health change on demand; answers wait for `release`."""

    def __init__(self, models: list[str]) -> None:
        self.models = models
        self.healthy = True
        self.release = asyncio.Event()
        self.received = 0

    def app(self) -> Any:
        async def health(request: Request) -> Response:
            return Response(b"", status_code=200 if self.healthy else 500)

        async def models(request: Request) -> Response:
            data = [{"id": m, "object": "model"} for m in self.models]
            return JSONResponse({"object": "list", "data": data})

        async def chat(request: Request) -> Response:
            await request.body()
            self.received += 1
            await self.release.wait()
            return JSONResponse(chat_completion())

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/v1/models", models),
                Route("/v1/chat/completions", chat, methods=["POST"]),
            ]
        )


def _post(c: httpx.AsyncClient, url: str) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(c.post(url + "/v1/chat/completions", json=BODY))


async def _refused(tasks: list[asyncio.Task[httpx.Response]]) -> list[httpx.Response]:
    done, _pending = await asyncio.wait(tasks, timeout=10)
    assert len(done) == len(tasks), "the queued requests waited on"
    return [t.result() for t in done]


async def test_queued_requests_get_404_when_the_last_worker_stops_listing_their_model() -> None:
    w = Worker([MODEL, OTHER])
    async with serve_app(w.app(), force_exit=True) as url:
        s = settings_for(
            [url], admission=ADMISSION, workers=[{"name": "w0", "url": url, "max_concurrency": 1}]
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(1)
            rec = g.gw.registry.workers["w0"]
            first = _post(c, g.url)
            await until(lambda: w.received == 1, 10, "the worker full")
            queued = [_post(c, g.url) for _ in range(3)]
            await until(lambda: g.gw.admission.queued() == 3, 10, "three queued")
            w.models = [OTHER]  # restarted with another model list: still healthy
            for r in await _refused(queued):
                assert r.status_code == 404, r.text
                assert r.json()["error"]["code"] == "model_not_found"
            assert rec.health is Health.HEALTHY and MODEL not in rec.models
            # Its pool (and per-model series) went with the model.
            assert g.gw.admission.queued() == 0 and MODEL not in g.gw.admission.pools()
            r = await c.post(g.url + "/v1/chat/completions", json=BODY)
            assert r.status_code == 404  # as a new request is answered
            w.release.set()
            assert (await first).status_code == 200


async def test_queued_requests_get_503_when_a_worker_down_still_lists_their_model() -> None:
    w0, w1 = Worker([MODEL, OTHER]), Worker([MODEL])
    async with (
        serve_app(w0.app(), force_exit=True) as u0,
        serve_app(w1.app(), force_exit=True) as u1,
    ):
        s = settings_for(
            [u0, u1],
            admission=ADMISSION,
            workers=[
                {"name": "w0", "url": u0, "max_concurrency": 1},
                {"name": "w1", "url": u1, "max_concurrency": 1},
            ],
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(2)
            reg = g.gw.registry
            held = [_post(c, g.url) for _ in range(2)]
            await until(lambda: w0.received == 1 and w1.received == 1, 10, "both workers full")
            queued = [_post(c, g.url) for _ in range(3)]
            await until(lambda: g.gw.admission.queued() == 3, 10, "three queued")
            w1.healthy = False
            await until(lambda: reg.workers["w1"].health is Health.UNHEALTHY, 10, "w1 down")
            assert g.gw.admission.queued() == 3  # w0 still serves the model
            w0.models = [OTHER]
            for r in await _refused(queued):
                assert r.status_code == 503, r.text
                assert "no healthy worker is serving model" in r.json()["error"]["message"]
            r = await c.post(g.url + "/v1/chat/completions", json=BODY)
            assert r.status_code == 503  # as a new request is answered: w1 may come back
            w0.release.set()
            w1.release.set()
            for r in await asyncio.gather(*held):
                assert r.status_code == 200


async def test_queued_requests_get_404_when_a_reload_removes_the_last_worker_of_their_model() -> (
    None
):
    # Review finding: a worker removed by a reload (or /admin/workers) left the requests queued
    # for its model waiting out their deadline, then "no worker became free".
    w0, w1 = Worker([MODEL]), Worker([OTHER])
    async with (
        serve_app(w0.app(), force_exit=True) as u0,
        serve_app(w1.app(), force_exit=True) as u1,
    ):
        s = settings_for(
            [u0, u1],
            admission=ADMISSION,
            workers=[
                {"name": "w0", "url": u0, "max_concurrency": 1},
                {"name": "w1", "url": u1, "max_concurrency": 1},
            ],
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(2)
            first = _post(c, g.url)
            await until(lambda: w0.received == 1, 10, "w0 full")
            queued = [_post(c, g.url) for _ in range(3)]
            await until(lambda: g.gw.admission.queued() == 3, 10, "three queued")
            g.gw.sync_workers([WorkerSpec("w1", u1, max_concurrency=1)])
            for r in await _refused(queued):
                assert r.status_code == 404, r.text
                assert r.json()["error"]["code"] == "model_not_found"
            assert g.gw.admission.queued() == 0
            w0.release.set()
            assert (await first).status_code == 200  # it ran on the removed record: it ends


async def test_queued_requests_wait_for_the_new_worker_of_a_url_move() -> None:
    # The same reload that removes a model's worker adds its replacement, which has not been
    # probed yet: the queued requests wait for its first probe and run there, not a 404.
    old, new = Worker([MODEL]), Worker([MODEL])
    new.release.set()
    async with (
        serve_app(old.app(), force_exit=True) as u0,
        serve_app(new.app(), force_exit=True) as u1,
    ):
        s = settings_for(
            [u0], admission=ADMISSION, workers=[{"name": "w0", "url": u0, "max_concurrency": 1}]
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(1)
            first = _post(c, g.url)
            await until(lambda: old.received == 1, 10, "the old worker full")
            queued = [_post(c, g.url) for _ in range(3)]
            await until(lambda: g.gw.admission.queued() == 3, 10, "three queued")
            g.gw.sync_workers([WorkerSpec("w0", u1, max_concurrency=1)])
            assert g.gw.registry.workers["w0"].health is Health.STARTING
            for r in await _refused(queued):
                assert r.status_code == 200, r.text
            assert new.received == 3 and old.received == 1
            old.release.set()
            assert (await first).status_code == 200
