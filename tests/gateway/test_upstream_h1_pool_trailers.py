"""The h1 client's pool and framing edges (gateway.upstream_h1), review j.

- A request that waits for a pool slot (`upstream.max_connections`) past its attempt's deadline
  is the gateway's own saturation: a 503 `upstream_pool_full`, the worker (which never saw the
  request) neither blamed nor ejected. Before, it was the worker's first-byte timeout.
- A discarded connection is aborted: `transport.close()` waited for unsent request bytes to
  drain, which a worker that stopped reading never lets happen (the socket leaked).
- A response's trailer section is bounded and never stored: an endless trailer grew the gateway
  without bound, and a trailer field overrode the head's (the client's content-type).
- A pooled connection the worker closed as the request arrived (its idle keep-alive) is retried
  once on a new connection to the same worker, not failed and blamed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx
import pytest

from gateway.upstream import UpstreamStreamError
from gateway.upstream_h1 import DRY_MAX, H1Upstream, _Conn
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.gateway.test_upstream_h1 import client, read_request
from tests.support.raw_worker import raw_worker, server

CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
EV = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'


def spy_conns(c: H1Upstream) -> list[_Conn]:
    """Every connection `c` opens (or takes back while waiting for a slot)."""
    conns: list[_Conn] = []
    acquire = c._acquire

    async def spy(key: tuple[str, int]) -> _Conn:
        conn = await acquire(key)
        conns.append(conn)
        return conn

    c._acquire = spy  # type: ignore[method-assign]
    return conns


# -- 1: the pool's own wait -----------------------------------------------------------------------
async def test_a_pool_slot_wait_past_the_deadline_is_a_503_blaming_no_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def long_stream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(CHUNKED)
        while not release.is_set():  # an event every 0.1 s: busy, never idle
            w.write(b"%x\r\n%s\r\n" % (len(EV), EV))
            await w.drain()
            await asyncio.sleep(0.1)
        w.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        await w.drain()

    async with raw_worker(long_stream) as (url, posts):
        s = settings_for(
            [url],
            upstream={"max_connections": 1},
            timeouts={"first_byte_s": 0.5, "connect_s": 0.5},
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
                await until(lambda: bool(posts), 10, "the one slot busy")
                with caplog.at_level(logging.WARNING):
                    r = await c.post(g.url + "/v1/completions", json=body)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "upstream_pool_full"
                assert r.headers.get("retry-after")
                assert len(posts) == 1  # the worker never saw the second request
                assert g.gw.registry.workers["w0"].health.name == "HEALTHY"
                assert "failed before first byte" not in caplog.text
                release.set()
                assert await held == 200


# -- 2: discarded connections are aborted ---------------------------------------------------------
async def test_a_discarded_connection_with_unsent_bytes_is_closed_at_once() -> None:
    stuck = asyncio.Event()

    async def reads_nothing(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        await stuck.wait()  # a hung worker: never reads the body, never answers

    async with server(reads_nothing) as (url, _accepted):
        c = client()
        conns = spy_conns(c)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await c.post(url + "/v1/completions", b"x" * (64 << 20), {})
            for _ in range(50):  # connection_lost runs a loop iteration or two later
                await asyncio.sleep(0.01)
            (conn,) = conns
            assert conn.transport is not None
            # close() left the socket open until a drain that never comes; aborted, it is gone.
            assert conn.transport.get_extra_info("socket").fileno() == -1
            assert c.open_connections == 0
        finally:
            stuck.set()
            await c.close()


# -- 3 and 5: trailers ------------------------------------------------------------------------------
def trailer_worker(
    trailer: bytes,
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(CHUNKED + b"2\r\n{}\r\n0\r\n" + trailer)
        await w.drain()
        await r.read()  # until the client closes

    return handler


@pytest.mark.parametrize(
    "trailer",
    [
        pytest.param(b"x-junk: " + b"a" * (4 << 20) + b"\r\n\r\n", id="value"),
        pytest.param(b"x-junk: aaaaaaaa\r\n" * 200_000 + b"\r\n", id="lines"),
    ],
)
async def test_a_trailer_past_its_bound_fails_the_response(trailer: bytes) -> None:
    async with server(trailer_worker(trailer)) as (url, _accepted):
        c = client()
        try:
            r = await c.post(url + "/v1/completions", b"{}", {})
            assert r.status == 200
            with pytest.raises(UpstreamStreamError, match="after the body"):
                await r.read()
            await r.abort()
            assert c.open_connections == 0
        finally:
            await c.close()


async def test_a_trailer_field_overrides_no_header_and_the_body_is_whole() -> None:
    trailer = b"content-type: text/html\r\nx-t: 1\r\n\r\n"
    async with server(trailer_worker(trailer)) as (url, _accepted):
        c = client()
        try:
            r = await c.post(url + "/v1/completions", b"{}", {})
            assert await r.read() == b"{}"
            assert r.headers.get("content-type") == "application/json"
            assert r.headers.get("x-t") is None
        finally:
            await c.close()


async def test_reads_of_chunk_framing_alone_do_not_add_up_to_the_bound() -> None:
    """Each chunk's header arrives in a read of its own (no body byte in it): the count starts
    anew at every body byte, so a long stream's framing never reaches `DRY_MAX`."""
    ext = b";e=" + b"x" * 1000
    n = DRY_MAX // len(ext) + 4  # framing-only reads that would exceed the bound together

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(CHUNKED)
        for _ in range(n):
            w.write(b"1%s\r\n" % ext)
            await w.drain()
            await asyncio.sleep(0.01)
            w.write(b"a\r\n")
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")
        await w.drain()
        await r.read()

    async with server(handler) as (url, _accepted):
        c = client()
        try:
            r = await c.post(url + "/v1/completions", b"{}", {})
            assert await r.read() == b"a" * n
        finally:
            await c.close()


# -- 4: a pooled connection the worker closed as the request arrived --------------------------------
async def test_a_stale_pooled_connection_is_retried_once_on_a_new_one() -> None:
    async def one_then_idle_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(OK)
        await w.drain()
        await r.readuntil(b"\r\n\r\n")  # the next request arrives as the keep-alive fires:
        w.transport.abort()  # closed unread, unanswered

    async with server(one_then_idle_close) as (url, accepted):
        c = client()
        try:
            r = await c.post(url + "/v1/completions", b"{}", {})
            assert await r.read() == b"{}"
            r = await c.post(url + "/v1/completions", b"{}", {})  # on the pooled connection
            assert r.status == 200
            assert await r.read() == b"{}"
            assert len(accepted) == 2  # the stale one, then a new one for the retry
        finally:
            await c.close()
