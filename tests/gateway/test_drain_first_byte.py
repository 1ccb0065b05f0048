"""Drain: requests still waiting on their worker when the grace ends.

A request dispatched to a worker that has not answered yet (a long prefill, a queue inside vLLM)
has no relay, so the drain's cut of live streams passes it by. Left alone it waited through the
drain's last wait and uvicorn's graceful shutdown, then uvicorn cancelled it and the client got a
plain-text 500. When the grace ends it must end like everything else still in flight: an
OpenAI-shaped 503 `shutting_down`, its upstream request aborted (the worker stops the work), its
reservation refunded and its slots freed, once. Streaming and whole responses both.

Nothing here bounds wall-clock time: conditions are polled under generous deadlines.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from bench.redis_server import RedisServer
from gateway.quota import Admission, Reservation
from gateway.quota_redis import RedisQuotaStore
from tests.faults.conftest import KEY_OPEN, assert_openai_error, run_stack
from tests.faults.test_stream_endings import error_in_two_halves
from tests.gateway.accounting_stubs import HEADERS as AUTH
from tests.gateway.accounting_stubs import (
    chat_body,
    completion_doc,
    tenant_settings,
    whole_worker,
)
from tests.gateway.conftest import MODEL, run_gateway, serve_app, settings_for, stub_app
from tests.support.raw_worker import raw_worker

# Generous everywhere: a loaded CI host is slow, and no bound here is what the test measures.
WITHIN_S = 60.0
# Timeouts far past anything the tests wait for: only the drain may end these requests.
LONG_TIMEOUTS = {"first_byte_s": 600, "idle_s": 600, "total_s": 1200}
HEADERS = {"authorization": f"Bearer {KEY_OPEN}"}


def _chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def _until(cond: Callable[[], bool], what: str, timeout: float = WITHIN_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        await asyncio.sleep(0.01)


def _assert_shutting_down(r: httpx.Response) -> None:
    """The answer new and queued requests get during a drain (gateway.app, gateway.admission)."""
    assert r.status_code == 503, (r.status_code, r.headers.get("content-type"), r.text[:200])
    err = assert_openai_error(r.status_code, r.headers.get("content-type", ""), r.content)
    assert err["code"] == "shutting_down", err
    assert r.headers["retry-after"] == "1"
    assert r.headers.get("x-request-id")


async def test_requests_queued_inside_the_worker_end_with_a_503_when_the_grace_ends() -> None:
    """One stream relaying, and a stream and a whole response queued inside the worker's engine
    behind it (max_num_seqs = 1): past the grace the stream gets its SSE error event, the two
    others an OpenAI 503 `shutting_down`, and nothing is left held anywhere: the engine's queue
    (their upstream requests were aborted), the workers' counts, leases and reservations."""
    async with (
        run_stack(1, sim={"max_num_seqs": 1}, timeouts=LONG_TIMEOUTS) as s,
        httpx.AsyncClient(timeout=WITHIN_S * 2) as c,
    ):
        assert s.fleet is not None
        engine = s.fleet.workers[0].engine
        url = s.url + "/v1/chat/completions"
        async with c.stream("POST", url, json=_chat(20_000, True), headers=HEADERS) as live:
            assert live.status_code == 200
            lines = live.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            waiting = [
                asyncio.create_task(c.post(url, json=_chat(8, stream), headers=HEADERS))
                for stream in (True, False)
            ]
            # Both are on the worker, in its engine's queue: no first byte, no relay.
            await _until(lambda: engine.stats().num_waiting == 2, "two requests queued in vLLM")
            assert s.gw.registry.workers["w0"].in_flight == 3
            drain = asyncio.create_task(s.gw.drain(grace_s=0.2))
            rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in rest[-2] and '"error"' in rest[-2]
        for r in await asyncio.wait_for(asyncio.gather(*waiting), WITHIN_S):
            _assert_shutting_down(r)
        await asyncio.wait_for(drain, WITHIN_S)
        await s.assert_quiescent(WITHIN_S)
        m = s.metrics()
        # Each recorded once, as a request its worker had (the usage record and the log line).
        assert m['kvgate_requests_total{model="sim-llama",status="503",worker="w0"}'] == 2
        assert m['kvgate_stream_errors_total{reason="gateway_shutdown"}'] == 1
        assert s.engine_counts().get("length", 0) == 0  # none of them ran to its end


