"""How a stream ends when something else happens at its end: a drain, a silent worker with a
client that stopped reading, a client that leaves during a worker's 5xx, a malformed usage chunk.

Each of these used to leave something held or break a complete answer:
* a drain's cut (`cut_streams`) cancelled a stream settling at [DONE]: the settlement stopped half
  way (lease and reservation left open, no usage record) and the client got a shutdown error
  instead of the [DONE] it was owed;
* the idle/deadline cut stopped the stall timer for good, so the error event's send waited
  forever on a client that was not reading, holding the worker slot and upstream connection;
* a client leaving while a worker's 5xx body was read left that upstream connection neither put
  back nor closed: its slot in the pool's `max_connections` was lost for good;
* a usage value of the wrong type (`"prompt_tokens": [9]`) raised out of the relay's scan,
  dropping the events of that read and reporting the complete stream as broken.

What must hold: every stream ends well-formed where its answer was whole, and nothing (worker
slot, lease, reservation, pool connection) outlives it. Workers that misbehave on cue are raw
sockets (`tests.support.raw_worker`); only 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest

from gateway import proxy
from gateway.quota_memory import MemoryQuotaStore
from gateway.upstream import UpstreamResponse
from tests.faults.conftest import http_request, parse_response, run_stack
from tests.faults.test_clients import AUTH, CHAT, chat, connect, read_until, send
from tests.gateway.conftest import MODEL, flat_metrics, run_gateway, settings_for, until
from tests.gateway.test_upstream_h1 import SSE_HEAD, sse_chunks
from tests.support.raw_worker import Script, raw_worker

# Generous bounds for what must happen within a second or two: a failure waits them out, a pass
# never comes near them.
SETTLED_WITHIN_S = 30.0

SHUTDOWN = "the gateway is shutting down; stream ended"  # what `Gateway.drain` cuts with


def request(stream: bool = True) -> bytes:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )
    return http_request(CHAT, body, headers={"content-type": "application/json"})


async def whole_reply(g: Any) -> Any:
    """One streaming request on a raw socket, read to the response's terminating chunk."""
    sock = await connect(int(g.url.rsplit(":", 1)[1]))
    try:
        await send(sock, request())
        return parse_response(await read_until(sock, b"0\r\n\r\n"))
    finally:
        sock.close()


def stream_errors(gw: Any, reason: str) -> float:
    metrics = flat_metrics(generate_latest(gw.metrics.registry).decode())
    return metrics.get(f'kvgate_stream_errors_total{{reason="{reason}"}}', 0.0)


# -- a drain's cut and a stream that is settling ---------------------------------------------------
async def test_a_drain_passes_by_a_stream_that_is_settling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The worker's [DONE] is in and the settlement is in a store round trip (made slow here, as
    a loaded Redis would) when the drain's grace runs out and it cuts the live streams."""
    settling = asyncio.Event()
    real_settle = MemoryQuotaStore.settle

    async def slow_settle(self: MemoryQuotaStore, *a: Any, **kw: Any) -> Any:
        settling.set()
        await asyncio.sleep(0.3)
        return await real_settle(self, *a, **kw)

    monkeypatch.setattr(MemoryQuotaStore, "settle", slow_settle)
    usage = tmp_path / "usage.jsonl"
    async with run_stack(1, quota={"usage_file": str(usage)}) as s:
        sock = await connect(s.port)
        try:
            await send(sock, http_request(CHAT, chat(stream=True, max_tokens=4), headers=AUTH))
            await asyncio.wait_for(settling.wait(), 10)
            s.gw.life.cut_streams(SHUTDOWN)  # what `drain` does once its grace is over
            resp = parse_response(await read_until(sock, b"0\r\n\r\n"))
        finally:
            sock.close()
        assert resp.status == 200
        assert SHUTDOWN.encode() not in resp.body, resp.body[-300:]
        assert resp.body.endswith(b"data: [DONE]\n\n"), resp.body[-300:]
        await until(
            lambda: usage.exists() and usage.read_bytes().count(b"\n") == 1,
            SETTLED_WITHIN_S,
            "the stream's usage record is written",
        )
        record = orjson.loads(usage.read_bytes())
        assert record["tenant"] == "open" and record["outcome"] == "ok", record
        await s.assert_quiescent(SETTLED_WITHIN_S)


# -- the idle/deadline cut and a client that is not reading ----------------------------------------
BURST = (
    b"data: "
    + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "x" * 2_000_000}}]})
    + b"\n\n"
)


