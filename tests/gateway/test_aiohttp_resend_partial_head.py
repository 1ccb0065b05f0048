"""`AiohttpUpstream` resends a POST whose pooled connection failed only when not a byte of the
worker's answer came back on it.

A pooled connection the worker's idle keep-alive closed as the request went out is resent once
on a new one (the worker never ran it). But a worker that began its answer (part of a status
line or head, then the connection cut) had the request and may have run it: sending it again
would run it twice on the worker (a second generation, its tokens counted twice). aiohttp's
errors do not tell the two apart: a reset after part of a head is a ClientOSError like one
before any byte, and under its pure-Python parser an EOF after part of a head is a
ServerDisconnectedError like one with none. Before, both were resent; the worker here counts
the POSTs it received, so a resend shows as one POST too many.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

import aiohttp.client_proto
import aiohttp.http
import aiohttp.http_parser
import pytest

from gateway.upstream import AiohttpUpstream, UpstreamConnectError
from tests.gateway.test_upstream_h1 import read_request
from tests.support.raw_worker import server

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

# aiohttp parses with its C parser when built, else the pure-Python one (or with
# ``AIOHTTP_NO_EXTENSIONS``); the decision to resend must not depend on which.
PARSERS = {
    "default-parser": aiohttp.http.HttpResponseParser,
    "python-parser": aiohttp.http_parser.HttpResponseParserPy,
}


@pytest.fixture(params=sorted(PARSERS))
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The response parser aiohttp's protocol builds for each request."""
    monkeypatch.setattr(aiohttp.client_proto, "HttpResponseParser", PARSERS[request.param])
    return str(request.param)


def client() -> AiohttpUpstream:
    # A generous connect bound: no test here is about timeouts.
    return AiohttpUpstream(connect_s=10.0, max_connections=8, keepalive_s=30.0)


def cut(w: asyncio.StreamWriter, how: str) -> None:
    """End the connection: "reset" sends an RST (SO_LINGER 0: the request was read whole, so a
    plain close would be a FIN), "eof" closes it cleanly."""
    if how == "reset":
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.transport.abort()
    else:
        w.close()


def answers_one_then_cuts(partial: bytes, how: str, posts: list[int]) -> Handler:
    """Every connection answers its requests with keep-alive, except the second POST the worker
    receives (the first connection's second: the one that went out on a pooled connection):
    it gets ``partial`` (maybe nothing) and then the connection is cut (`cut`). Any later POST,
    a resend, is answered. ``posts`` counts every POST received."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            posts.append(1)
            if len(posts) == 2:
                if partial:
                    w.write(partial)
                    await w.drain()
                cut(w, how)
                return
            w.write(OK)
            await w.drain()

    return handler


async def first_then_second(url: str, c: AiohttpUpstream) -> int:
    """The first POST (answered: its connection is pooled), then the second on that pooled
    connection; its status when it is answered."""
    r = await c.post(url + "/v1/completions", b"{}", {})
    assert await r.read() == b"{}"
    await r.release()
    r = await c.post(url + "/v1/completions", b"{}", {})
    assert await r.read() == b"{}"
    await r.release()
    return r.status


@pytest.mark.parametrize("how", ["reset", "eof"])
@pytest.mark.parametrize(
    "partial",
    [b"H", b"HTTP/1.1 200 OK\r\nContent-Ty"],
    ids=["status-line-byte", "partial-head"],
)
async def test_a_pooled_connection_cut_after_part_of_a_head_is_not_resent(
    parser: str, how: str, partial: bytes
) -> None:
    """The worker began to answer: it had the request, so it fails as the worker's (retried
    elsewhere by the proxy's policy) instead of running a second time on the same worker."""
    posts: list[int] = []
    async with server(answers_one_then_cuts(partial, how, posts)) as (url, accepted):
        c = client()
        try:
            with pytest.raises(UpstreamConnectError):
                await first_then_second(url, c)
            assert len(posts) == 2, "the POST reached the worker twice: resent after an answer"
            assert len(accepted) == 1  # no new connection was opened for a resend
            assert c.busy == 0
        finally:
            await c.close()


@pytest.mark.parametrize("how", ["reset", "eof"])
async def test_a_pooled_connection_cut_before_any_byte_is_still_resent_once(
    parser: str, how: str
) -> None:
    """Not a byte of answer: the worker's idle keep-alive closed the connection as the request
    arrived, so it is resent once on a new connection and answered there."""
    posts: list[int] = []
    async with server(answers_one_then_cuts(b"", how, posts)) as (url, accepted):
        c = client()
        try:
            assert await first_then_second(url, c) == 200
            assert len(posts) == 3  # the first, the one cut off, its one resend
            assert len(accepted) == 2  # the resend went out on a new connection
            assert c.busy == 0
        finally:
            await c.close()
