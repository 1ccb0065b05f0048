"""`AiohttpUpstream` (https workers, and `upstream.client = "aiohttp"`) at parity with the h1
client on its two pool edges (tests/gateway/test_upstream_h1_pool_trailers.py has the h1 side).

- The wait for a pool slot (`upstream.max_connections` requests in flight) is the gateway's own
  saturation: aiohttp counted it inside its ``connect`` timeout, so with every connection held by
  a stream the next request failed as a connect timeout, a 502 blaming (and ejecting) a worker
  that never saw it. Now the wait is the client's own, ended by the attempt's deadline and marked
  as a pool wait (`ended_pool_wait`): a 503 `upstream_pool_full`, no worker blamed.
- A pooled keep-alive connection the worker closed as the next request went out on it (its idle
  timeout; EOF or reset before a byte of answer) is resent once on a new connection, as
  `H1Upstream._resend` does; aiohttp resends only idempotent methods, so a POST failed as a 502
  and the worker was blamed. A new connection failing the same way is the worker's failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx
import pytest

from gateway.upstream import (
    AiohttpUpstream,
    UpstreamConnectError,
    UpstreamPoolFull,
    UpstreamResponse,
    ended_pool_wait,
)
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.gateway.test_upstream_h1 import read_request
from tests.support.raw_worker import answer_probe, models_body, raw_worker, server
from workers.deadlines import Deadlines

CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
EV = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'
WHOLE = (
    b'{"id":"x","object":"chat.completion","model":"%b","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,'
    b'"completion_tokens":1,"total_tokens":4}}' % MODEL.encode()
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def client(**kw: float) -> AiohttpUpstream:
    args = {"connect_s": 0.3, "max_connections": 8, "keepalive_s": 30.0, **kw}
    return AiohttpUpstream(**args)  # type: ignore[arg-type]


async def send(
    c: AiohttpUpstream, url: str, body: bytes, timeout: float, deadlines: Deadlines
) -> UpstreamResponse:
    """`Proxy._send`'s wait around `post`: a deadline that ended a pool wait is UpstreamPoolFull."""
    try:
        with deadlines.within(timeout):
            return await c.post(url, body, {"content-type": "application/json"})
    except TimeoutError as e:
        if ended_pool_wait(e):
            raise UpstreamPoolFull from None
        raise


def long_stream(release: asyncio.Event) -> Handler:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(CHUNKED)
        while not release.is_set():  # an event every 0.1 s: busy, never idle
            w.write(b"%x\r\n%s\r\n" % (len(EV), EV))
            await w.drain()
            await asyncio.sleep(0.1)
        w.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        await w.drain()

    return handler


# -- 1: the pool's own wait -----------------------------------------------------------------------
async def test_a_pool_slot_wait_is_ended_by_the_deadline_not_the_connect_timeout() -> None:
    """The one slot is held by a stream; the next request waits past `connect_s` (0.3 s) for it:
    before, aiohttp failed it as a connect timeout at 0.3 s (the worker's failure); now it waits
    until its own deadline (1 s), which ends it as the pool's, and the worker never saw it."""
    release = asyncio.Event()
    handler = long_stream(release)

    async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await handler(r, w)

    async with server(worker) as (url, accepted):
        c = client(max_connections=1)
        d = Deadlines()
        try:
            held = await send(c, url + "/v1/completions", b"{}", 5.0, d)
            with pytest.raises(UpstreamPoolFull):  # its deadline ended it, not connect_s
                await send(c, url + "/v1/completions", b"{}", 1.0, d)
            assert len(accepted) == 1  # the worker never saw the second request
            release.set()
            body = b""
            async for chunk in held.chunks():
                body += chunk
            await held.release()
            assert body.endswith(b"0\r\n\r\n") or b"[DONE]" in body
            # The slot is free again: the next request goes out (on a new connection or the
            # pooled one) and is answered.
            again = await send(c, url + "/v1/completions", b"{}", 5.0, d)
            assert again.status == 200
            await again.abort()
        finally:
            release.set()
            await c.close()


