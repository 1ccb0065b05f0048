"""Request heads the gateway's server (gateway/server.py) refuses or treats as RFC 9110/9112 say.

llhttp and uvicorn's httptools protocol let these through: a head of thousands of empty fields
(within the byte bound, at ~40x the CPU per byte), `100 Continue` sent to an HTTP/1.0 client, a
generic 400 for a request-target over 64 KiB, a transfer coding before `chunked` ignored (the app
read the coded body as plain), and an HTTP/1.1 request with no Host or two. Each refusal is an
OpenAI error envelope with `connection: close`, as the server's others are.

Raw sockets on 127.0.0.1; waits are bounded, never timed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.server import MAX_HEADER_FIELDS, MAX_URL_BYTES
from tests.gateway.conftest import MODEL, RunningGateway, run_gateway, settings_for
from tests.gateway.test_pipelining import WAIT_S, Immediate, _read_to_eof, _responses
from tests.support.raw_worker import raw_worker

BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
CHAT = b"POST /v1/chat/completions "


@contextlib.asynccontextmanager
async def _gateway() -> AsyncIterator[tuple[RunningGateway, int]]:
    async with (
        raw_worker(Immediate().script) as (url, _posts),
        run_gateway(settings_for([url])) as g,
    ):
        await g.wait_healthy(1)
        yield g, int(g.url.rsplit(":", 1)[1])


async def _exchange(port: int, data: bytes) -> list[tuple[bytes, bytes]]:
    """The whole responses to ``data`` on a new connection, which the gateway must close."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    out, closed = await _read_to_eof(r, WAIT_S)
    w.close()
    assert closed, out[:300]
    return _responses(out)


def _refusal(got: list[tuple[bytes, bytes]], status: bytes, code: str) -> dict[str, Any]:
    """The one response is an OpenAI envelope with ``status`` and ``code``, closing."""
    assert len(got) == 1, got
    head, body = got[0]
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"http/1.1 " + status.lower(), head
    assert b"content-type: application/json" in lines, head
    assert b"connection: close" in lines, head
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code and err["type"] == "invalid_request_error", err
    return err


