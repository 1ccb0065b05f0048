"""The hot path's own HTTP/1.1 client (gateway.upstream_h1) against scripted servers: pooling,
keep-alive, and every way a worker can fail mapped to the error the proxy retries (or not)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from gateway.upstream import AiohttpUpstream, UpstreamConnectError, UpstreamStreamError
from gateway.upstream_h1 import H1Upstream, _Conn, _RawHeaders
from tests.gateway.conftest import free_ports
from tests.support.raw_worker import server

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    n = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await r.readexactly(n)


async def keep_alive_ok(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        await read_request(r)
        w.write(OK)
        await w.drain()


# A generous connect bound: no test here is about connect timeouts, and a loaded host may take
# longer than a second to see a loopback connect through.
CONNECT_S = 10.0


async def until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll (a generous deadline, never one fixed pause) until `pred()` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.005)


def client(**kw: float) -> H1Upstream:
    args = {"connect_s": CONNECT_S, "max_connections": 8, "keepalive_s": 30.0, **kw}
    return H1Upstream(**args)  # type: ignore[arg-type]


async def test_sequential_requests_reuse_one_connection_and_send_what_was_given() -> None:
    seen: list[bytes] = []

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(r))
            w.write(OK)
            await w.drain()

    async with server(h) as (url, accepted):
        c = client()
        for i in range(5):
            resp = await c.post(url + "/v1/chat", b'{"i":%d}' % i, {"x-request-id": f"r{i}"})
            assert resp.status == 200 and resp.headers["content-type"] == "application/json"
            assert await resp.read() == b"{}"
            await resp.release()  # after read: must not hand the connection back twice
        assert len(accepted) == 1 and c.open_connections == 1
        assert seen[3].startswith(b"POST /v1/chat HTTP/1.1\r\n")
        assert b"x-request-id: r3\r\n" in seen[3] and seen[3].endswith(b'{"i":3}')
        # Two at once need two connections: a connection never carries two requests.
        a, b = await asyncio.gather(c.post(url, b"1", {}), c.post(url, b"2", {}))
        assert [await a.read(), await b.read()] == [b"{}", b"{}"]
        assert len(accepted) == 2
        await c.close()
        assert c.open_connections == 0


async def test_chunked_stream_arrives_in_order_and_aborting_closes_the_connection() -> None:
    go = asyncio.Event()
    closed = asyncio.Event()

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            ev = b"data: %d\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await w.drain()
        await go.wait()
        with contextlib.suppress(ConnectionError):
            w.write(b"a\r\ndata: end\n\r\n0\r\n\r\n")
            await w.drain()
        assert await r.read() == b""  # the client hung up
        closed.set()

    async with server(h) as (url, _):
        c = client()
        resp = await c.post(url, b"{}", {})
        got = b""
        async for chunk in resp.chunks():
            got += chunk
            if got.count(b"\n\n") == 3:
                break
        assert got == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        await resp.abort()
        go.set()
        await asyncio.wait_for(closed.wait(), 5)
        assert c.open_connections == 0


def sse_chunks(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(ev), ev) for ev in events)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def test_splice_hands_chunks_to_the_sink_in_order_and_the_connection_is_reused() -> None:
    release = asyncio.Event()

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(SSE_HEAD + sse_chunks([b"data: 0\n\n", b"data: 1\n\n"]))
            await w.drain()
            await release.wait()  # the rest comes while the sink is attached
            w.write(sse_chunks([b"data: 2\n\n", b"data: [DONE]\n\n"]) + b"0\r\n\r\n")
            await w.drain()
            release.clear()

    async with server(h) as (url, accepted):
        c = client()
        for _ in range(2):
            resp = await c.post(url, b"{}", {})
            got: list[bytes] = []

            def sink(b: bytes, got: list[bytes] = got) -> bool:
                got.append(b)
                return True

            first = await resp.next_chunk()  # type: ignore[attr-defined]
            while first.count(b"\n\n") < 2:
                first += await resp.next_chunk()  # type: ignore[attr-defined]
            release.set()
            assert await resp.splice(sink) is True  # type: ignore[attr-defined]
            assert first + b"".join(got) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            await resp.release()
        assert len(accepted) == 1 and c.open_connections == 1
        await c.close()


async def test_a_sink_that_says_stop_wakes_its_caller_and_the_rest_waits_buffered() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(SSE_HEAD + sse_chunks([b"data: a\n\n"]))
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(sse_chunks([b"data: b\n\n"]))
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(sse_chunks([b"data: c\n\n"]) + b"0\r\n\r\n")
        await w.drain()
        await r.read()

    async with server(h) as (url, _):
        c = client()
        resp = await c.post(url, b"{}", {})
        got: list[bytes] = []

        def stop(b: bytes) -> bool:
            got.append(b)
            return False

        while not got:
            assert await resp.splice(stop) is False  # type: ignore[attr-defined]
        # Detached: what comes next is buffered for the next read, not lost.
        rest = b""
        while chunk := await resp.next_chunk():  # type: ignore[attr-defined]
            rest += chunk
        assert b"".join(got) + rest == b"data: a\n\ndata: b\n\ndata: c\n\n"
        await resp.release()
        assert c.open_connections == 1
        await c.close()


async def test_a_body_that_breaks_off_under_a_splice_is_a_stream_error() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(SSE_HEAD + sse_chunks([b"data: a\n\n"]))
        await w.drain()
        await asyncio.sleep(0.05)  # then close mid-body

    async with server(h) as (url, _):
        c = client()
        resp = await c.post(url, b"{}", {})
        got: list[bytes] = []
        with pytest.raises(UpstreamStreamError):
            while not await resp.splice(lambda b: got.append(b) is None):  # type: ignore[attr-defined]
                pass
        assert b"".join(got) == b"data: a\n\n"
        await resp.abort()
        assert c.open_connections == 0


async def test_refused_is_a_connect_error_and_frees_its_slot() -> None:
    port = free_ports(1)
    c = client(max_connections=1)
    for _ in range(3):
        with pytest.raises(UpstreamConnectError):
            await c.post(f"http://127.0.0.1:{port}/v1/chat", b"{}", {})
    assert c.open_connections == 0


async def test_a_worker_that_closes_before_answering_is_a_connect_error() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)  # then close without a word

    async with server(h) as (url, _):
        c = client()
        with pytest.raises(UpstreamConnectError):
            await c.post(url, b"{}", {})
        assert c.open_connections == 0


async def test_a_body_that_breaks_off_is_a_stream_error() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await w.drain()

    async with server(h) as (url, _):
        c = client()
        resp = await c.post(url, b"{}", {})
        with pytest.raises(UpstreamStreamError):
            await resp.read()
        await resp.abort()
        assert c.open_connections == 0


async def test_garbage_instead_of_http_is_a_connect_error() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await w.drain()
        await r.read()

    async with server(h) as (url, _):
        c = client()
        with pytest.raises(UpstreamConnectError):
            await c.post(url, b"{}", {})
        assert c.open_connections == 0


async def test_a_pooled_connection_the_worker_closed_is_not_reused() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(OK)  # keep-alive by HTTP/1.1 default, but then the worker closes it
        await w.drain()

    async with server(h) as (url, accepted):
        c = client()
        for _ in range(3):
            resp = await c.post(url, b"{}", {})
            assert await resp.read() == b"{}"
            # The FIN arrives while the connection is idle: it gives its slot back then.
            await until(lambda: c.open_connections == 0, "the closed connection dropped")
        assert len(accepted) == 3
        assert c.open_connections == 0  # each closed one gave its slot back


async def test_connection_close_and_keepalive_expiry_are_honoured() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")
            await w.drain()

    async with server(h) as (url, accepted):
        c = client()
        for _ in range(2):
            await (await c.post(url, b"{}", {})).read()
        assert len(accepted) == 2 and c.open_connections == 0
    async with server(keep_alive_ok) as (url, accepted):
        c = client(keepalive_s=0.05)
        await (await c.post(url, b"{}", {})).read()
        await asyncio.sleep(0.1)
        await (await c.post(url, b"{}", {})).read()
        assert len(accepted) == 2 and c.open_connections == 1
        await c.close()


async def test_at_the_connection_limit_callers_wait_and_cancelled_waiters_leak_nothing() -> None:
    release = asyncio.Event()

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            await release.wait()
            w.write(OK)
            await w.drain()

    async with server(h) as (url, accepted):
        c = client(max_connections=2)
        first = [asyncio.create_task(c.post(url, b"{}", {})) for _ in range(2)]
        await until(lambda: len(accepted) == 2, "both connections accepted")
        waiting = asyncio.create_task(c.post(url, b"{}", {}))
        cancelled = asyncio.create_task(c.post(url, b"{}", {}))
        await asyncio.sleep(0.1)
        assert not waiting.done() and len(accepted) == 2
        cancelled.cancel()
        release.set()
        for t in first:
            r = await t
            await r.read()
        r = await asyncio.wait_for(waiting, 5)
        assert await r.read() == b"{}"
        assert len(accepted) == 2 and c.open_connections == 2
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await c.close()


async def test_a_timeout_while_waiting_for_the_head_spends_the_connection() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()  # never answers

    async with server(h) as (url, _):
        c = client()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await c.post(url, b"{}", {})
        assert c.open_connections == 0


def test_response_headers_answer_by_any_case_the_last_of_a_repeated_name() -> None:
    h = _RawHeaders([(b"Content-Type", b"text/event-stream"), (b"X-A", b"1"), (b"x-a", b"2")])
    assert h.get("content-type") == h["Content-Type"] == "text/event-stream"
    assert h.get("X-A") == h["x-a"] == "2"  # as a dict of the list would keep it
    assert h.get("missing", "d") == "d" and "missing" not in h
    assert dict(h) == {"content-type": "text/event-stream", "x-a": "2"} and len(h) == 2


async def test_sent_is_called_once_before_the_post_first_waits_and_after_a_pooled_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the caller does in `sent` (the prefix index learning the prompt) must happen before
    any other request can be routed, i.e. before `post` first yields; on a pooled connection it
    comes after the request is written, so it overlaps the worker's work."""
    order: list[str] = []
    made = _Conn.connection_made

    def recorded(self: _Conn, transport: asyncio.BaseTransport) -> None:
        write = transport.write  # type: ignore[attr-defined]

        def w(data: bytes) -> None:
            order.append("write")
            write(data)

        transport.write = w  # type: ignore[attr-defined]
        made(self, transport)

    monkeypatch.setattr(_Conn, "connection_made", recorded)
    async with server(keep_alive_ok) as (url, accepted):
        c = client()
        for expected in (["sent", "write"], ["write", "sent"]):  # new connection, then pooled
            order.clear()
            task = asyncio.create_task(
                c.post(url + "/v1/chat", b"{}", {}, lambda: order.append("sent"))
            )
            await asyncio.sleep(0)  # the post runs until it first waits
            assert order.count("sent") == 1
            resp = await task
            assert await resp.read() == b"{}"
            await resp.release()
            assert order == expected
        assert len(accepted) == 1
        await c.close()


