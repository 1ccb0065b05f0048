"""A retry after a worker's refusal goes where there is room, or waits for it; it never pushes a
full worker past its concurrency cap.

Review finding: admission counts the free slots of every worker of the model, the broken one's
too, so requests were admitted onto a worker that answered 503 to everything; their retries then
took `Slots.eligible`'s fallback to workers with no room, and a worker capped at 1 ran 3 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

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

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _capped(urls: list[str], **admission: float) -> Settings:
    """Workers capped at one request each, kept in rotation whatever they answer (their
    refusals alone must not take them out), requests queued up to 20 s."""
    s = settings_for(
        urls,
        admission={"default_deadline_s": 20, "max_deadline_s": 30, **admission},
        probes={"unhealthy_after": 1000, "breaker_window": 0},
    )
    workers = [w.model_copy(update={"max_concurrency": 1}) for w in s.workers]
    return s.model_copy(update={"workers": workers})


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
        # The broken worker stays in rotation: its refusals alone must not overfill the other.
        s = _capped([good_url, bad_url])
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(2)
            rs = await asyncio.gather(
                *(c.post(g.url + "/v1/chat/completions", json=BODY) for _ in range(6))
            )
            assert peak == 1, f"a worker capped at 1 ran {peak} requests at once"
            ok = [r for r in rs if r.status_code == 200]
            assert len(ok) == served == 6, [r.status_code for r in rs]
            assert all(w.in_flight == 0 for w in g.gw.registry.workers.values())


def _stub(release: asyncio.Event) -> Any:
    """A worker: "long" holds its slot until ``release``, "poison" is refused with a 503 (a
    retry follows), anything else is answered at once."""

    async def handler(request: Request) -> Response:
        text = (await request.json())["messages"][0]["content"]
        if text == "long":
            await release.wait()
        elif text == "poison":
            err = {"error": {"message": "overloaded", "type": "service_unavailable", "code": 503}}
            return JSONResponse(err, status_code=503)
        return JSONResponse(chat_completion())

    return stub_app(handler)


def _body(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


@contextlib.asynccontextmanager
async def _two_workers(release: asyncio.Event, **admission: float) -> AsyncIterator[Any]:
    """A gateway over two workers capped at 1, one of them held by a "long" request."""
    async with (
        serve_app(_stub(release), force_exit=True) as u1,
        serve_app(_stub(release), force_exit=True) as u2,
    ):
        s = _capped([u1, u2], **admission)
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(2)
            url = g.url + "/v1/chat/completions"
            held = asyncio.create_task(c.post(url, json=_body("long")))
            reg = g.gw.registry
            await until(lambda: sum(w.in_flight for w in reg.workers.values()) == 1, 10, "held")
            try:
                yield g, c, url, held
            finally:
                release.set()
                assert (await held).status_code == 200


async def test_a_waiting_retry_does_not_hold_up_new_requests_for_a_free_worker() -> None:
    # Review finding: the retry waited at the head of its model's queue for the worker it had
    # not tried (busy), and every new request queued behind it while the other worker sat idle:
    # they timed out with "no worker became free".
    release = asyncio.Event()
    async with _two_workers(release) as (g, c, url, held):
        poison = asyncio.create_task(c.post(url, json=_body("poison")))
        await until(lambda: g.gw.admission.queued() == 1, 10, "the retry waits for room")
        fresh = asyncio.create_task(
            c.post(url, json=_body("hi"), headers={"x-kvgate-deadline-ms": "10000"})
        )
        done, _ = await asyncio.wait([fresh], timeout=8)
        assert done, "the new request waited behind the retry"
        assert fresh.result().status_code == 200, fresh.result().text
        assert not held.done() and not poison.done()  # the retry still waits for its worker
        release.set()
        assert (await poison).status_code == 503  # it tried both: the busy one refused it too


async def test_a_retry_waits_no_longer_than_the_client_allowed() -> None:
    # Review finding: a retry's wait for room was bounded by timeouts.total_s only: a client that
    # sent x-kvgate-deadline-ms 0 ("do not queue me") waited seconds in the queue.
    release = asyncio.Event()
    async with _two_workers(release, default_deadline_s=30) as (g, c, url, held):
        poison = asyncio.create_task(
            c.post(url, json=_body("poison"), headers={"x-kvgate-deadline-ms": "0"})
        )
        done, _ = await asyncio.wait([poison], timeout=8)
        assert done, "the retry waited past the client's deadline"
        r = poison.result()
        assert r.status_code == 503 and not held.done(), r.text
        assert g.gw.admission.queued() == 0


async def test_retries_are_counted_by_the_workers_status_not_its_error_code() -> None:
    # Review finding: vLLM's error `code` is an int, read as None: reason="None"; and a worker
    # with a code per response made a new series with each.
    n = 0

    async def bad(request: Request) -> Response:
        nonlocal n
        n += 1
        err = {"error": {"message": "busy", "type": "x", "code": f"overloaded-{n}"}}
        return JSONResponse(err, status_code=503)

    async def vllm_like(request: Request) -> Response:
        err = {"error": {"message": "busy", "type": "ServiceUnavailableError", "code": 503}}
        return JSONResponse(err, status_code=503)

    async with (
        serve_app(stub_app(bad), force_exit=True) as u1,
        serve_app(stub_app(vllm_like), force_exit=True) as u2,
    ):
        s = settings_for([u1, u2], probes={"unhealthy_after": 1000, "breaker_window": 0})
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(2)
            for _ in range(6):
                r = await c.post(g.url + "/v1/chat/completions", json=BODY)
                assert r.status_code == 503
            m = await g.metrics()
    reasons = {k for k, v in m.items() if k.startswith("kvgate_retries_total{") and v}
    assert reasons == {'kvgate_retries_total{reason="upstream_503"}'}, reasons


async def test_a_waiting_retry_takes_a_freed_slot_ahead_of_new_requests() -> None:
    # Kicked after the model's own queue, a retry lost every freed slot of the worker it waited
    # for to the new requests queued meanwhile, and under steady load waited out its deadline.
    held = {"hold1": asyncio.Event(), "hold2": asyncio.Event()}
    seen: dict[int, list[str]] = {0: [], 1: []}

    def worker(i: int) -> Any:
        async def handler(request: Request) -> Response:
            text = (await request.json())["messages"][0]["content"]
            seen[i].append(text)
            if text in held:
                await held[text].wait()
            elif text == "poison":
                err = {"error": {"message": "no", "type": "service_unavailable", "code": 503}}
                return JSONResponse(err, status_code=503)
            return JSONResponse(chat_completion())

        return stub_app(handler)

    async with (
        serve_app(worker(0), force_exit=True) as u0,
        serve_app(worker(1), force_exit=True) as u1,
    ):
        s = _capped([u0, u1])
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=60) as c:
            await g.wait_healthy(2)
            url = g.url + "/v1/chat/completions"
            post = lambda text: asyncio.create_task(c.post(url, json=_body(text)))  # noqa: E731
            first = post("hold1")
            await until(lambda: seen[0] + seen[1] == ["hold1"], 10, "hold1 running")
            busy = 0 if seen[0] else 1
            poison = post("poison")  # refused by the other worker: its retry waits for `busy`
            await until(lambda: g.gw.admission.queued() == 1, 10, "the retry waits")
            second = post("hold2")  # takes the other worker again
            await until(lambda: seen[1 - busy][-1:] == ["hold2"], 10, "hold2 running")
            fresh = post("fresh")  # both full: queued behind
            await until(lambda: g.gw.admission.queued() == 2, 10, "a new request queued too")
            held["hold1"].set()  # `busy` frees a slot: the retry's
            assert (await first).status_code == 200
            await until(lambda: len(seen[busy]) == 2, 10, "busy's next request")
            assert seen[busy] == ["hold1", "poison"]
            assert (await poison).status_code == 503  # both workers refused it
            assert (await fresh).status_code == 200
            held["hold2"].set()
            assert (await second).status_code == 200


async def test_a_retry_whose_last_untried_worker_is_drained_is_answered_at_once() -> None:
    # Review finding: the retry waited for room on the one worker it had not tried; that worker
    # was drained while the one it had tried still served, so nothing could admit it, and it
    # waited out its whole deadline, then read "no worker became free".
    release = asyncio.Event()
    async with _two_workers(release, default_deadline_s=25) as (g, c, url, _held):
        reg = g.gw.registry
        busy = next(n for n, w in reg.workers.items() if w.in_flight == 1)
        poison = asyncio.create_task(c.post(url, json=_body("poison")))
        await until(lambda: g.gw.admission.queued() == 1, 10, "the retry waits for room")
        assert g.gw.drain_worker(busy, True)
        done, _ = await asyncio.wait([poison], timeout=20)
        assert done, "the retry waited for a drained worker"
        r = poison.result()
        assert r.status_code == 503 and "has not tried" in r.text, r.text
        assert g.gw.admission.queued() == 0
