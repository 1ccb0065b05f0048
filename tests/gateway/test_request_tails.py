"""What arrives after a request head on the gateway's server layer (gateway/server.py): a
chunked body's trailer section, and a body still coming after the answer.

* uvicorn added trailer fields to the request's headers, unbounded (the connection guard only
  counts bytes while no head is complete): 97 MB of `a:b` trailers grew the process by 2 GB,
  and an `authorization` or `x-request-id` sent only as a trailer was honoured. Trailers are
  now dropped, and counted against the head's bound (a 431 past it), a field that never ends
  included.
* A request answered before its body was all in (a bad key, a declared size over the limit)
  left the connection waiting for a head while the body still came: the body was counted as
  one, so the client got an unsolicited 431 after its 401 or 413 (or a 408 for a slow upload).
  Such a connection now closes after the answer, dropping the rest of the body.

Raw sockets on 127.0.0.1 against the in-process gateway, on asyncio and on uvloop (production's
loop); waits are polled or bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import orjson
import pytest
import uvloop

from gateway.config import Settings
from tests.gateway.conftest import MODEL, RunningGateway, chat_completion, run_gateway, settings_for
from tests.gateway.test_pipelining import _read_to_eof
from tests.support.raw_worker import raw_worker

KEY = "kvg-tails-test"
WAIT_S = 10.0
RUNNERS = pytest.mark.parametrize("runner", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
Runner = Callable[[Coroutine[Any, Any, None]], None]
# The head bound the guard applies is twice this (a head that never completes).
MAX_HEADER_BYTES = 4096
ANSWER = orjson.dumps(chat_completion("tails"))


async def _answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
        % (len(ANSWER), ANSWER)
    )
    await w.drain()


def _settings(url: str, **server: Any) -> Settings:
    data = settings_for([url], server={"max_header_bytes": MAX_HEADER_BYTES, **server}).model_dump()
    data["tenants"] = {"a": {"keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]}}
    return Settings(**data)


@contextlib.asynccontextmanager
async def _stack(**server: Any) -> AsyncIterator[tuple[RunningGateway, int, list[bytes]]]:
    """The gateway (tenant keys on) in front of a worker that answers at once; yields it, its
    port and the chat bodies the worker received."""
    async with raw_worker(_answer) as (url, posts), run_gateway(_settings(url, **server)) as g:
        await g.wait_healthy(1)
        yield g, int(g.url.rsplit(":", 1)[1]), posts


def _body(pad: int = 0) -> bytes:
    content = "hi" + "x" * pad
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})


def _head(key: str | None, *framing: bytes) -> bytes:
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"host: x", b"content-type: application/json"]
    if key is not None:
        lines.append(b"authorization: Bearer " + key.encode())
    return b"\r\n".join([*lines, *framing]) + b"\r\n\r\n"


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


async def _read_response(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One content-length framed response: its head and body."""
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), WAIT_S)
    n = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            n = int(value)
    return head, await asyncio.wait_for(r.readexactly(n), WAIT_S)


