"""Misbehaving clients on raw sockets: slow readers, disconnects, slow uploads, huge headers.

Each test ends with the leak check (`Stack.assert_quiescent`): no worker slot, tenant lease or
open reservation, engine request or gateway request task may outlive the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest

from tests.faults.conftest import (
    KEY_OPEN,
    MODEL,
    Stack,
    assert_openai_error,
    http_request,
    parse_response,
    raw_exchange,
    run_stack,
)
from workers.sim.profiles import PROFILES

CHAT = "/v1/chat/completions"
AUTH = {"authorization": f"Bearer {KEY_OPEN}", "content-type": "application/json"}
# First byte after 10 s: far enough to tell "aborted at once" from "noticed at the first byte"
# with a generous bound on "at once" (an aborted request frees its engine state at once; the
# long step itself holds nothing).
SLOW_PREFILL = replace(PROFILES["fast"], name="slow-prefill", prefill_c=10_000.0)


def chat(**kw: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw})


# -- raw client sockets ----------------------------------------------------------------------------
async def connect(port: int, *, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the advertised window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def send(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)


async def recv(sock: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    async with asyncio.timeout(timeout):
        return await asyncio.get_running_loop().sock_recv(sock, n)


async def read_until(sock: socket.socket, marker: bytes, count: int = 1) -> bytes:
    data = b""
    while data.count(marker) < count:
        chunk = await recv(sock, 65536)
        assert chunk, f"connection closed early: {data[:300]!r}"
        data += chunk
    return data


def hang_up(sock: socket.socket, how: str) -> None:
    if how == "reset":  # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@contextlib.asynccontextmanager
async def client(port: int, **kw: Any) -> AsyncIterator[socket.socket]:
    sock = await connect(port, **kw)
    try:
        yield sock
    finally:
        sock.close()


def counter(s: Stack, prefix: str) -> float:
    return sum(v for k, v in s.metrics().items() if k.startswith(prefix))


# -- a tap on the gateway's upstream client: how much it has pulled from the worker ----------------
class _TappedResponse:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.status = inner.status
        self.headers = inner.headers
        self.yielded = 0
        self.spliced = 0  # times the relay attached its sink
        # The relay's fast paths, counted too, where the inner response has them (h1).
        if hasattr(inner, "splice"):
            self.splice = self._splice
            self.next_chunk = self._next_chunk

    async def read(self) -> bytes:
        return await self._inner.read()

    async def chunks(self) -> AsyncIterator[bytes]:
        async for c in self._inner.chunks():
            self.yielded += len(c)
            yield c

    async def _next_chunk(self) -> bytes:
        c: bytes = await self._inner.next_chunk()
        self.yielded += len(c)
        return c

    async def _splice(self, sink: Callable[[bytes], bool]) -> bool:
        self.spliced += 1

        def counted(c: bytes) -> bool:
            self.yielded += len(c)
            return sink(c)

        return bool(await self._inner.splice(counted))

    async def abort(self) -> None:
        await self._inner.abort()

    async def release(self) -> None:
        await self._inner.release()

    @property
    def pulled(self) -> int:
        """Bytes the gateway has read off the worker's socket (h1's count, aiohttp's payload
        counter)."""
        inner = self._inner
        return inner.pulled if hasattr(inner, "pulled") else inner._r.content.total_bytes

    @property
    def buffered(self) -> int:
        """Pulled but not yet handed to the relay: the client's read buffer."""
        return self.pulled - self.yielded


class _Tap:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.responses: list[_TappedResponse] = []

    async def post(self, url: str, body: bytes, headers: Any, sent: Any = None) -> _TappedResponse:
        r = _TappedResponse(await self.inner.post(url, body, headers, sent))
        self.responses.append(r)
        return r

    async def close(self) -> None:
        await self.inner.close()


# -- slow readers ----------------------------------------------------------------------------------
async def _timed_requests(s: Stack, n: int) -> tuple[list[int], float]:
    t0 = time.monotonic()
    req = http_request(CHAT, chat(max_tokens=4), headers=AUTH)
    rs = await asyncio.gather(*(raw_exchange(s.port, req) for _ in range(n)))
    return [r.status for r in rs], time.monotonic() - t0