async def burst_then_silence(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """One event far larger than any socket buffer, then nothing (a stalled, preempted worker)
    until the gateway hangs up."""
    w.write(SSE_HEAD + sse_chunks([BURST]))
    await w.drain()
    await r.read()


@pytest.mark.parametrize(
    "cut",
    [
        # The worker's silence passes idle_s well before the client's passes client_stall_s.
        pytest.param({"idle_s": 1.0, "client_stall_s": 3.0, "total_s": 60}, id="idle"),
        # The total deadline passes while the relay waits on the worker.
        pytest.param({"idle_s": 30.0, "client_stall_s": 30.0, "total_s": 2.0}, id="deadline"),
    ],
)
async def test_a_stream_cut_for_its_worker_frees_the_slot_while_the_client_is_not_reading(
    cut: dict[str, float],
) -> None:
    """The burst fills the client's transport past its high-water mark (small socket buffers on
    both ends) and the client reads nothing but keeps its socket open: the cut's error event
    cannot be sent, and the stall watch must still end the stream."""
    async with raw_worker(burst_then_silence) as (url, _):
        s = settings_for([url], timeouts={"first_byte_s": 10, **cut})
        async with run_gateway(s, sndbuf=8192) as g:
            await g.wait_healthy(1)
            w0 = g.gw.registry.workers["w0"]
            sock = await connect(int(g.url.rsplit(":", 1)[1]), rcvbuf=8192)
            try:
                await send(sock, request())
                await until(lambda: w0.in_flight == 1, 10, "the stream is on the worker")
                await until(
                    lambda: stream_errors(g.gw, "idle_timeout") == 1,
                    SETTLED_WITHIN_S,
                    "the stream is cut for its worker",
                )
                await until(
                    lambda: w0.in_flight == 0 and not g.gw.life.streams,
                    SETTLED_WITHIN_S,
                    "the worker slot is free while the client still holds its socket",
                )
                await until(
                    lambda: g.gw.upstream.open_connections == 0,
                    SETTLED_WITHIN_S,
                    "the upstream connection is closed",
                )
            finally:
                sock.close()


# -- a worker's 5xx body and a client that leaves --------------------------------------------------
ERROR_BODY = orjson.dumps({"error": {"message": "overloaded", "type": "server_error"}})


def error_in_two_halves(rest: asyncio.Event) -> Script:
    """A 500 whose body comes in two halves, the second once `rest` is set; then the worker
    closes the connection (its keep-alive timeout)."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n")
        w.write(b"content-length: %d\r\n\r\n%b" % (len(ERROR_BODY), ERROR_BODY[:5]))
        await w.drain()
        await rest.wait()
        w.write(ERROR_BODY[5:])
        await w.drain()

    return script


@pytest.mark.parametrize("client_leaves", [True, False], ids=["client-leaves", "client-stays"])
async def test_a_client_leaving_while_a_5xx_body_is_read_leaks_no_pool_connection(
    monkeypatch: pytest.MonkeyPatch, client_leaves: bool
) -> None:
    reading = asyncio.Event()
    real_read = proxy._read_bounded

    async def read_bounded(resp: UpstreamResponse, timeout: float) -> bytes:
        reading.set()
        return await real_read(resp, timeout)

    monkeypatch.setattr(proxy, "_read_bounded", read_bounded)
    rest = asyncio.Event()
    async with raw_worker(error_in_two_halves(rest)) as (url, _):
        s = settings_for([url], retries={"max_attempts": 1})
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            assert g.server is not None
            r, w = await asyncio.open_connection("127.0.0.1", int(g.url.rsplit(":", 1)[1]))
            try:
                w.write(request(stream=False))
                await w.drain()
                await asyncio.wait_for(reading.wait(), 10)
                if client_leaves:
                    w.close()
                    await until(
                        lambda: not any(not t.done() for t in g.server.server_state.tasks),
                        SETTLED_WITHIN_S,
                        "the request task ended with its client",
                    )
                    rest.set()
                else:
                    rest.set()
                    resp = parse_response(await asyncio.wait_for(r.read(), 10))
                    assert resp.status == 500 and b"overloaded" in resp.body, resp
            finally:
                w.close()
            await until(
                lambda: g.gw.upstream.open_connections == 0,
                SETTLED_WITHIN_S,
                "the pool holds no connection once the worker closed its own",
            )


# -- a malformed usage chunk -----------------------------------------------------------------------
MALFORMED_USAGE = [
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hello"},"finish_reason":"stop"}]}\n\n',
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":[9],"completion_tokens":1}}\n\n',
    b"data: [DONE]\n\n",
]


async def malformed_usage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """The first event alone, then the rest (content, usage, [DONE]) in one read."""
    w.write(SSE_HEAD + sse_chunks(MALFORMED_USAGE[:1]))
    await w.drain()
    await asyncio.sleep(0.05)
    w.write(sse_chunks([b"".join(MALFORMED_USAGE[1:])]) + b"0\r\n\r\n")
    await w.drain()
    await r.read()


@pytest.mark.parametrize("client", ["h1", "aiohttp"])  # the spliced relay, and the generic one
async def test_a_malformed_usage_value_does_not_break_a_complete_stream(client: str) -> None:
    async with (
        raw_worker(malformed_usage) as (url, _),
        run_gateway(settings_for([url], upstream={"client": client})) as g,
    ):
        await g.wait_healthy(1)
        resp = await whole_reply(g)
        assert resp.status == 200
        assert b'"hello"' in resp.body and b'"error"' not in resp.body, resp.body[-300:]
        assert resp.body.endswith(b"data: [DONE]\n\n"), resp.body[-300:]
        assert stream_errors(g.gw, "upstream_broken") == 0