def _silent_worker(upstream: list[str]) -> Any:
    """A worker that takes a completion and never answers (a prefill that outlasts the drain):
    ``upstream`` gets "aborted" when the gateway hangs up on it."""

    async def chat(request: Request) -> Response:
        await request.body()
        upstream.append("received")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                upstream.append("aborted")
                break
            await asyncio.sleep(0.01)
        return Response(b"", 500)

    return stub_app(chat)


async def test_sigterm_past_the_grace_answers_requests_without_a_first_byte_in_the_envelope() -> (
    None
):
    """The production path: SIGTERM, `drain_grace_s`, then uvicorn's graceful shutdown (10 s, as
    gateway/server.py sets it). A stream and a whole response whose worker never answers get an
    OpenAI 503 `shutting_down`, not uvicorn's plain-text 500 once its own grace runs out, and
    the worker sees both requests aborted."""
    upstream: list[str] = []
    async with serve_app(_silent_worker(upstream), force_exit=True) as worker:
        s = settings_for([worker], server={"drain_grace_s": 0.2}, timeouts=LONG_TIMEOUTS)
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=WITHIN_S * 2) as c:
            await g.wait_healthy(1)
            assert g.server is not None
            g.server.config.timeout_graceful_shutdown = 10  # production (gateway/server.py)
            url = g.url + "/v1/chat/completions"
            reqs = [
                asyncio.create_task(c.post(url, json=_chat(8, stream))) for stream in (True, False)
            ]
            await _until(lambda: upstream.count("received") == 2, "both requests on the worker")
            g.server.handle_exit(signal.SIGTERM, None)  # what SIGTERM does
            for r in await asyncio.wait_for(asyncio.gather(*reqs), WITHIN_S):
                _assert_shutting_down(r)
            await _until(lambda: upstream.count("aborted") == 2, "the worker saw both aborted")
            assert g.gw.registry.workers["w0"].in_flight == 0


