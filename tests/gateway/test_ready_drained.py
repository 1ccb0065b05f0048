"""`/ready` counts only workers that take new requests, and a 405 names the allowed methods.

Review findings: a replica whose every worker was drained answered `/ready` 200 (drained workers
are healthy) while it refused every request with a 503, so its balancer kept sending it traffic;
a 405 came without the `Allow` header RFC 9110 requires; requests queued for a model whose
last worker was drained waited out their deadline.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config import Settings
from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
    until,
)

ADMIN = {"authorization": "Bearer kvg-admin-test"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _ok(request: Request) -> Response:
    return JSONResponse(chat_completion())


async def test_ready_fails_when_every_worker_is_drained_and_a_405_lists_the_methods() -> None:
    async with serve_app(stub_app(_ok)) as url:
        s = settings_for([url]).model_dump()
        s["admin"] = {"key_sha256": hashlib.sha256(b"kvg-admin-test").hexdigest()}
        async with run_gateway(Settings(**s)) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(1)
            r = await c.get(g.url + "/ready")
            assert r.status_code == 200 and r.json()["healthy_workers"] == 1
            r = await c.post(g.url + "/admin/workers/w0/drain", headers=ADMIN)
            assert r.status_code == 200, r.text
            r = await c.get(g.url + "/ready")
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["ready"] is False
            assert (body["healthy_workers"], body["draining_workers"]) == (0, 1)
            # Its models go from /v1/models too: a request for them gets a 503 (review).
            r = await c.get(g.url + "/v1/models")
            assert r.status_code == 200 and r.json()["data"] == [], r.text
            r = await c.delete(g.url + "/admin/workers/w0/drain", headers=ADMIN)
            assert r.status_code == 200, r.text
            assert (await c.get(g.url + "/ready")).status_code == 200

            r = await c.put(g.url + "/admin/workers", headers=ADMIN)
            assert r.status_code == 405 and r.json()["error"]["message"]
            allowed = {m.strip() for m in r.headers["allow"].split(",")}
            assert {"GET", "POST"} <= allowed, r.headers


async def test_draining_a_models_last_worker_answers_its_queued_requests_at_once() -> None:
    # Review finding: requests queued for the model waited out their deadline, then read "no
    # worker became free", while a new request got "no healthy worker is serving" at once.
    release = asyncio.Event()

    async def slow(request: Request) -> Response:
        await release.wait()
        return JSONResponse(chat_completion())

    async with serve_app(stub_app(slow), force_exit=True) as url:
        s = settings_for([url], admission={"default_deadline_s": 20, "max_deadline_s": 30})
        d = s.model_dump()
        d["admin"] = {"key_sha256": hashlib.sha256(b"kvg-admin-test").hexdigest()}
        d["workers"][0]["max_concurrency"] = 1
        async with run_gateway(Settings(**d)) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(1)
            post = functools.partial(c.post, g.url + "/v1/chat/completions", json=BODY)
            first = asyncio.create_task(post())
            await until(lambda: g.gw.registry.workers["w0"].in_flight == 1, 10, "w0 busy")
            queued = [asyncio.create_task(post()) for _ in range(2)]
            await until(lambda: g.gw.admission.queued() == 2, 10, "two queued")
            r = await c.post(g.url + "/admin/workers/w0/drain", headers=ADMIN)
            assert r.status_code == 200, r.text
            done, _ = await asyncio.wait(queued, timeout=8)
            assert len(done) == 2, "the queued requests waited on"
            for t in done:
                r = t.result()
                assert r.status_code == 503, r.text
                assert "no healthy worker is serving" in r.json()["error"]["message"]
            # Readmitted: a request queued behind the running one goes when it ends.
            r = await c.delete(g.url + "/admin/workers/w0/drain", headers=ADMIN)
            assert r.status_code == 200 and not r.json()["draining"]
            again = asyncio.create_task(post())
            await until(lambda: g.gw.admission.queued() == 1, 10, "queued again")
            release.set()
            assert (await first).status_code == 200
            assert (await again).status_code == 200
