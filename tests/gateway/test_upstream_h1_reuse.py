"""What a worker sends beyond the answers asked of it never reaches another request.

Review finding (severe): the hot path's HTTP/1.1 client (gateway.upstream_h1) pooled a connection
on which the worker had already started another message: a response head written right after
request A's answer (same write) stayed in the connection's parser, the connection went back to
the pool, and the next request on it -- another client's -- received that stale response as its
own answer. The same stray bytes arriving on an idle pooled connection were buffered, and past
HIGH_WATER paused the socket for good: the next request on it waited out its first-byte timeout
and the worker was blamed. Now such a connection is closed at the first unsolicited byte and never
pooled (aiohttp's `should_close`, Go's "unsolicited response on idle HTTP channel").

Review finding (low): a worker's `101 Switching Protocols` escaped `data_received` as httptools'
HttpParserUpgrade (no HttpParserError: asyncio logged a fatal error) and reached the client as a
bodiless 101. Now it is a malformed response (a connect error, retried elsewhere), and the proxy
answers any status below 200 that still arrives (aiohttp hands a 101 over) with an OpenAI-shaped
502 `upstream_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.upstream import UpstreamConnectError
from gateway.upstream_h1 import HIGH_WATER
from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.gateway.test_upstream_h1 import OK, client, read_request, until
from tests.support.raw_worker import (
    answer_probe,
    models_body,
    raw_worker,
    server,
)
from tests.support.raw_worker import (
    read_request as raw_read_request,
)

# A POST script of `pooled_worker`: the reader, the writer, and how many POSTs this connection
# carried before this one (0 on a fresh connection).
Post = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@contextlib.asynccontextmanager
async def pooled_worker(
    scripts: list[Post], model: str = MODEL
) -> AsyncIterator[tuple[str, list[tuple[int, bytes]]]]:
    """A raw worker that keeps every connection open (unlike `raw_worker`, whose connection ends
    with its script, so nothing could be pooled): /health and /v1/models answered like a worker,
    the n-th POST (counted over all connections) handed to ``scripts[n]`` (the last one for any
    after). Yields the URL and, per POST, (the connection's number, the body)."""
    posts: list[tuple[int, bytes]] = []
    conns = 0
    models = models_body(model)

    async def conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        me, carried = conns, 0
        try:
            while True:
                line, body = await raw_read_request(r)
                if not answer_probe(line, w, models):
                    i = len(posts)
                    posts.append((me, body))
                    await scripts[min(i, len(scripts) - 1)](r, w, carried)
                    carried += 1
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(conn, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", posts
    finally:
        srv.close()


def _sse(events: list[bytes]) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def _chunk(cid: str, content: str) -> bytes:
    delta = {"index": 0, "delta": {"content": content}, "finish_reason": None}
    event = {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    return b"data: " + orjson.dumps({**event, "choices": [delta]}) + b"\n\n"


def _stream(cid: str, content: str) -> bytes:
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    event = {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    last = b"data: " + orjson.dumps({**event, "choices": [], "usage": usage}) + b"\n\n"
    return _sse([_chunk(cid, content), last, b"data: [DONE]\n\n"])


class _LoopErrors:
    """What reaches the event loop's exception handler ("Fatal error: protocol.data_received()
    call failed" is one) while the block runs."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __enter__(self) -> list[dict[str, Any]]:
        self.loop = asyncio.get_running_loop()
        self.old = self.loop.get_exception_handler()
        self.loop.set_exception_handler(lambda _loop, ctx: self.seen.append(ctx))
        return self.seen

    def __exit__(self, *exc: object) -> None:
        self.loop.set_exception_handler(self.old)


# -- the client alone ----------------------------------------------------------------------------
async def test_a_message_after_the_answer_in_the_same_read_is_not_pooled_nor_read() -> None:
    """The worker writes request A's answer and, in the same write, a whole second response.
    The parser used to run on into it: its headers were appended to A's (the last content-type
    won), its body to A's body, and the connection was pooled with whatever came next. Now the
    first byte of that message closes the connection: A reads exactly its own answer, and the
    next request goes out on a new connection and gets its own."""
    stale = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 6\r\n\r\nSTALE!"

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        first = True
        while True:
            await read_request(r)
            if first and len(accepted) == 1:
                w.write(OK + stale)  # one write: one read on the client's side
            else:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nanswer-B")
            first = False
            await w.drain()

    async with server(h) as (url, accepted):
        c = client()
        resp = await c.post(url, b"{}", {})
        assert await resp.read() == b"{}"
        assert resp.headers.get("content-type") == "application/json"
        assert c.open_connections == 0  # closed, not pooled
        resp = await c.post(url, b"{}", {})
        assert await resp.read() == b"answer-B"
        assert len(accepted) == 2 and c.open_connections == 1
        await c.close()


async def test_unsolicited_bytes_on_an_idle_connection_close_it_and_never_pause_a_reuse() -> None:
    """A response nobody asked for arrives on a pooled, idle connection: more than HIGH_WATER
    of it used to be buffered and pause the socket, and `begin()` cleared the flag without
    resuming it, so the next request on that connection was never read (a first-byte timeout,
    the healthy worker blamed). Now the connection is closed, its slot freed at once, and the
    next request is served on a new one."""

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if len(accepted) > 1:  # a new connection: an ordinary worker
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nanswer-B")
            await w.drain()
            await r.read()
            return
        await read_request(r)
        w.write(OK)
        await w.drain()
        await answered.wait()  # pooled and idle by now
        big = b"x" * (HIGH_WATER + 65536)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(big), big))
        await w.drain()
        await read_request(r)  # a reused connection: the next request, answered as it should be
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nanswer-B")
        await w.drain()
        await r.read()

    answered = asyncio.Event()
    async with server(h) as (url, accepted):
        c = client()
        resp = await c.post(url, b"{}", {})
        assert await resp.read() == b"{}"
        assert c.open_connections == 1  # pooled
        answered.set()
        await until(lambda: c.open_connections == 0, "the tainted idle connection dropped")
        async with asyncio.timeout(5):
            resp = await c.post(url, b"{}", {})
            assert await resp.read() == b"answer-B"
        assert len(accepted) == 2
        await c.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        b"HTTP/1.1 099 Nothing\r\ncontent-length: 0\r\n\r\n",
    ],
    ids=["101", "099"],
)
async def test_a_final_status_below_200_is_a_connect_error(head: bytes) -> None:
    """A 101 (or a status under 100) is no answer to a POST: httptools' HttpParserUpgrade
    escaped `data_received` (asyncio's "Fatal error" traceback) and the caller got a response
    with status 101 and no body. Now `post` fails with the connect error the proxy retries
    elsewhere, the connection is closed, and nothing reaches the loop's exception handler."""

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(head + b"garbage in another protocol")
        await w.drain()
        await r.read()

    async with server(h) as (url, _accepted):
        c = client()
        with _LoopErrors() as seen:
            with pytest.raises(UpstreamConnectError, match="malformed"):
                await c.post(url, b"{}", {})
            await asyncio.sleep(0.05)  # anything scheduled by the close runs
        assert c.open_connections == 0
        assert not seen, seen
        await c.close()


# -- through the gateway ---------------------------------------------------------------------
async def test_bytes_after_a_response_never_reach_another_clients_request() -> None:
    """The reviewer's reproducer: a worker sends client A's whole streamed answer and, in the
    same write, the head of a response nobody asked for; on a reused connection it then sends
    that response's body (A's private answer) before B's. B used to receive A's answer as its
    own. Now A's connection is closed when that head starts: B's request goes on a fresh
    connection and B receives exactly its own answer."""
    secret = _chunk("chatcmpl-A", "tenant A's private answer")

    async def first(r: asyncio.StreamReader, w: asyncio.StreamWriter, carried: int) -> None:
        w.write(
            _stream("chatcmpl-A", "answer A")
            + b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            + b"content-length: %d\r\n\r\n" % len(secret)
        )

    async def second(r: asyncio.StreamReader, w: asyncio.StreamWriter, carried: int) -> None:
        if carried:  # the connection of `first`: the stray response's body comes first
            w.write(secret)
            await w.drain()
            await asyncio.sleep(0.05)
        w.write(_stream("chatcmpl-B", "answer B"))

    async with (
        pooled_worker([first, second]) as (url, posts),
        run_gateway(settings_for([url])) as g,
    ):
        await g.wait_healthy(1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with httpx.AsyncClient(timeout=10) as ca:
            a = await ca.post(g.url + "/v1/chat/completions", json=body)
        async with httpx.AsyncClient(timeout=10) as cb:  # another client
            b = await cb.post(g.url + "/v1/chat/completions", json=body)
    assert b"answer A" in a.content and b"tenant A" not in a.content
    assert b"tenant A" not in b.content, f"client B received: {b.content!r}"
    assert b.status_code == 200 and b"answer B" in b.content and b'"error"' not in b.content
    assert len(posts) == 2 and posts[0][0] != posts[1][0]  # B on a new connection


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("kind", ["h1", "aiohttp"])
async def test_a_worker_101_is_an_upstream_error_envelope(
    kind: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The reviewer's reproducer, with both upstream clients: a worker answering a POST with
    `101 Switching Protocols`. The client used to get a bodiless 101 as the final answer (h1:
    after asyncio's fatal-error traceback; aiohttp hands the 101 over as a response). Now it
    gets the OpenAI-shaped 502 `upstream_error`, and nothing is logged as a fatal error."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
            b"\r\ngarbage in another protocol"
        )
        await w.drain()
        await asyncio.sleep(1)

    caplog.set_level(logging.ERROR, logger="asyncio")
    async with (
        raw_worker(script) as (url, _posts),
        run_gateway(settings_for([url], upstream={"client": kind})) as g,
    ):
        await g.wait_healthy(1)
        req = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        )
        # A raw socket: httpx (h11) would wait on for a final response after a 1xx.
        rd, wr = await asyncio.open_connection("127.0.0.1", int(g.url.rsplit(":", 1)[1]))
        try:
            wr.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(req), req)
            )
            async with asyncio.timeout(10):
                head = await rd.readuntil(b"\r\n\r\n")
                n = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                err = orjson.loads(await rd.readexactly(n))["error"]
        finally:
            wr.close()
    assert head.startswith(b"HTTP/1.1 502"), head
    assert err["type"] == "upstream_error", err
    fatal = [r.getMessage() for r in caplog.records if "data_received" in r.getMessage()]
    assert not fatal, fatal
