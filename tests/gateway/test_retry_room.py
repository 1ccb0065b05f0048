"""A retry after a worker's refusal goes where there is room, or waits for it; it never pushes a
full worker past its concurrency cap.

Review finding: admission counts the free slots of every worker of the model, the broken one's
too, so requests were admitted onto a worker that answered 503 to everything; their retries then
took `Slots.eligible`'s fallback to workers with no room, and a worker capped at 1 ran 3 at once.
"""

from __future__ import annotations

import asyncio

import httpx
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

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_retries_wait_for_room_instead_of_overfilling_a_worker() -> None:
    running = peak = served = 0

    async def good(request: Request) -> Response:
        nonlocal running, peak, served
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(0.2)
        finally:
            running -= 1
        served += 1
        return JSONResponse(chat_completion())

    async def bad(request: Request) -> Response:
        err = {"error": {"message": "overloaded", "type": "service_unavailable", "code": 503}}
        return JSONResponse(err, status_code=503)

    async with (
        serve_app(stub_app(good), force_exit=True) as good_url,
        serve_app(stub_app(bad), force_exit=True) as bad_url,
    ):
        s = settings_for(
            [good_url, bad_url],
            admission={"default_deadline_s": 20, "max_deadline_s": 30},
            # The broken worker stays in rotation: its refusals alone must not overfill the other.
            probes={"unhealthy_after": 1000, "breaker_window": 0},
        )
        workers = [w.model_copy(update={"max_concurrency": 1}) for w in s.workers]
        s = s.model_copy(update={"workers": workers})
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(2)
            rs = await asyncio.gather(
                *(c.post(g.url + "/v1/chat/completions", json=BODY) for _ in range(6))
            )
            assert peak == 1, f"a worker capped at 1 ran {peak} requests at once"
            ok = [r for r in rs if r.status_code == 200]
            assert len(ok) == served == 6, [r.status_code for r in rs]
            assert all(w.in_flight == 0 for w in g.gw.registry.workers.values())
