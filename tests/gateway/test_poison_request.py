"""A request the engine fails on is the request's fault, not the workers'.

Security review finding: vLLM answers some malformed requests with a 500 in its error envelope
while the worker stays up (an engine error raised for that request). The gateway counted every
such 500 as the worker's failure and retried elsewhere, so one tenant's poison request took a
failure on each worker it was tried on: three of them ejected a healthy worker for every
tenant, refunded in full. Now a 500 answered in the envelope is blamed on the worker only when
another worker served the same request; answered alike by two workers, it is the request's
doing: the client gets the error, no worker is blamed. Nor is it blamed when no other worker
served it for any other reason (review finding): a model's only worker (no other could try),
or a client that left before the second worker answered; either had let one tenant's poison
request eject a worker for every tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
    until,
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


@pytest.mark.parametrize("n", [2, 1])
async def test_poison_requests_eject_no_worker(n: int) -> None:
    """Two workers answering it alike make it the request's doing; one worker alone (a model's
    only worker) has no other to prove it servable: nothing says the worker is at fault, and
    blaming it had ejected the model for every tenant (3 in a row)."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_app(_worker())) for _ in range(n)]
        s = settings_for(urls, probes={"interval_s": 60})  # only requests judge the workers
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(n)
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
        # Round robin: the bad worker is tried on every other request. Under the default policy
        # the prefix these requests share could keep them all on the good one after the first
        # failure, and the bad one then (rarely) never reached its second failure.
        s = settings_for([bad, good], probes={"interval_s": 60}, routing={"policy": "round_robin"})
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(2)
            for i in range(8):
                r = await c.post(g.url + "/v1/chat/completions", json=_chat(f"hello {i}"))
                assert r.status_code == 200, r.text  # retried on the good one when needed
            w0 = g.gw.registry.workers["w0"]
            assert w0.health.value != "healthy", (w0.health, w0.consecutive_failures)


async def test_a_500_is_not_blamed_when_the_client_leaves_before_another_worker_answers() -> None:
    # The first worker tried answers the poison request's 500; the second holds it until the
    # client has gone. No worker served it, so the first worker's 500 proves nothing against it.
    tried: list[str] = []
    second_has_it = asyncio.Event()
    release = asyncio.Event()

    def holding_worker(name: str) -> Any:
        async def chat(request: Request) -> Response:
            await request.body()
            tried.append(name)
            if len(tried) == 1:
                return JSONResponse(ENVELOPE, status_code=500)
            second_has_it.set()
            await release.wait()  # until the test ends: the client leaves first
            return JSONResponse(ENVELOPE, status_code=500)

        return stub_app(chat)

    async with (
        serve_app(holding_worker("a"), force_exit=True) as a,
        serve_app(holding_worker("b"), force_exit=True) as b,
    ):
        s = settings_for([a, b], probes={"interval_s": 60})
        try:
            async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
                await g.wait_healthy(2)
                post = asyncio.create_task(
                    c.post(g.url + "/v1/chat/completions", json=_chat("poison"))
                )
                await second_has_it.wait()
                post.cancel()  # the client hangs up while the second worker has the request
                with contextlib.suppress(asyncio.CancelledError):
                    await post
                workers = list(g.gw.registry.workers.values())
                # Both attempts released: the gateway has left its retry loop (and its blame).
                await until(lambda: all(w.in_flight == 0 for w in workers), 10, "released")
                assert len(tried) == 2
                states = {w.name: (w.health.value, w.consecutive_failures) for w in workers}
                assert states == {"w0": ("healthy", 0), "w1": ("healthy", 0)}
        finally:
            release.set()


async def test_a_501_is_the_requests_answer_not_the_workers_failure() -> None:
    """vLLM answers a request it does not implement (chat to a model without a generate
    runner) with a 501 in its envelope. Blamed and retried, such requests ejected every worker
    of the model (3 in a row each) for every tenant (review)."""
    tried: list[int] = []
    unsupported = {
        "error": {
            "message": "The model does not support Chat Completions API",
            "type": "NotImplementedError",
            "param": None,
            "code": 501,
        }
    }

    def worker(i: int) -> Any:
        async def chat(request: Request) -> Response:
            tried.append(i)
            return JSONResponse(unsupported, status_code=501)

        return stub_app(chat)

    async with serve_app(worker(0)) as a, serve_app(worker(1)) as b:
        s = settings_for([a, b], probes={"interval_s": 60})  # only requests judge the workers
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(2)
            for i in range(6):
                r = await c.post(g.url + "/v1/chat/completions", json=_chat(f"hi {i}"))
                assert r.status_code == 501 and r.json() == unsupported, r.text
            assert len(tried) == 6  # each tried once: no retry
            workers = g.gw.registry.workers.values()
            assert all(w.health.value == "healthy" for w in workers)
            assert all(w.consecutive_failures == 0 for w in workers)
