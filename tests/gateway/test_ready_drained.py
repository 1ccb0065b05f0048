"""`/ready` counts only workers that take new requests, and a 405 names the allowed methods.

Review findings: a replica whose every worker was drained answered `/ready` 200 (drained workers
are healthy) while it refused every request with a 503, so its balancer kept sending it traffic;
a 405 came without the `Allow` header RFC 9110 requires.
"""

from __future__ import annotations

import hashlib

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config import Settings
from tests.gateway.conftest import chat_completion, run_gateway, serve_app, settings_for, stub_app

ADMIN = {"authorization": "Bearer kvg-admin-test"}


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
            r = await c.delete(g.url + "/admin/workers/w0/drain", headers=ADMIN)
            assert r.status_code == 200, r.text
            assert (await c.get(g.url + "/ready")).status_code == 200

            r = await c.put(g.url + "/admin/workers", headers=ADMIN)
            assert r.status_code == 405 and r.json()["error"]["message"]
            allowed = {m.strip() for m in r.headers["allow"].split(",")}
            assert {"GET", "POST"} <= allowed, r.headers