async def test_a_slow_reader_is_throttled_not_buffered_and_others_proceed() -> None:
    # The worker produces ~4.8 MB of SSE (20,000 tokens, the `instant` profile makes it at once)
    # while the client takes one byte per tick through a 4 KiB window. Backpressure must reach
    # the worker's socket: what the gateway itself holds (the upstream read buffer + the relay's
    # transport write buffer) stays bounded, far below the stream.
    async with run_stack(1, profile="instant", sndbuf=16384) as s:
        assert s.gw.proxy is not None
        tap = _Tap(s.gw.proxy.client)
        s.gw.proxy.client = tap  # type: ignore[assignment]
        disconnects = counter(s, "kvgate_client_disconnects_total")
        async with client(s.port, rcvbuf=4096) as sock:
            await send(sock, http_request(CHAT, chat(stream=True, max_tokens=20_000), headers=AUTH))
            head = await recv(sock, 1)
            got, held = len(head), 0
            others: asyncio.Future[tuple[list[int], float]] | None = None
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                got += len(await recv(sock, 1))
                await asyncio.sleep(0.002)
                if tap.responses:
                    wbuf = sum(t.get_write_buffer_size() for t in s.client_transports())
                    held = max(held, tap.responses[0].buffered + wbuf)
                if others is None and time.monotonic() - t0 > 0.3:
                    # Meanwhile other clients are served as usual.
                    others = asyncio.ensure_future(_timed_requests(s, 5))
            assert others is not None
            statuses, took = await others
            assert statuses == [200] * 5 and took < 5, (statuses, took)
            # A big stream: the worker generated far more than the gateway may pull (polled:
            # how far it got in the fixed window above depends on the host's load).
            engine = s.fleet.workers[0].engine
            deadline = time.monotonic() + 30
            while engine.stats().generation_tokens <= 10_000:
                assert time.monotonic() < deadline, engine.stats().generation_tokens
                await asyncio.sleep(0.02)
            pulled = tap.responses[0].pulled
            if hasattr(tap.responses[0]._inner, "splice"):  # h1, the default client
                assert tap.responses[0].spliced, "h1 responses are relayed by splicing"
            assert held < 1 << 20, f"gateway held {held} bytes for a client that read {got}"
            assert pulled < 2 << 20, f"gateway pulled {pulled} bytes for a client that read {got}"
            hang_up(sock, "close")
        await s.assert_quiescent()
        assert counter(s, "kvgate_client_disconnects_total") == disconnects + 1


async def test_spliced_streams_end_whole_and_hand_the_worker_connection_back() -> None:
    # [DONE] goes out with the response's terminator before the worker's stream is read to its
    # end; the relay then finishes reading it, so the next stream reuses the same connection
    # (whether the stream came in one read or was spliced: the worker's pace decides).
    async with run_stack(1) as s:
        assert s.gw.proxy is not None
        tap = _Tap(s.gw.proxy.client)
        s.gw.proxy.client = tap  # type: ignore[assignment]
        req = http_request(CHAT, chat(stream=True, max_tokens=40), headers=AUTH)
        for _ in range(3):
            r = await raw_exchange(s.port, req)
            assert r.status == 200
            events = [e for e in r.body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]" and len(events) >= 41, events
        if hasattr(tap.inner, "open_connections"):  # h1, the default client
            assert tap.inner.open_connections == 1
        await s.assert_quiescent()


async def test_a_stalled_reader_is_cut_off_at_the_total_deadline() -> None:
    timeouts = {"first_byte_s": 5, "idle_s": 0.5, "total_s": 1}
    async with run_stack(1, profile="instant", sndbuf=16384, timeouts=timeouts) as s:
        async with client(s.port, rcvbuf=4096) as sock:
            await send(sock, http_request(CHAT, chat(stream=True, max_tokens=20_000), headers=AUTH))
            await recv(sock, 100)  # headers arrived; now read nothing more
            # total_s + generous slack, still far below client_stall_s (30 s by default), the
            # only other bound on a reader that stops
            held = await s.leaks_after(1 + 5)
        assert not held, f"still held past total_s: {held}"


# -- disconnects -----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_disconnect_mid_stream_aborts_the_worker_request(how: str) -> None:
    async with run_stack(1) as s:
        before = s.engine_counts()
        disconnects = counter(s, "kvgate_client_disconnects_total")
        sock = await connect(s.port)
        await send(sock, http_request(CHAT, chat(stream=True, max_tokens=2000), headers=AUTH))
        await read_until(sock, b"\n\n", 3)  # a few events in: role chunk and content
        hang_up(sock, how)
        await s.assert_quiescent()
        after = s.engine_counts()
        # Aborted (2,000 tokens take seconds), not run to its length.
        assert after.get("abort", 0) == before.get("abort", 0) + 1, after
        assert after.get("length", 0) == before.get("length", 0), after
        assert counter(s, "kvgate_client_disconnects_total") == disconnects + 1
        # The tenant was charged what was streamed, and its slot is free for the next request.
        assert counter(s, 'kvgate_tenant_tokens_total{kind="settled"') > 0
        r = await raw_exchange(s.port, http_request(CHAT, chat(max_tokens=2), headers=AUTH))
        assert r.status == 200
        await s.assert_quiescent()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_disconnect_before_the_first_byte_aborts_the_worker_request(
    stream: bool,
) -> None:
    async with run_stack(1, profile=SLOW_PREFILL) as s:
        before = s.engine_counts()
        sock = await connect(s.port)
        await send(sock, http_request(CHAT, chat(stream=stream, max_tokens=50), headers=AUTH))
        # In prefill: the worker has the request, the gateway has sent the client nothing
        # (polled: a fixed pause may end before the request reaches the worker).
        assert s.fleet is not None
        worker = s.fleet.workers[0]
        deadline = time.monotonic() + 10
        while not worker.engine.stats().num_running:
            assert time.monotonic() < deadline, "the request never reached the worker"
            await asyncio.sleep(0.01)
        hang_up(sock, "close")
        held = await s.leaks_after(5.0)  # the first byte would come at 10 s
        after = s.engine_counts()
        assert not held, f"held 5 s after the client left: {held}"
        assert after.get("abort", 0) == before.get("abort", 0) + 1, after


