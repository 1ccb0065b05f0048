"""A request the engine fails on is the request's fault, not the workers'.

Security review finding: vLLM answers some malformed requests with a 500 in its error envelope
while the worker stays up (an engine error raised for that request). The gateway counted every
such 500 as the worker's failure and retried elsewhere, so one tenant's poison request took a
failure on each worker it was tried on: three of them ejected a healthy worker for every
tenant, refunded in full. Now a 500 answered in the envelope is blamed on the worker only when
another worker served the same request (or none other could try it); answered alike by two
workers, it is the request's doing: the client gets the error, no worker is blamed.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
)

ENVELOPE = {"error": {"message": "", "type": "InternalServerError", "param": None, "code": 500}}


def _worker(fail_all: bool = False) -> Any:
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if fail_all or "poison" in orjson.dumps(body).decode():
            return JSONResponse(ENVELOPE, status_code=500)
        return JSONResponse(chat_completion())

    return stub_app(chat)


def _chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


async def test_poison_requests_eject_no_worker() -> None:
    async with serve_app(_worker()) as a, serve_app(_worker()) as b:
        s = settings_for([a, b], probes={"interval_s": 60})  # only requests judge the workers
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(2)
            for _ in range(6):
                r = await c.post(g.url + "/v1/chat/completions", json=_chat("poison"))
                assert r.status_code == 500
                assert r.json()["error"]["type"] == "InternalServerError"  # the worker's own
            workers = g.gw.registry.workers.values()
            assert all(w.health.value == "healthy" for w in workers)
            assert all(w.consecutive_failures == 0 for w in workers)
            r = await c.post(g.url + "/v1/chat/completions", json=_chat("hello"))
            assert r.status_code == 200, r.text


async def test_a_worker_that_fails_what_another_serves_is_still_blamed() -> None:
    async with serve_app(_worker(fail_all=True)) as bad, serve_app(_worker()) as good:
        s = settings_for([bad, good], probes={"interval_s": 60})
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(2)
            for i in range(8):
                r = await c.post(g.url + "/v1/chat/completions", json=_chat(f"hello {i}"))
                assert r.status_code == 200, r.text  # retried on the good one when needed
            w0 = g.gw.registry.workers["w0"]
            assert w0.health.value != "healthy", (w0.health, w0.consecutive_failures)