async def test_a_slot_freed_while_waiting_is_taken_and_an_abandoned_wait_passes_it_on() -> None:
    """A waiter gets the slot a finishing stream frees; one whose caller gave up (cancelled)
    leaves the slot to the next waiter instead of leaking it."""
    release = asyncio.Event()
    handler = long_stream(release)

    async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await handler(r, w)

    async with server(worker) as (url, accepted):
        c = client(max_connections=1)
        d = Deadlines()
        try:
            held = await send(c, url + "/v1/completions", b"{}", 5.0, d)
            gives_up = asyncio.create_task(send(c, url + "/v1/completions", b"{}", 5.0, d))
            waits = asyncio.create_task(send(c, url + "/v1/completions", b"{}", 5.0, d))
            await asyncio.sleep(0.1)
            gives_up.cancel()
            await held.abort()  # the slot frees: the cancelled waiter's turn passes on
            release.set()
            r = await waits
            assert r.status == 200
            await r.abort()
            with pytest.raises(asyncio.CancelledError):
                await gives_up
            assert len(accepted) == 2
        finally:
            release.set()
            await c.close()


async def test_through_the_gateway_a_pool_wait_is_a_503_blaming_no_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()
    async with raw_worker(long_stream(release)) as (url, posts):
        s = settings_for(
            [url],
            upstream={"client": "aiohttp", "max_connections": 1},
            # connect_s under first_byte_s: aiohttp's connect timeout ended the wait first.
            timeouts={"first_byte_s": 1.0, "connect_s": 0.3},
            admission={"worker_concurrency": 8},
        )
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}
            async with httpx.AsyncClient(timeout=30) as c:

                async def hold() -> int:
                    async with c.stream("POST", g.url + "/v1/completions", json=body) as held:
                        await held.aread()
                        return held.status_code

                held = asyncio.create_task(hold())
                try:
                    await until(lambda: bool(posts), 10, "the one slot busy")
                    with caplog.at_level(logging.WARNING):
                        r = await c.post(g.url + "/v1/completions", json=body)
                    assert r.status_code == 503, r.text
                    assert r.json()["error"]["code"] == "upstream_pool_full"
                    assert r.headers.get("retry-after")
                    assert len(posts) == 1  # the worker never saw the second request
                    assert g.gw.registry.workers["w0"].health.name == "HEALTHY"
                    assert "failed before first byte" not in caplog.text
                finally:
                    release.set()
                    done = await asyncio.gather(held, return_exceptions=True)
                assert done == [200]


# -- 2: a pooled connection the worker closed as the request arrived --------------------------------
def one_then_idle_close(how: str, later: str = "answer") -> Handler:
    """Answers the first request on its first connection with keep-alive, then closes that
    connection as the next request arrives on it: ``how`` = "reset" (aborted once the head is
    read, the body unread: an RST, as a close with unread bytes is) or "eof" (a clean close once
    the request is read, before a byte of answer). Later connections: ``later`` = "answer"
    (every request, keep-alive) or the same close on their first request."""
    conns = 0

    async def close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if how == "reset":
            await r.readuntil(b"\r\n\r\n")
            w.transport.abort()
        else:
            await read_request(r)
            w.close()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        if conns == 1:
            await read_request(r)
            w.write(OK)
            await w.drain()
            await close(r, w)
            return
        if later != "answer":
            await close(r, w)
            return
        while True:
            await read_request(r)
            w.write(OK)
            await w.drain()

    return handler


