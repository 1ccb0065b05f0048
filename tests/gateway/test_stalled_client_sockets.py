"""Client connections the server closes while bytes it wrote are still unsent: a client that
does not read must not keep its socket, its place under `server.max_connections` or the bytes.

asyncio's and uvloop's `transport.close()` closes the socket only once the transport's write
buffer has drained: never, for a client that does not read. `connection_lost` then never runs,
so the guard's accounting never hears of it. Two ways in, both from the review:

* a stream the relay cuts off for not reading (`timeouts.client_stall_s`): the response stays
  unfinished and uvicorn closes the connection; it stayed open, counted and busy (not idle, so
  no eviction), and 16 such clients with `max_connections = 16` locked every new client out;
* a whole (non-streaming) answer bigger than the socket buffers: uvicorn writes all of it into
  the transport's buffer and the response is complete at once, so the connection counted as idle;
  the keep-alive timer or an eviction at the cap then closed it (uncounted) and it stayed, with
  its whole body, for good: unbounded sockets and memory.

The fix (gateway/server.py): a close that gives up on a client with bytes unsent aborts (a
reset), and a complete response whose bytes sit unsent keeps its connection busy until they are
out, aborted once its client takes nothing of them for `client_stall_s`. The last tests prove
the bound does not cut a client that reads slowly, and that such a connection is kept alive.

The sockets are counted from this process's own table (psutil): the gateway's side of each
connection, whatever the guard's counters say. Every wait is polled with a bound, never a fixed
sleep; the timeouts are short (`client_stall_s` 0.5 s) so each test takes a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import orjson
import psutil
import pytest
import uvloop
from starlette.requests import Request
from starlette.responses import Response

from tests.gateway.conftest import (
    MODEL,
    RunningGateway,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
)
from tests.gateway.test_upstream_h1 import SSE_HEAD
from tests.support.raw_worker import raw_worker

STALL_S = 0.5
# Generous: a fixed build frees these within ~client_stall_s; the old code never did.
SETTLE_S = 8.0
RUNNERS = pytest.mark.parametrize("runner", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
Runner = Callable[[Coroutine[Any, Any, None]], None]

EVENT = (
    b"data: "
    + orjson.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": "x" * 1000}, "finish_reason": None}],
        }
    )
    + b"\n\n"
)
SSE_CHUNK = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)


def _request(stream: bool, close: bool = False) -> bytes:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + (b"connection: close\r\n" if close else b"")
        + b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )


def _port(g: RunningGateway) -> int:
    return int(g.url.rsplit(":", 1)[1])


def _held(port: int) -> int:
    """The gateway's side of its client connections still open (sockets of this process)."""
    return sum(
        1
        for c in psutil.Process(os.getpid()).net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN
    )


async def _non_reader(port: int, request: bytes) -> socket.socket:
    """A client that sends ``request`` and never reads (a small receive buffer: it fills)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request)
    return sock


@contextlib.asynccontextmanager
async def _gateway(
    url: str, *, timeouts: dict[str, float], server: dict[str, float]
) -> AsyncIterator[RunningGateway]:
    """A gateway in front of ``url`` with small send buffers (a non-reader fills them soon),
    serving once its worker is healthy."""
    async with run_gateway(settings_for([url], timeouts=timeouts, server=server), sndbuf=8192) as g:
        await g.wait_healthy(1)
        yield g


async def _all_freed(g: RunningGateway, what: str) -> None:
    """Polls until the gateway holds no client socket and counts no connection; fails after
    `SETTLE_S` naming what is left (sockets held, the guard's count, bytes still unsent)."""
    port, guard = _port(g), g.server.guard  # type: ignore[union-attr]
    deadline = time.monotonic() + SETTLE_S
    while _held(port) or guard.open:
        if time.monotonic() > deadline:
            unsent = [
                p.transport.get_write_buffer_size()
                for p in list(g.server.server_state.connections)  # type: ignore[union-attr]
            ]
            raise AssertionError(
                f"{what}: {_held(port)} socket(s) still open, guard counts {guard.open}, "
                f"bytes unsent {unsent}"
            )
        await asyncio.sleep(0.05)


def _whole_worker(size: int) -> Any:
    """A worker whose whole chat answer carries ``size`` bytes of content."""

    async def chat(request: Request) -> Response:
        await request.body()
        body = orjson.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "a" * size},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )
        return Response(body, media_type="application/json")

    return stub_app(chat)


