"""A request head that begins inside a read (after a body's tail, or after whole pipelined
requests) is charged its own bytes of that read (gateway/server.py,
`GuardedHttpProtocol.data_received`).

The server bounds a head that has not completed (`ConnectionGuard.max_head_bytes`, a 431 past
it). A read that lay within one head was charged whole, but one where the head began after other
bytes was charged nothing: the head's count restarted at 1 with the next read. So one read (up to
256 KiB) of a pipelined head went uncounted: a client could park a head of several times the
bound on a connection, and it was refused only once its later reads alone crossed the bound.
Charging the whole read instead was wrong the other way (a valid request behind a big body got a
431: tests/gateway/test_pipelining.py).

Most tests here drive the protocol directly with a fake transport: one `data_received` call is
one read, exactly, which a socket cannot promise. One runs the same shape over a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from uvicorn.server import ServerState

from gateway.server import ConnectionGuard, GuardedHttpProtocol, protocol_for
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.gateway.test_pipelining import WAIT_S, HeldWorker, _conn, _read_to_eof, _responses
from tests.support.raw_worker import raw_worker

BOUND = 2048  # the guard's bound on an incomplete head, in bytes
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n" % len(BODY)
)
GET = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
# The start of a pipelined head: its request line and one long field that has not ended yet.
PARTIAL = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: "


class FakeTransport(asyncio.Transport):
    """What the protocol writes, and whether it closed; nothing is sent anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False

    def write(self, data: Any) -> None:
        self.out += data

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return True


async def _held_app(scope: Any, receive: Any, send: Any) -> None:
    """Reads its request's body, then never answers: a request that keeps running."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def _protocol() -> AsyncIterator[tuple[GuardedHttpProtocol, FakeTransport]]:
    guard = ConnectionGuard(max_connections=10, head_timeout_s=60.0, max_head_bytes=BOUND)
    config = uvicorn.Config(_held_app, log_config=None, lifespan="off")
    state = ServerState()
    proto = protocol_for(guard)(config, state, {}, asyncio.get_running_loop())
    transport = FakeTransport()
    proto.connection_made(transport)
    try:
        yield proto, transport
    finally:
        proto.connection_lost(None)
        for task in list(state.tasks):
            task.cancel()
        await asyncio.gather(*state.tasks, return_exceptions=True)


def _status(out: bytes) -> bytes:
    return bytes(out).split(b"\r\n", 1)[0]


async def test_a_head_begun_after_a_body_tail_is_charged_its_bytes_of_that_read() -> None:
    """The review's shape, over the bound: a POST's body tail and, in the same read, a pipelined
    head of 3x the bound that has not ended. It was charged 1 byte (no refusal: the head could
    go on growing); now it is charged its bytes of the read, exactly, and refused with a 431."""
    async with _protocol() as (proto, transport):
        proto.data_received(POST + BODY[:-5])
        assert not proto._waiting  # in the POST's body
        proto.data_received(BODY[-5:] + PARTIAL + b"a" * (3 * BOUND))
        assert _status(transport.out) == b"HTTP/1.1 431 Request Header Fields Too Large"
        assert proto.guard.head_too_large == 1
        assert b'"code":"request_header_fields_too_large"' in transport.out


async def test_a_head_begun_inside_a_read_is_charged_exactly_its_bytes() -> None:
    """Under the bound: the count is the head's bytes in that read, not 1 and not the read's,
    whatever came before it (a body's tail, a whole bodyless request, a chunked body's end)."""
    head = PARTIAL + b"a" * 100
    async with _protocol() as (proto, _t):
        proto.data_received(POST + BODY[:-5])
        proto.data_received(BODY[-5:] + head)  # the tail of a content-length body
        assert proto._waiting and proto._head_bytes == len(head)
        proto.data_received(b"b" * 10)  # its next read counts whole, as before
        assert proto._head_bytes == len(head) + 10
    async with _protocol() as (proto, _t):
        proto.data_received(GET + head)  # a whole request before it, in one read
        assert proto._waiting and proto._head_bytes == len(head)
    async with _protocol() as (proto, _t):
        chunked = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        proto.data_received(chunked + b"%x\r\n%b\r\n" % (len(BODY), BODY))
        proto.data_received(b"0\r\n\r\n" + head)  # the end of a chunked body
        assert proto._waiting and proto._head_bytes == len(head)


async def test_a_head_behind_a_whole_request_with_a_body_is_never_charged_less() -> None:
    """Where the read holds a whole request with a body before the head, what precedes the head
    cannot be told apart exactly from what httptools reports: the charge is the least of two
    upper bounds (the bytes after the read's last blank line; the read less the body bytes it
    delivered), over the head's own bytes by the request's head at most, never under."""
    head = PARTIAL + b"a" * 100
    async with _protocol() as (proto, _t):
        proto.data_received(POST + BODY + head)
        assert proto._waiting
        assert len(head) <= proto._head_bytes <= len(head) + len(POST)
    # Over the bound, it is refused there and then.
    async with _protocol() as (proto, transport):
        proto.data_received(POST + BODY + PARTIAL + b"a" * (3 * BOUND))
        assert _status(transport.out) == b"HTTP/1.1 431 Request Header Fields Too Large"


async def test_a_head_begun_inside_a_read_over_a_socket_is_refused_past_the_bound() -> None:
    """The same over a real socket: a completion's body tail and 3x the bound of a pipelined
    head in one segment. The completion still running upstream is ended (the connection's
    framing cannot be trusted past a refusal) and the 431 is the one answer."""
    worker = HeldWorker()
    async with (
        raw_worker(worker.script) as (url, _posts),
        # The server's head bound is twice max_header_bytes: 2 KiB.
        run_gateway(settings_for([url], server={"max_header_bytes": 1024})) as g,
    ):
        await g.wait_healthy(1)
        port = int(g.url.rsplit(":", 1)[1])
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(POST + BODY[:-5])
        await w.drain()
        await until(lambda: bool(g.server.server_state.connections), WAIT_S, "connected")  # type: ignore[union-attr]
        conn = _conn(g)
        await until(lambda: not conn._waiting, WAIT_S, "the completion's head read")
        w.write(BODY[-5:] + PARTIAL + b"a" * (3 * BOUND))
        out, closed = await _read_to_eof(r)
        w.close()
        assert closed
        got = _responses(out)
        assert [h.split(b"\r\n", 1)[0] for h, _ in got] == [
            b"HTTP/1.1 431 Request Header Fields Too Large"
        ], out[:300]
        assert g.server.guard.head_too_large == 1  # type: ignore[union-attr]