def _status(got: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [head.split(b"\r\n", 1)[0] for head, _ in got]


def _post(version: bytes, fields: bytes, body: bytes = BODY) -> bytes:
    return CHAT + version + b"\r\n" + fields + b"content-length: %d\r\n\r\n%b" % (len(body), body)


# -- the number of header fields -------------------------------------------------------------------
async def test_a_head_with_too_many_fields_gets_a_431() -> None:
    """1,000 empty fields (4 kB, well within the byte bound) were accepted, each a Python
    callback; past `MAX_HEADER_FIELDS` the head is refused. Trailer fields are bounded alike."""
    async with _gateway() as (g, port):
        many = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"a:\r\n" * 1000 + b"\r\n"
        _refusal(
            await _exchange(port, many),
            b"431 Request Header Fields Too Large",
            "request_header_fields_too_large",
        )
        chunked = (
            CHAT + b"HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            b"%x\r\n%b\r\n0\r\n" % (len(BODY), BODY) + b"a:\r\n" * 1000 + b"\r\n"
        )
        _refusal(
            await _exchange(port, chunked),
            b"431 Request Header Fields Too Large",
            "request_header_fields_too_large",
        )
        assert g.server.guard.head_too_large == 2  # type: ignore[union-attr]
        fields = b"a: b\r\n" * (MAX_HEADER_FIELDS - 3)  # with host and connection: at the cap
        ok = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + fields + b"\r\n"
        assert _status(await _exchange(port, ok)) == [b"HTTP/1.1 200 OK"]


# -- Expect: 100-continue ---------------------------------------------------------------------------
async def test_an_http10_client_is_sent_no_100_continue() -> None:
    """RFC 9110 sections 10.1.1 and 15.2: an HTTP/1.0 request's expectation is ignored, and no
    1xx goes to an HTTP/1.0 client. HTTP/1.1 clients still get their `100 Continue`."""
    async with _gateway() as (_g, port):
        expect = b"host: x\r\nexpect: 100-continue\r\ncontent-type: application/json\r\n"
        got = await _exchange(port, _post(b"HTTP/1.0", expect))
        assert _status(got) == [b"HTTP/1.1 200 OK"], got
        got = await _exchange(port, _post(b"HTTP/1.1", expect + b"connection: close\r\n"))
        assert _status(got) == [b"HTTP/1.1 100 Continue", b"HTTP/1.1 200 OK"], got


# -- the request-target -----------------------------------------------------------------------------
async def test_a_request_target_over_the_bound_gets_a_414() -> None:
    async with _gateway() as (g, port):
        long = b"/health?" + b"a" * MAX_URL_BYTES
        err = _refusal(
            await _exchange(port, b"GET " + long + b" HTTP/1.1\r\nhost: x\r\n\r\n"),
            b"414 Request-URI Too Long",
            "uri_too_long",
        )
        assert str(MAX_URL_BYTES) in err["message"]
        # Far past it too (httptools' URL parser failed past 64 KiB: a generic 400 before).
        huge = b"/health?" + b"a" * 100_000
        _refusal(
            await _exchange(port, b"GET " + huge + b" HTTP/1.1\r\nhost: x\r\n\r\n"),
            b"414 Request-URI Too Long",
            "uri_too_long",
        )
        fits = b"/health?" + b"a" * (MAX_URL_BYTES - 100)
        ok = b"GET " + fits + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        assert _status(await _exchange(port, ok)) == [b"HTTP/1.1 200 OK"]
        assert g.server.guard.head_too_large == 2  # type: ignore[union-attr]


# -- Transfer-Encoding --------------------------------------------------------------------------------
def _chunked(te_fields: bytes) -> bytes:
    return (
        CHAT
        + b"HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + te_fields
        + b"\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY)
    )


@pytest.mark.parametrize(
    "te",
    [
        b"transfer-encoding: gzip, chunked\r\n",
        b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
    ],
    ids=["one line", "two lines"],
)
async def test_a_transfer_coding_before_chunked_gets_a_501(te: bytes) -> None:
    """RFC 9112 section 6.1: a coding the server does not know is a 501; the gzip was ignored
    and the coded body read as the plain one."""
    async with _gateway() as (_g, port):
        _refusal(
            await _exchange(port, _chunked(te)),
            b"501 Not Implemented",
            "unsupported_transfer_coding",
        )


async def test_chunked_alone_is_served_and_a_final_coding_other_than_chunked_is_a_400() -> None:
    async with _gateway() as (_g, port):
        got = await _exchange(port, _chunked(b"transfer-encoding: Chunked\r\n"))
        assert _status(got) == [b"HTTP/1.1 200 OK"], got
        for te in (b"transfer-encoding: gzip\r\n", b"transfer-encoding: chunked, gzip\r\n"):
            _refusal(await _exchange(port, _chunked(te)), b"400 Bad Request", "bad_http_request")


# -- Host ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [b"", b"host: a\r\nhost: b\r\n"], ids=["no host", "two hosts"])
async def test_an_http11_request_without_exactly_one_host_gets_a_400(fields: bytes) -> None:
    """RFC 9112 section 3.2: both were served."""
    async with _gateway() as (g, port):
        got = await _exchange(
            port, _post(b"HTTP/1.1", fields + b"content-type: application/json\r\n")
        )
        _refusal(got, b"400 Bad Request", "bad_http_request")
        assert g.server.guard.bad_requests == 1  # type: ignore[union-attr]


async def test_an_http10_request_without_host_is_served() -> None:
    """Health checkers send HTTP/1.0 without Host: allowed (Host is HTTP/1.1's requirement)."""
    async with _gateway() as (_g, port):
        got = await _exchange(port, b"GET /health HTTP/1.0\r\n\r\n")
        assert _status(got) == [b"HTTP/1.1 200 OK"], got