# -- streams cut off for not reading --------------------------------------------------------------
async def _stalled_stream_frees_its_socket() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD)
        for _ in range(20_000):  # ~20 MB over ~20 s: far more than any buffer holds
            w.write(SSE_CHUNK)
            await w.drain()
            await asyncio.sleep(0.001)

    async with (
        raw_worker(script) as (url, _),
        _gateway(
            url,
            timeouts={"client_stall_s": STALL_S, "idle_s": 5, "total_s": 60},
            server={"max_connections": 16},
        ) as g,
    ):
        sock = await _non_reader(_port(g), _request(stream=True))
        try:
            await _all_freed(g, "a stream cut off for not reading")
            assert not g.gw.life.streams
            assert g.server.guard.unsent_aborted == 1  # type: ignore[union-attr]
        finally:
            sock.close()


@RUNNERS
def test_a_stream_cut_off_for_not_reading_frees_its_socket_and_its_place(
    runner: Runner, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay cuts off a client that stopped reading and leaves the response unfinished;
    uvicorn's close then waited for the unsent bytes forever: the socket stayed open and kept
    its place under the cap. It is reset now, and uncounted. On both event loops (the tests run
    on asyncio, production on uvloop: their transports close differently). The cut, logged as
    `client_stalled`, is no ERROR from uvicorn ("returned without completing response")."""
    with caplog.at_level("WARNING"):
        runner(_stalled_stream_frees_its_socket())
    assert "client stopped reading" in caplog.text
    # The gateway's own (the stand-in worker's writes after its stream was aborted may log).
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "ERROR" and r.name.startswith(("uvicorn", "kvgate"))
    ]
    assert not errors, errors


async def test_clients_cut_off_for_not_reading_do_not_lock_out_new_ones() -> None:
    """16 streaming clients that never read, with `max_connections = 16`: once each is cut
    off, a new client is served. Before, the cut-off connections stayed counted and busy (not
    idle, so not evictable) and every newcomer was refused with a 503 for good."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + SSE_CHUNK * 300)  # ~300 kB at once, then silence
        await w.drain()
        await asyncio.sleep(30)

    async with (
        raw_worker(script) as (url, _),
        _gateway(
            url,
            timeouts={"client_stall_s": STALL_S, "idle_s": 3, "total_s": 60},
            server={"max_connections": 16},
        ) as g,
    ):
        port = _port(g)
        socks = [await _non_reader(port, _request(stream=True)) for _ in range(16)]
        try:
            await _all_freed(g, "16 streams cut off for not reading")
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            await w.drain()
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            w.close()
            assert head.startswith(b"HTTP/1.1 200"), head[:80]
        finally:
            for sk in socks:
                sk.close()


# -- whole answers to clients that never read ------------------------------------------------------
async def _whole_answers_are_not_leaked(n: int, size: int, cap: int) -> None:
    async with (
        serve_app(_whole_worker(size)) as url,
        _gateway(
            url,
            timeouts={"client_stall_s": STALL_S, "idle_s": 2, "total_s": 5},
            server={"keepalive_timeout_s": 1.0, "max_connections": cap},
        ) as g,
    ):
        port = _port(g)
        socks = [await _non_reader(port, _request(stream=False)) for _ in range(n)]
        try:
            # Every client was answered, or refused at the cap (the worker's part is over) ...
            served = g.server.server_state  # type: ignore[union-attr]
            guard = g.server.guard  # type: ignore[union-attr]
            await _wait(lambda: served.total_requests + guard.refused >= n)
            # ... and none of them keeps a socket (and its unsent body) once its client has
            # taken nothing for client_stall_s.
            await _all_freed(g, f"{n} whole answers nobody reads")
        finally:
            for sk in socks:
                sk.close()


async def _wait(pred: Callable[[], bool]) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not pred():
        assert time.monotonic() < deadline, "not within the bound"
        await asyncio.sleep(0.02)


@RUNNERS
def test_whole_answers_nobody_reads_are_reset_not_kept(runner: Runner) -> None:
    """A whole 8 MB answer to a client that never reads: uvicorn puts it all in the transport's
    buffer and the response is complete, so the connection looked idle; the keep-alive timer's
    close then waited for the buffer forever, uncounted: a socket and 8 MB kept per such client.
    Now the connection is busy until the answer is out, and reset once its client has taken
    nothing for client_stall_s."""
    runner(_whole_answers_are_not_leaked(n=4, size=8 << 20, cap=8192))


async def test_evicting_at_the_cap_does_not_leak_unsent_answers() -> None:
    """24 such clients with `max_connections = 16`: the eviction of an 'idle' connection at the
    cap closed it (uncounted) with its answer unsent, so the cap bounded nothing. Now such a
    connection is not idle (the newcomer is refused while all are busy) and every one is reset
    once it has taken nothing for client_stall_s: none is left."""
    await _whole_answers_are_not_leaked(n=24, size=1 << 20, cap=16)


@pytest.mark.parametrize("pipelined", [False, True], ids=["after-the-answer", "pipelined"])
async def test_a_next_request_does_not_lift_the_bound_on_unsent_bytes(pipelined: bool) -> None:
    """A client that never reads sends a next request, once the first answer is complete (and
    unsent) or with the first (pipelined): the first answer's bound goes on. The second answer
    queues behind the first (uvicorn's `send` waits for the buffer to drain), so a bound that
    ended at the next request, or that a pipelined one skipped, left the connection busy and
    counted for good."""
    async with (
        serve_app(_whole_worker(1 << 20)) as url,
        _gateway(
            url,
            timeouts={"client_stall_s": STALL_S, "idle_s": 2, "total_s": 30},
            server={"keepalive_timeout_s": 1.0},
        ) as g,
    ):
        served = g.server.server_state  # type: ignore[union-attr]
        sock = await _non_reader(_port(g), _request(stream=False) * (1 + pipelined))
        try:
            await _wait(lambda: served.total_requests >= 1)
            if not pipelined:
                await asyncio.get_running_loop().sock_sendall(sock, _request(stream=False))
            await _all_freed(g, "two whole answers nobody reads, on one connection")
        finally:
            sock.close()


# -- slow but reading: delivered, kept alive ----------------------------------------------------
async def _read_slowly(sock: socket.socket, n: int, pause_at: int) -> bytes:
    """Read ``n`` bytes in small pieces, 10 ms apart, with one pause of 0.3 s (under the 1 s
    stall bound, over the drain check's interval) once ``pause_at`` bytes are in."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    paused = False
    while len(got) < n:
        piece = await asyncio.wait_for(loop.sock_recv(sock, min(16384, n - len(got))), 10)
        assert piece, f"closed after {len(got)} of {n} bytes"
        got += piece
        if not paused and len(got) >= pause_at:
            paused = True
            await asyncio.sleep(0.3)
        else:
            await asyncio.sleep(0.01)
    return bytes(got)


async def _read_answer(sock: socket.socket, slowly: bool) -> tuple[bytes, bytes]:
    loop = asyncio.get_running_loop()
    head = b""
    while b"\r\n\r\n" not in head:
        piece = await asyncio.wait_for(loop.sock_recv(sock, 1), 10)
        assert piece, head
        head += piece
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    body = await _read_slowly(sock, length, length // 3) if slowly else b""
    if not slowly:
        while len(body) < length:
            piece = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
            assert piece
            body += piece
    return head, body


@pytest.mark.parametrize("mode", ["keep-alive", "connection-close", "pipelined"])
async def test_a_slow_reader_gets_the_whole_answer_and_keeps_its_connection(mode: str) -> None:
    """The bound must not cut a client that reads, however slowly: a 768 kB answer read in
    small pieces with a 0.3 s pause (client_stall_s 1 s) arrives whole. Kept alive, the
    connection then becomes idle (evictable, on the keep-alive clock) and serves a next request;
    with `connection: close` it is closed once the answer is out; a request pipelined behind the
    slow answer is answered in turn (the bound on the first answer's bytes, which goes on while
    the second is served, sees the client taking them)."""
    size = 768 << 10
    async with (
        serve_app(_whole_worker(size)) as url,
        _gateway(
            url,
            timeouts={"client_stall_s": 1.0, "idle_s": 5, "total_s": 20},
            server={"keepalive_timeout_s": 2.0},
        ) as g,
    ):
        guard = g.server.guard  # type: ignore[union-attr]
        first = _request(stream=False, close=mode == "connection-close")
        if mode == "pipelined":
            first += _request(stream=False)
        sock = await _non_reader(_port(g), first)
        loop = asyncio.get_running_loop()
        try:
            for _ in range(2 if mode == "pipelined" else 1):
                head, body = await _read_answer(sock, slowly=True)
                assert head.startswith(b"HTTP/1.1 200"), head
                answer = orjson.loads(body)
                assert len(answer["choices"][0]["message"]["content"]) == size
                assert guard.unsent_aborted == 0
            if mode == "connection-close":
                rest = await asyncio.wait_for(loop.sock_recv(sock, 1), 5)
                assert rest == b""  # closed after the answer
                await _wait(lambda: guard.open == 0)
                return
            await _wait(lambda: len(guard.idle) == 1)  # out: idle, on the keep-alive clock
            await loop.sock_sendall(sock, _request(stream=False))
            head, body = await _read_answer(sock, slowly=False)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert guard.unsent_aborted == 0
        finally:
            sock.close()