async def test_a_request_between_two_attempts_when_the_grace_ends_tries_no_other_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The drain cuts while a request reads its first worker's 5xx body (before a retry): it
    answers the 503 `shutting_down` instead of starting over on the other worker, which then
    never sees it. Both workers answer a 500 whose body comes in two halves, the second once
    the drain has cut; whichever is picked first, the other gets no request."""
    rest = asyncio.Event()
    async with (
        raw_worker(error_in_two_halves(rest)) as (url0, posts0),
        raw_worker(error_in_two_halves(rest)) as (url1, posts1),
    ):
        s = settings_for([url0, url1], timeouts=LONG_TIMEOUTS, retries={"max_attempts": 3})
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=WITHIN_S * 2) as c:
            await g.wait_healthy(2)
            req = asyncio.create_task(
                c.post(g.url + "/v1/chat/completions", json=_chat(8, stream=False))
            )
            await _until(lambda: len(posts0) + len(posts1) == 1, "the first attempt is sent")
            # The grace's end, seen where the drain starts cutting (the streams first).
            grace_over = asyncio.Event()
            cut_streams = g.gw.life.cut_streams

            def cut(message: str) -> int:
                grace_over.set()
                return cut_streams(message)

            monkeypatch.setattr(g.gw.life, "cut_streams", cut)
            drain = asyncio.create_task(g.gw.drain(grace_s=0.2))
            await asyncio.wait_for(grace_over.wait(), WITHIN_S)
            rest.set()  # the first 5xx body completes: the proxy would retry now
            _assert_shutting_down(await asyncio.wait_for(req, WITHIN_S))
            await asyncio.wait_for(drain, WITHIN_S)
            assert len(posts0) + len(posts1) == 1, (len(posts0), len(posts1))
            assert all(w.in_flight == 0 for w in g.gw.registry.workers.values())


async def test_a_body_still_uploading_when_the_grace_ends_gets_the_envelope(sims) -> None:  # type: ignore[no-untyped-def]
    """Process review: a request still in the walk (its body arriving over a slow link) was
    invisible to the drain, which returned at once; uvicorn then cancelled it into a plain-text
    500. The drain now waits for it like any request in flight, and when the grace ends it gets
    the 503 `shutting_down`. A complete request that was mid-walk at SIGTERM is still served."""
    fleet = sims(1, profile="instant")
    s = settings_for(fleet.urls, server={"drain_grace_s": 1.0})
    async with run_gateway(s) as g:
        await g.wait_healthy(1)
        assert g.server is not None
        g.server.config.timeout_graceful_shutdown = 10  # production (gateway/server.py)
        body = httpx.Request("POST", g.url, json=_chat(4, False)).content
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        r, w = await asyncio.open_connection("127.0.0.1", int(g.url.rsplit(":", 1)[1]))
        w.write(head + body[:10])  # the rest never comes
        await w.drain()
        await _until(lambda: bool(g.gw._walks), "the walk is reading the body")
        g.server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(0.2)
        assert not r.at_eof(), "the drain did not wait for the walk"
        raw = await asyncio.wait_for(r.read(), WITHIN_S)
        w.close()
        head_in, _, payload = raw.partition(b"\r\n\r\n")
        status = int(head_in.split(b" ", 2)[1])
        ctype = next(
            line.split(b":", 1)[1].strip().decode()
            for line in head_in.split(b"\r\n")[1:]
            if line.lower().startswith(b"content-type:")
        )
        err = assert_openai_error(status, ctype, payload)
        assert status == 503 and err["code"] == "shutting_down", err
        assert not g.gw._walks and not g.gw._walks_cut


async def test_a_walk_cut_inside_its_quota_admission_frees_its_lease(
    redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: the grace's end cancels walks not yet sent to a worker, and one of them
    may be inside its quota admission, the script run on Redis but its reply not yet back. No
    ticket came back to release, so its reservation and `max_concurrent` lease stayed in the
    shared store until the lease TTL (15 minutes), blocking the tenant on every replica. The
    admission now queues a refund for it, which the gateway's shutdown applies at the latest."""
    worker = whole_worker(lambda body: (200, completion_doc({"prompt_tokens": 3})))
    prefix = "drain-admit:"
    async with serve_app(worker) as url:
        quota = {"backend": "redis", "redis_url": redis.url, "key_prefix": prefix}
        s = tenant_settings([url], quota)
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=WITHIN_S * 2) as c:
            await g.wait_healthy(1)
            store = g.gw.quota.shared
            real_admit = store.admit
            ran = asyncio.Event()

            async def reply_pending(res: Reservation) -> Admission:
                adm = await real_admit(res)  # the script ran: the lease is in Redis
                ran.set()
                await asyncio.Event().wait()  # its reply is still on the wire at the cut
                return adm

            monkeypatch.setattr(store, "admit", reply_pending)
            post = asyncio.create_task(
                c.post(g.url + "/v1/chat/completions", content=chat_body(False), headers=AUTH)
            )
            await asyncio.wait_for(ran.wait(), WITHIN_S)
            assert (await store.usage("t"))["in_flight"] == 1
            await asyncio.wait_for(g.gw.drain(grace_s=0), WITHIN_S)
            _assert_shutting_down(await asyncio.wait_for(post, WITHIN_S))
        # The gateway has stopped (as a drained process does): nothing of the request is held.
        check = RedisQuotaStore(redis.url, prefix=prefix)
        try:
            assert (await check.usage("t"))["in_flight"] == 0
        finally:
            await check.close()