def _statuses(out: bytes) -> list[bytes]:
    return [line for line in out.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip()
    return None


# -- trailers ------------------------------------------------------------------------------------
@RUNNERS
def test_trailer_fields_are_not_request_headers(runner: Runner) -> None:
    """A key and a request id sent only as trailers: the request has no key (401), and with the
    key in the head the trailer's request id is not the one echoed."""
    runner(_trailer_fields_are_not_request_headers())


async def _trailer_fields_are_not_request_headers() -> None:
    async with _stack() as (_g, port, posts):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        body = _body()
        trailers = b"authorization: Bearer %b\r\nx-request-id: from-trailer\r\n\r\n" % KEY.encode()
        w.write(_head(None, b"transfer-encoding: chunked") + _chunked(body) + b"0\r\n" + trailers)
        head, payload = await _read_response(r)
        assert head.startswith(b"HTTP/1.1 401"), head
        assert orjson.loads(payload)["error"]["code"] == "missing_api_key"
        assert _header(head, b"x-request-id") != b"from-trailer"
        w.write(_head(KEY, b"transfer-encoding: chunked") + _chunked(body) + b"0\r\n" + trailers)
        head, payload = await _read_response(r)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert _header(head, b"x-request-id") != b"from-trailer"
        assert orjson.loads(payload)["choices"][0]["message"]["content"] == "tails"
        assert [orjson.loads(p)["messages"] for p in posts] == [orjson.loads(body)["messages"]]
        w.close()


@RUNNERS
def test_a_flood_of_trailer_fields_is_refused_at_the_head_bound(runner: Runner) -> None:
    """The review's flood (`a:b` fields without end, after the last chunk), scaled down: a 431
    once the trailer section passes the head's bound, and the connection closes."""
    runner(_a_flood_of_trailer_fields_is_refused_at_the_head_bound())


async def _a_flood_of_trailer_fields_is_refused_at_the_head_bound() -> None:
    async with _stack() as (g, port, posts):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_head(KEY, b"transfer-encoding: chunked") + _chunked(_body()) + b"0\r\n")
        fields = b"a:b\r\n" * 800  # 4 kB a write, 40 kB in all: five times the bound
        with contextlib.suppress(ConnectionError):
            for _ in range(10):
                w.write(fields)
                await asyncio.wait_for(w.drain(), WAIT_S)
        out, closed = await _read_to_eof(r)
        w.close()
        assert _statuses(out) == [b"HTTP/1.1 431 Request Header Fields Too Large"], out[:200]
        assert b"request_header_fields_too_large" in out
        assert closed
        assert g.server.guard.head_too_large == 1  # type: ignore[union-attr]
        assert posts == []


@RUNNERS
def test_a_trailer_field_that_never_ends_is_refused_at_the_head_bound(runner: Runner) -> None:
    """One trailer field whose value keeps coming: the parser holds it, unseen by the field
    callback, until it ends; it is bounded all the same."""
    runner(_a_trailer_field_that_never_ends_is_refused_at_the_head_bound())


async def _a_trailer_field_that_never_ends_is_refused_at_the_head_bound() -> None:
    async with _stack() as (g, port, posts):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_head(KEY, b"transfer-encoding: chunked") + _chunked(_body()) + b"0\r\nx-long: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(20):  # 80 kB, ten times the bound, a read at a time
                await asyncio.sleep(0.01)
                w.write(b"v" * 4096)
                await asyncio.wait_for(w.drain(), WAIT_S)
        out, closed = await _read_to_eof(r)
        w.close()
        assert _statuses(out) == [b"HTTP/1.1 431 Request Header Fields Too Large"], out[:200]
        assert closed
        assert g.server.guard.head_too_large == 1  # type: ignore[union-attr]
        assert posts == []


@RUNNERS
def test_a_chunked_body_bigger_than_the_head_bound_sent_piecemeal_is_served(runner: Runner) -> None:
    """The trailer bound counts no body: a chunked body eight times the bound, in small
    chunks whose size lines, data and line ends each arrive in a read of their own, then a
    small trailer, is served whole on a connection that stays open."""
    runner(_a_chunked_body_bigger_than_the_head_bound_sent_piecemeal_is_served())


async def _a_chunked_body_bigger_than_the_head_bound_sent_piecemeal_is_served() -> None:
    async with _stack() as (_g, port, posts):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        body = _body(pad=8 * 2 * MAX_HEADER_BYTES)
        w.write(_head(KEY, b"transfer-encoding: chunked"))
        for i in range(0, len(body), 1024):
            piece = body[i : i + 1024]
            for part in (b"%x\r\n" % len(piece), piece, b"\r\n"):
                w.write(part)
                await w.drain()
                await asyncio.sleep(0.002)
        w.write(b"0\r\nx-checksum: abc\r\n\r\n")
        head, payload = await _read_response(r)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert orjson.loads(payload)["choices"][0]["message"]["content"] == "tails"
        assert [orjson.loads(p)["messages"] for p in posts] == [orjson.loads(body)["messages"]]
        w.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")  # kept alive
        head, _ = await _read_response(r)
        assert head.startswith(b"HTTP/1.1 200"), head
        w.close()