async def test_an_interim_100_continue_is_not_taken_for_the_response() -> None:
    """httptools reports a 1xx as a whole message of its own. Taken for the answer, it ended the
    request with status 100 and no body, the connection went back to the pool with the real
    answer still to come, and the next request on it read the previous one's answer."""

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)  # the 100 is parsed on its own before the answer comes
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nanswer-A")
        await w.drain()
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nanswer-B")
        await w.drain()
        await r.read()

    async with server(h) as (url, accepted):
        c = client()
        got: list[tuple[int, bytes]] = []
        for _ in range(2):
            resp = await c.post(url, b"{}", {})
            got.append((resp.status, await resp.read()))
            await resp.release()
        await c.close()
        assert got == [(200, b"answer-A"), (200, b"answer-B")]
        assert len(accepted) == 1


async def close_delimited(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """A body with neither a length nor chunks: the worker's close ends it (RFC 9112 6.3)."""
    await read_request(r)
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
    w.write(b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}')
    await w.drain()


@pytest.mark.parametrize("kind", ["h1", "aiohttp"])
async def test_a_close_delimited_body_is_a_complete_response(kind: str) -> None:
    """httptools cannot be told about the EOF, so the close used to be "worker closed the
    connection": a complete answer became a stream error (and the proxy generated it again on
    another worker). aiohttp, whose semantics the h1 client keeps, reads it whole."""
    async with server(close_delimited) as (url, _):
        if kind == "h1":
            c = client()
        else:
            c = AiohttpUpstream(connect_s=CONNECT_S, max_connections=8, keepalive_s=30.0)
        resp = await c.post(url, b"{}", {})
        body = await resp.read()
        await resp.release()
        await c.close()
        assert resp.status == 200
        assert body == b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
        if kind == "h1":
            assert c.open_connections == 0  # not put back: the worker closed it


async def test_a_reloaded_connect_bound_reaches_the_https_workers_client() -> None:
    """Review: a reload's `timeouts.connect_s` reached the h1 client only; the aiohttp client it
    keeps for https workers (built at the first one) kept the start's bound, and no restart
    warning said so. So did `upstream.client = "aiohttp"`."""
    c = H1Upstream(connect_s=2.0, max_connections=8, keepalive_s=4.0)
    tls = AiohttpUpstream(connect_s=2.0, max_connections=8, keepalive_s=4.0)
    c._tls = tls  # as its first https request builds it
    try:
        c.connect_s = 10.0
        assert c.connect_s == 10.0
        assert tls.connect_s == 10.0
        assert (tls._timeout.connect, tls._timeout.sock_connect) == (10.0, 10.0)
    finally:
        await c.close()