# -- slow and abandoned uploads --------------------------------------------------------------------
@pytest.mark.parametrize("how", ["close", "reset"])
async def test_an_abandoned_upload_holds_nothing_and_is_not_a_gateway_error(how: str) -> None:
    async with run_stack(1) as s:
        body = chat(max_tokens=2)
        req = http_request(CHAT, body, headers=AUTH)
        sock = await connect(s.port)
        cut = len(req) - len(body) + 5
        await send(sock, req[:cut])
        for i in range(5):  # dribble a few bytes, then give up
            await asyncio.sleep(0.1)
            await send(sock, req[cut + i : cut + i + 1])
        held = await s.leaks()
        # Waiting for the body: a request task, but no quota, worker or engine state yet.
        assert set(held) <= {"gateway request tasks"}, held
        hang_up(sock, how)
        await s.assert_quiescent()
        rejected = {k: v for k, v in s.metrics().items() if k.startswith("kvgate_rejected")}
        assert rejected.get('kvgate_rejected_requests_total{reason="500"}', 0) == 0, rejected
        assert rejected.get('kvgate_rejected_requests_total{reason="499"}') == 1, rejected


async def test_a_stalled_upload_gets_a_408_after_the_body_timeout() -> None:
    async with run_stack(1, timeouts={"client_body_s": 1.0}) as s:
        body = chat(max_tokens=2)
        req = http_request(CHAT, body, headers=AUTH)
        async with client(s.port) as sock:
            await send(sock, req[: len(req) - len(body) // 2])
            data = b""
            with contextlib.suppress(TimeoutError):
                while chunk := await recv(sock, 65536, timeout=10):  # the 408 comes at 1 s
                    data += chunk
        r = parse_response(data)
        assert r.status == 408
        assert_openai_error(r.status, r.headers.get("content-type", ""), r.body)
        await s.assert_quiescent()


# -- headers ---------------------------------------------------------------------------------------
async def test_large_but_sane_headers_are_served() -> None:
    async with run_stack(1) as s:
        h = {**AUTH, "cookie": "c=" + "a" * 8000, "x-request-id": "r" * 1000}
        r = await raw_exchange(s.port, http_request(CHAT, chat(max_tokens=2), headers=h))
        assert r.status == 200
        # An over-long id is not echoed: the gateway's own id stands in.
        assert r.headers["x-request-id"] == r.headers["x-kvgate-request-id"]
        h = {"authorization": "Bearer " + "k" * 60_000}  # under server.max_header_bytes
        r = await raw_exchange(s.port, http_request(CHAT, chat(max_tokens=2), headers=h))
        assert r.status == 401
        assert_openai_error(r.status, r.headers["content-type"], r.body)
        await s.assert_quiescent()


@pytest.mark.parametrize("shape", ["one 1 MiB header", "20,000 headers"])
async def test_oversized_headers_are_refused_with_431(shape: str) -> None:
    async with run_stack(1) as s:
        if shape == "one 1 MiB header":
            h = {**AUTH, "x-big": "a" * (1 << 20)}
        else:
            h = {**AUTH, **{f"x-h{i}": "v" * 8 for i in range(20_000)}}
        before = s.engine_counts()
        r = await raw_exchange(s.port, http_request(CHAT, chat(max_tokens=2), headers=h))
        await s.assert_quiescent()
        assert r.status == 431
        if r.headers.get("content-type", "").startswith("application/json"):
            assert_openai_error(r.status, r.headers["content-type"], r.body)
        assert s.engine_counts() == before


async def test_requests_past_the_concurrency_cap_get_a_clean_503() -> None:
    async with run_stack(1, server={"max_concurrent_requests": 3}) as s:
        socks = []
        for _ in range(3):  # three uploads that never finish hold the three places
            sock = await connect(s.port)
            req = http_request(CHAT, chat(max_tokens=2), headers=AUTH)
            await send(sock, req[:-10])
            socks.append(sock)
        # Until the gateway counts the three (polled, not a fixed pause a loaded host may spend
        # before it has even read their heads).
        app = s.server.config.app
        deadline = time.monotonic() + 10
        while app._active < 3:
            assert time.monotonic() < deadline, f"{app._active} of 3 requests under way"
            await asyncio.sleep(0.01)
        r = await raw_exchange(s.port, http_request(CHAT, chat(max_tokens=2), headers=AUTH))
        assert r.status == 503 and r.headers["retry-after"] == "1"
        assert assert_openai_error(r.status, r.headers["content-type"], r.body)["code"] == (
            "too_many_connections"
        )
        for sock in socks:
            hang_up(sock, "close")
        await s.assert_quiescent()
        r = await raw_exchange(s.port, http_request(CHAT, chat(max_tokens=2), headers=AUTH))
        assert r.status == 200