# -- a body still arriving after the answer ------------------------------------------------------
@RUNNERS
def test_a_body_after_an_early_401_is_not_read_as_a_head(runner: Runner) -> None:
    """The review's case: a bad key and a 200 kB body sent after the 401 came. The client gets
    the 401 alone (no 431 after it) and the connection closes."""
    runner(_a_body_after_an_early_401_is_not_read_as_a_head())


async def _a_body_after_an_early_401_is_not_read_as_a_head() -> None:
    async with _stack() as (g, port, posts):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_head("kvg-wrong", b"content-length: 200000"))
        head, payload = await _read_response(r)
        assert head.startswith(b"HTTP/1.1 401"), head
        assert orjson.loads(payload)["error"]["code"] == "invalid_api_key"
        with contextlib.suppress(ConnectionError):
            w.write(b"x" * 200_000)
            await asyncio.wait_for(w.drain(), WAIT_S)
        out, closed = await _read_to_eof(r)
        w.close()
        assert _statuses(out) == [], out[:200]
        assert closed
        guard = g.server.guard  # type: ignore[union-attr]
        assert guard.head_too_large == 0
        assert posts == []


@RUNNERS
def test_a_body_over_the_limit_after_its_413_is_not_read_as_a_head(runner: Runner) -> None:
    """A declared size over `max_body_bytes` (3 MB for 1 MB): the 413 alone, then the close."""
    runner(_a_body_over_the_limit_after_its_413_is_not_read_as_a_head())


async def _a_body_over_the_limit_after_its_413_is_not_read_as_a_head() -> None:
    async with _stack(max_body_bytes=1 << 20) as (g, port, posts):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_head(KEY, b"content-length: 3000000"))
        head, payload = await _read_response(r)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert orjson.loads(payload)["error"]["code"] == "request_too_large"
        with contextlib.suppress(ConnectionError):
            for _ in range(30):
                w.write(b"x" * 100_000)
                await asyncio.wait_for(w.drain(), WAIT_S)
        out, closed = await _read_to_eof(r)
        w.close()
        assert _statuses(out) == [], out[:200]
        assert closed
        assert g.server.guard.head_too_large == 0  # type: ignore[union-attr]
        assert posts == []


@RUNNERS
def test_a_slow_upload_after_an_early_answer_gets_no_408(runner: Runner) -> None:
    """A body trickling in after the 401, for longer than a head may take: no 408 for it."""
    runner(_a_slow_upload_after_an_early_answer_gets_no_408())


async def _a_slow_upload_after_an_early_answer_gets_no_408() -> None:
    async with _stack(head_timeout_s=0.2) as (g, port, _posts):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_head("kvg-wrong", b"content-length: 4000"))
        head, _ = await _read_response(r)
        assert head.startswith(b"HTTP/1.1 401"), head
        with contextlib.suppress(ConnectionError):
            for _ in range(8):  # 0.8 s: four head timeouts
                await asyncio.sleep(0.1)
                w.write(b"x" * 500)
        out, _closed = await _read_to_eof(r)
        w.close()
        assert _statuses(out) == [], out[:200]
        assert g.server.guard.head_timeouts == 0  # type: ignore[union-attr]


@RUNNERS
def test_a_request_answered_after_its_whole_body_keeps_its_connection(runner: Runner) -> None:
    """The close is for answers that beat their body: a request read whole, answered (a 401
    too), leaves the connection open for the next."""
    runner(_a_request_answered_after_its_whole_body_keeps_its_connection())


async def _a_request_answered_after_its_whole_body_keeps_its_connection() -> None:
    async with _stack() as (_g, port, _posts):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        body = _body()
        for key, status in (("kvg-wrong", b"401"), (KEY, b"200"), (KEY, b"200")):
            w.write(_head(key, b"content-length: %d" % len(body)) + body)
            head, _ = await _read_response(r)
            assert head.startswith(b"HTTP/1.1 " + status), head
            assert _header(head, b"connection") != b"close"
        w.close()