@pytest.mark.parametrize("how", ["reset", "eof"])
async def test_a_stale_pooled_connection_is_resent_once_on_a_new_one(how: str) -> None:
    async with server(one_then_idle_close(how)) as (url, accepted):
        c = client()
        try:
            r = await c.post(url + "/v1/completions", b"{}", {})
            assert await r.read() == b"{}"
            await r.release()
            sent: list[int] = []
            r = await c.post(url + "/v1/completions", b"{}", {}, lambda: sent.append(1))
            assert r.status == 200
            assert await r.read() == b"{}"
            await r.release()
            assert len(accepted) == 2  # the stale one, then a new one for the resend
            assert sent == [1]  # `sent` is the caller's bookkeeping: once, resent or not
            assert c.busy == 0
            # The worker is served as before (the resend's connection is not pooled: its
            # session pools nothing, so it could never be a stale one itself).
            r = await c.post(url + "/v1/completions", b"{}", {})
            assert await r.read() == b"{}"
            await r.release()
            assert c.busy == 0
        finally:
            await c.close()


@pytest.mark.parametrize("how", ["reset", "eof"])
async def test_a_resend_that_fails_the_same_way_is_the_workers_failure(how: str) -> None:
    async with server(one_then_idle_close(how, later="close")) as (url, accepted):
        c = client()
        try:
            r = await c.post(url + "/v1/completions", b"{}", {})
            assert await r.read() == b"{}"
            await r.release()
            with pytest.raises(UpstreamConnectError):
                await c.post(url + "/v1/completions", b"{}", {})
            assert len(accepted) == 2  # resent once, never again
        finally:
            await c.close()


async def test_a_pooled_connection_whose_head_broke_off_is_not_resent() -> None:
    """The worker began its answer (part of a head, then EOF): it had the request, so sending
    it again could run it twice; it fails as the worker's."""
    conns = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await read_request(r)
        w.write(OK)
        await w.drain()
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: appl")
        await w.drain()
        w.close()

    async with server(handler) as (url, accepted):
        c = client()
        try:
            r = await c.post(url + "/v1/completions", b"{}", {})
            assert await r.read() == b"{}"
            await r.release()
            with pytest.raises(UpstreamConnectError):
                await c.post(url + "/v1/completions", b"{}", {})
            assert len(accepted) == 1
            assert c.busy == 0
        finally:
            await c.close()


async def test_a_new_connection_closed_before_the_answer_is_not_resent() -> None:
    async def closes(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.close()

    async with server(closes) as (url, accepted):
        c = client()
        try:
            with pytest.raises(UpstreamConnectError):
                await c.post(url + "/v1/completions", b"{}", {})
            assert len(accepted) == 1
        finally:
            await c.close()


async def test_through_the_gateway_a_stale_connection_is_resent_and_no_worker_blamed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker whose keep-alive closes a pooled connection as the gateway's next request
    arrives (here: every connection answers one POST, then is reset at the next one's head).
    Before, that request was a 502 (a model's only worker) and the worker was blamed."""
    models = models_body(MODEL)
    posts: list[bytes] = []

    async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        answered = False
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0]
            if not line.startswith(b"POST "):
                answer_probe(line, w, models)
                await w.drain()
                continue
            if answered:  # the idle timeout fired as this one arrived
                w.transport.abort()
                return
            n = next(
                int(h.split(b":", 1)[1])
                for h in head.split(b"\r\n")
                if h.lower().startswith(b"content-length:")
            )
            posts.append(await r.readexactly(n))
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"\r\n%b" % (len(WHOLE), WHOLE)
            )
            await w.drain()
            answered = True

    async with server(worker) as (url, _accepted):
        s = settings_for(
            [url],
            upstream={"client": "aiohttp"},
            probes={"interval_s": 60},  # only requests judge the worker
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(1)
            caplog.set_level(logging.WARNING, logger="kvgate")
            statuses = []
            for _ in range(3):
                r = await c.post(
                    g.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                )
                statuses.append(r.status_code)
            assert statuses == [200, 200, 200], statuses
            assert len(posts) == 3
            assert g.gw.registry.workers["w0"].health.name == "HEALTHY"
    assert "failed before first byte" not in caplog.text, caplog.text
