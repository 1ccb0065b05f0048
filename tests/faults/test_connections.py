"""Connections that never become requests, and requests the HTTP parser refuses.

A socket that sends nothing, or half a request head, costs the gateway a file descriptor for as
long as it stays open; enough of them locked every client out (accept failing with EMFILE, each
new client reset). The server (gateway/server.py) bounds the time to a complete head, the idle
time between requests, the size of a head that never completes, and the number of open
connections, closing the oldest idle connection to make room rather than refusing a newcomer.
Refusals made by the HTTP layer itself are OpenAI error envelopes like the gateway's own.

These tests run the gateway as production does (`gateway.server.build_server`); the last one runs
`kvgate serve` itself under a low open-file limit, the shape of the original report.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.asgi import create_app
from gateway.server import ConnectionGuard, build_server
from tests.faults.conftest import (
    KEY_OPEN,
    MODEL,
    Stack,
    assert_openai_error,
    fault_settings,
    parse_response,
    raw_exchange,
)
from tests.gateway.conftest import free_ports
from tests.support.sim_workers import run_sim_workers

CHAT = "/v1/chat/completions"
AUTH = {"authorization": f"Bearer {KEY_OPEN}", "content-type": "application/json"}
HALF_HEAD = b"POST / HTTP/1.1\r\nHost: x\r\n"  # the report's half-sent request
CAP = 16  # the smallest server.max_connections allowed


def chat(**kw: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw})


@contextlib.asynccontextmanager
async def guarded_stack(
    *, tenants: Mapping[str, Mapping[str, Any]] | None = None, **server: Any
) -> AsyncIterator[tuple[Stack, ConnectionGuard]]:
    """One in-process simulated worker and the gateway on the production server, its
    `[server]` options overridden by `server`."""
    async with run_sim_workers(1, profile="fast") as fleet:
        s = fault_settings(list(fleet), server=server, tenants=tenants)
        app = create_app(s)
        srv = build_server(app, s.server)
        assert srv.guard is not None
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        task = asyncio.create_task(srv.serve(sockets=[sock]))
        try:
            deadline = time.monotonic() + 10
            while not srv.started or not app.state.gateway.registry.healthy():
                if task.done():
                    task.result()
                assert time.monotonic() < deadline, "gateway never became ready"
                await asyncio.sleep(0.02)
            yield Stack(f"http://127.0.0.1:{port}", port, app.state.gateway, srv, fleet), srv.guard
        finally:
            srv.should_exit = True
            await task
            sock.close()


# -- raw sockets -----------------------------------------------------------------------------------
async def open_idle(
    port: int, payload: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if payload:
        writer.write(payload)
        await writer.drain()
    return reader, writer


async def read_to_close(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open after `timeout`."""
    data = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {timeout}s; got {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    return data


async def next_event(lines: AsyncIterator[str]) -> str:
    while not (line := await anext(lines)):
        pass
    return line


def closed_now(reader: asyncio.StreamReader) -> bool:
    return reader.at_eof() or reader.exception() is not None


async def settle(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


# -- the connection cap ------------------------------------------------------------------------------
async def test_an_idle_flood_past_the_cap_still_lets_requests_through() -> None:
    async with (
        guarded_stack(max_connections=CAP, head_timeout_s=60) as (s, _),
        httpx.AsyncClient(timeout=10) as c,
        c.stream(
            "POST", s.url + CHAT, content=chat(max_tokens=2000, stream=True), headers=AUTH
        ) as r,
    ):
        # A request in progress, then four times the cap of silent and half-sent connections.
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        idle = [await open_idle(s.port, HALF_HEAD if i % 2 else b"") for i in range(4 * CAP)]

        ok = await c.post(s.url + CHAT, content=chat(max_tokens=4), headers=AUTH)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"]

        # The flood recycled itself, oldest first; the stream (still running) was never a
        # candidate.
        assert s.fleet is not None and s.fleet.workers[0].engine.stats().num_running == 1
        await settle(lambda: closed_now(idle[0][0]) and closed_now(idle[1][0]))
        assert not closed_now(idle[-1][0])
        m = s.metrics()  # what an operator sees
        assert m["kvgate_client_connections"] <= CAP == m["kvgate_client_connections_max"]
        assert m['kvgate_client_connections_closed_total{reason="evicted_idle"}'] >= 3 * CAP
        assert m['kvgate_client_connections_closed_total{reason="refused_at_cap"}'] == 0
        rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
        for _, w in idle:
            w.close()
    await s.assert_quiescent()


async def test_at_the_cap_with_every_connection_busy_a_newcomer_gets_a_503_envelope() -> None:
    busy = CAP
    async with (
        guarded_stack(max_connections=CAP, tenants={"open": {"max_concurrent": busy + 4}}) as (
            s,
            guard,
        ),
        contextlib.AsyncExitStack() as stack,
    ):
        streams = []
        for _ in range(busy):  # one client (one connection) per stream
            c = await stack.enter_async_context(httpx.AsyncClient(timeout=20))
            r = await stack.enter_async_context(
                c.stream(
                    "POST", s.url + CHAT, content=chat(max_tokens=20_000, stream=True), headers=AUTH
                )
            )
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            streams.append(lines)
        assert guard.open == CAP and not guard.idle

        # Refused at once, before it sent anything: no parsing, no task.
        reader, writer = await open_idle(s.port)
        resp = parse_response(await read_to_close(reader, 10))
        writer.close()
        assert resp.status == 503 and resp.headers["retry-after"] == "1"
        err = assert_openai_error(resp.status, resp.headers["content-type"], resp.body)
        assert err["code"] == "too_many_connections"
        assert guard.refused == 1 and guard.evicted == 0

        for lines in streams:  # every busy connection was left alone, still streaming
            assert (await next_event(lines)).startswith("data: {")
        # The streams end by their clients hanging up; nothing may be left held.
    await s.assert_quiescent()


# -- time and size bounds on request heads --------------------------------------------------------------
async def test_silent_and_half_sent_connections_are_closed_after_the_head_timeout() -> None:
    # 2 s, not less: the half heads below are written right after connecting (or after the
    # response) and must arrive before the timers run out, even on a loaded host.
    async with guarded_stack(head_timeout_s=2.0, keepalive_timeout_s=2.0) as (s, guard):
        silent = await open_idle(s.port)
        half = await open_idle(s.port, HALF_HEAD)
        # A keep-alive connection after a response: idle, then half a head (uvicorn stops its
        # keep-alive timer at the first byte, and nothing else would ever close it).
        kept = await open_idle(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = await kept[0].readuntil(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200")
        kept[1].write(HALF_HEAD)
        idle_after_response = await open_idle(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")

        assert await read_to_close(silent[0], 10) == b""  # nothing sent, nothing to answer
        for reader, _ in (half, kept):
            resp = parse_response(await read_to_close(reader, 10))
            assert resp.status == 408 and resp.headers["connection"] == "close"
            err = assert_openai_error(resp.status, resp.headers["content-type"], resp.body)
            assert err["code"] == "request_timeout"
        resp = parse_response(await read_to_close(idle_after_response[0], 10))
        assert resp.status == 200  # served, then closed once idle for keepalive_timeout_s
        for _, w in (silent, half, kept, idle_after_response):
            w.close()
        await settle(lambda: guard.open == 0)
        assert guard.head_timeouts >= 3


async def test_a_head_that_never_ends_is_refused_at_a_size_bound() -> None:
    async with guarded_stack(max_header_bytes=1024, head_timeout_s=60) as (s, guard):
        reader, writer = await open_idle(s.port, HALF_HEAD)
        with contextlib.suppress(ConnectionError):
            for i in range(1000):  # 1000 header lines, far past 2 x max_header_bytes
                writer.write(f"x-h{i}: {'v' * 40}\r\n".encode())
                await writer.drain()
        resp = parse_response(await read_to_close(reader, 10))
        writer.close()
        assert resp.status == 431
        err = assert_openai_error(resp.status, resp.headers["content-type"], resp.body)
        assert err["code"] == "request_header_fields_too_large"
        assert guard.head_too_large == 1


# -- protocol errors are envelopes ------------------------------------------------------------------------
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_OPEN.encode()
)
BAD_REQUESTS = {
    # Request smuggling shapes: the framing is ambiguous, so nothing may reach a worker.
    "content-length and chunked": HEAD
    + b"\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two content-lengths": HEAD + b"\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "transfer-encoding not chunked": HEAD + b"\r\nTransfer-Encoding: gzip\r\n\r\n{}",
    "space before the colon": HEAD + b"\r\nContent-Length : 2\r\n\r\n{}",
    "bare LF line ends": b"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
    # Bad framing and bad request lines.
    "invalid chunk size": HEAD + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "request line garbage": b"GARBAGE\r\n\r\n",
    "unknown http version": b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n",
    "http/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    # Upgrades: the parser would drop the body; CONNECT is for proxies.
    "upgrade with a body": HEAD + b"\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
    b"Content-Length: %d\r\n\r\n" % len(chat(max_tokens=2)) + chat(max_tokens=2),
    "connect": b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
}


async def test_protocol_errors_are_openai_envelopes() -> None:
    async with guarded_stack() as (s, guard):
        before = s.engine_counts()
        for name, raw in BAD_REQUESTS.items():
            r = await raw_exchange(s.port, raw, timeout=10)
            assert r.status in (400, 405), (name, r.status, r.body[:200])
            err = assert_openai_error(r.status, r.headers.get("content-type", ""), r.body)
            assert err["type"] == "invalid_request_error", name
            assert r.headers["connection"] == "close", name
        assert s.engine_counts() == before  # nothing reached a worker
        assert guard.bad_requests >= 8
        await s.assert_quiescent()


async def test_a_refusal_reaches_a_client_still_sending_its_body() -> None:
    """The parser refuses at the head; the client is still sending 8 MiB of body. Closing at
    once would reset the connection and the client would never read the envelope."""
    async with guarded_stack() as (s, _):
        raw = (
            HEAD + b"\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + b"x" * (8 << 20)
        )
        r = await raw_exchange(s.port, raw, timeout=10)
        assert r.status == 400
        assert assert_openai_error(r.status, r.headers["content-type"], r.body)["code"] == (
            "bad_http_request"
        )


async def test_an_upgrade_without_a_body_is_served_as_http11() -> None:
    """`curl --http2` on http:// asks for h2c; a server may ignore Upgrade (RFC 9110)."""
    async with guarded_stack() as (s, _):
        r = await raw_exchange(
            s.port,
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY_OPEN.encode()
            + b"\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
        )
        assert r.status == 200 and orjson.loads(r.body)["data"][0]["id"] == MODEL
        assert r.headers["connection"] == "close"  # nothing after an upgrade request is parsed


async def test_keep_alive_requests_are_unaffected() -> None:
    """The guard's bookkeeping between requests of one connection: many requests, one
    connection, never idle long enough to be closed or counted twice."""
    async with (
        guarded_stack(max_connections=CAP, keepalive_timeout_s=5) as (s, guard),
        httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=1)) as c,
    ):
        for _ in range(30):
            r = await c.post(s.url + CHAT, content=chat(max_tokens=2), headers=AUTH)
            assert r.status_code == 200
        assert guard.open == 1 and guard.evicted == guard.refused == guard.head_timeouts == 0
    await s.assert_quiescent()


# -- the original report: an idle flood under a low open-file limit ---------------------------------------
NOFILE = 256  # what `kvgate serve` may open: the flood below is well past it


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


async def test_kvgate_serve_under_a_low_open_file_limit_survives_an_idle_flood(
    tmp_path: Path,
) -> None:
    async with run_sim_workers(1, profile="fast") as fleet:
        port = free_ports(1)
        cfg = tmp_path / "kvgate.toml"
        cfg.write_text(
            f'[server]\nport = {port}\n[logging]\nlevel = "warning"\n[probes]\ninterval_s = 0.2\n'
            f'[[workers]]\nname = "w0"\nurl = "{fleet[0]}"\n'
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "gateway.cli", "serve", "--config", str(cfg)),
            preexec_fn=_low_nofile,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        idle: list[asyncio.StreamWriter] = []
        try:
            async with httpx.AsyncClient(timeout=10) as c:
                for _ in range(300):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await c.get(url + "/ready")).status_code == 200:
                            break
                    await asyncio.sleep(0.05)
                for i in range(NOFILE + 150):
                    with contextlib.suppress(OSError):
                        idle.append((await open_idle(port, HALF_HEAD if i % 2 else b""))[1])
                await asyncio.sleep(0.5)
                for _ in range(3):  # new clients are served, not reset
                    r = await c.post(
                        url + CHAT,
                        content=chat(max_tokens=4),
                        headers={"content-type": "application/json"},
                    )
                    assert r.status_code == 200, r.text
            assert proc.returncode is None
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            for w in idle:
                w.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
