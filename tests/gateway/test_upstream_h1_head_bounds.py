"""A worker's response head is read only up to a bound (gateway.upstream_h1).

Review finding (medium): the h1 client stored a worker's response headers with no limit
(httptools has none): header lines without end grew the gateway by 235 MiB, and one header value
without end, which httptools joins again on every read, stalled the event loop 80-160 ms a read.
Now a head over `HEAD_MAX` bytes, or with more than `HEADERS_MAX` header lines, is a malformed
response: a connect error, retried on another worker, the worker blamed.

The worker's heads here are finite (4 MiB, then the head ends) so that the old code returns too:
it accepted them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
import pytest

from gateway.upstream import UpstreamConnectError
from gateway.upstream_h1 import H1Upstream
from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.gateway.test_upstream_h1 import client, read_request
from tests.support.raw_worker import raw_worker, server

BIG = 4 << 20  # bytes of head a bad worker sends before it ends the head
END = b"content-length: 2\r\n\r\n{}"


def lines(w: asyncio.StreamWriter) -> None:
    line = b"x-junk: " + b"a" * 1000 + b"\r\n"
    w.write(line * (BIG // len(line)))


def value(w: asyncio.StreamWriter) -> None:
    w.write(b"x-junk: " + b"a" * BIG + b"\r\n")


def many(w: asyncio.StreamWriter) -> None:
    w.write(b"x-a: b\r\n" * 1000)  # 8 KB: small, but a thousand headers


HEADS: dict[str, Callable[[asyncio.StreamWriter], None]] = {
    "lines": lines,
    "value": value,
    "many": many,
}


def bad_head(kind: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
        HEADS[kind](w)
        w.write(END)
        await w.drain()
        await r.read()  # until the client closes

    return script


@pytest.mark.parametrize("kind", list(HEADS))
async def test_a_head_past_its_bounds_is_a_connect_error(kind: str) -> None:
    script = bad_head(kind)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await script(r, w)

    async with server(handler) as (url, _accepted):
        c: H1Upstream = client()
        try:
            with pytest.raises(UpstreamConnectError, match="malformed response"):
                r = await c.post(url + "/v1/chat/completions", b"{}", {})
                await r.abort()
            assert c.open_connections == 0  # closed, never pooled
        finally:
            await c.close()


async def test_a_large_head_within_bounds_and_a_body_in_the_same_read_are_fine() -> None:
    """Body bytes that come in the head's read are no head bytes; 200 headers and 48 KB are a
    head (nothing a worker sends, but within the bounds)."""
    body = b"{" + b" " * (1 << 20) + b"}"
    head = (
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"x-h%d: %b\r\n" % (i, b"v" * 230) for i in range(200))
        + b"content-length: %d\r\n\r\n" % len(body)
    )
    assert 40_000 < len(head) < 60_000

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(head + body)  # one write: the head and the body's first bytes in one read
        await w.drain()
        await r.read()

    async with server(handler) as (url, _accepted):
        c = client()
        try:
            r = await c.post(url + "/v1/chat/completions", b"{}", {})
            assert r.status == 200 and r.headers.get("x-h199") == "v" * 230
            assert await r.read() == body
        finally:
            await c.close()


@pytest.mark.parametrize("kind", ["lines", "value"])
async def test_through_the_gateway_a_bad_head_is_retried_elsewhere(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    ok = b'{"id":"x","object":"chat.completion","model":"%b","choices":[]}' % MODEL.encode()

    async def good(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(ok), ok)
        )
        await w.drain()

    async with (
        raw_worker(bad_head(kind)) as (bad_url, bad_posts),
        raw_worker(good) as (good_url, _good_posts),
    ):
        s = settings_for(
            [bad_url, good_url],
            routing={"policy": "round_robin"},
            probes={"interval_s": 60},  # only requests judge the workers
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(2)
            caplog.set_level(logging.WARNING, logger="kvgate.proxy")
            for _ in range(2):  # one of them goes to the bad worker first
                r = await c.post(
                    g.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                )
                assert r.status_code == 200 and r.content == ok, r.text
            assert len(bad_posts) >= 1
    blamed = [
        r.getMessage() for r in caplog.records if "w0 failed before first byte" in r.getMessage()
    ]
    assert blamed and "malformed response from worker" in blamed[0], blamed
