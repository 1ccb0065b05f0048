"""Races at a stream's end: a timer, a drain or a stalled client meeting an ending stream, and a
worker's 5xx error body that does not end.

* The idle/deadline timer due in the event-loop iteration that handles the worker's last read
  (the one with [DONE]) cut a complete stream. Both loops run that read's I/O callback before the
  timer: the spliced relay had been fed [DONE] already and forwarded the whole answer, then an
  `idle_timeout` error event, the request reported as timed out (the deadline; the idle clock the
  read had just reset held); the generic relay, whose task takes each read itself, had not taken
  it yet and lost it to the cut (idle and deadline).
* A drain's cut (`cut_streams`) arriving while the relay sent a worker's error event added a
  second error event and a second [DONE].
* A client that stalls once the stream has settled as ok (its [DONE] is out, the relay reads the
  worker's stream to its end) relabelled the settled outcome `client_stalled`.
* A worker's 5xx error body was read whole before it was cut to 64 KiB: a worker streaming a
  huge error body made the gateway buffer all of it.

The loop's order of I/O, timers and callbacks makes the first, so those scenarios run on both
loops the gateway runs on (asyncio in tests, uvloop in production), as
tests/gateway/test_client_socket.py does. Workers
that misbehave on cue are raw sockets (`tests.support.raw_worker`); only 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
import pytest
import uvloop

from gateway.call import Call
from gateway.lifecycle import Lifecycle
from gateway.relay import RelayResponse
from tests.faults.conftest import parse_response, raw_exchange
from tests.faults.test_clients import connect, read_until, recv, send
from tests.faults.test_stream_endings import (
    BURST,
    ERROR_BODY,
    SETTLED_WITHIN_S,
    SHUTDOWN,
    request,
    stream_errors,
    whole_reply,
)
from tests.gateway.conftest import run_gateway, settings_for, until
from tests.gateway.test_upstream_h1 import SSE_HEAD, sse_chunks
from tests.support.raw_worker import Script, raw_worker

Runner = Callable[[Coroutine[Any, Any, None]], None]
LOOPS = pytest.mark.parametrize("runner", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])


def chunk_event(content: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    body = {"id": "x", "object": "chat.completion.chunk", "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


FIRST = chunk_event("first-event")
LAST = chunk_event("last-event", "stop")
USAGE = (
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def record_outcomes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Call, str | None]]:
    """Each finished call with the outcome it was settled (logged, charged) under; the call
    itself is kept too, so a test can see whether its outcome changed afterwards."""
    settled: list[tuple[Call, str | None]] = []
    real = Lifecycle.finish

    async def finish(self: Lifecycle, call: Call) -> None:
        if not call.finished:
            settled.append((call, call.outcome))
        await real(self, call)

    monkeypatch.setattr(Lifecycle, "finish", finish)
    return settled


# -- the idle/deadline timer and the worker's last read --------------------------------------------
async def _final_read_meets_the_timer(
    client: str, timeouts: dict[str, float], block_s: float, read_after_cut: bool = False
) -> None:
    """The worker sends one event; once the client has it, the rest of the stream ([DONE] and
    the body's end) goes out in one write, and the worker blocks the event loop (a loop busy
    under load) past the idle limit or the deadline.

    Written before the block, the read and the overdue timer are handled in the same loop
    iteration. Written one loop step after it (`read_after_cut`), the read trails the overdue
    timer by a step: the cut is asked for (on asyncio), and the splice feeds the relay [DONE]
    before its task wakes up to act on the cut."""
    forwarded = asyncio.Event()

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + sse_chunks([FIRST]))
        await w.drain()
        await forwarded.wait()
        if read_after_cut:
            time.sleep(block_s)  # noqa: ASYNC251 - the point: nothing in the loop runs meanwhile
            await asyncio.sleep(0)  # the overdue timer runs right after this step
        w.write(sse_chunks([LAST + USAGE + DONE]) + b"0\r\n\r\n")  # in the kernel at once
        if not read_after_cut:
            time.sleep(block_s)  # noqa: ASYNC251
        await r.read()

    async with raw_worker(script) as (url, _):
        s = settings_for(
            [url],
            timeouts={"first_byte_s": 10, "client_stall_s": 30, **timeouts},
            upstream={"client": client},
        )
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            sock = await connect(int(g.url.rsplit(":", 1)[1]))
            try:
                await send(sock, request())
                data = await read_until(sock, b"first-event")
                forwarded.set()
                while not data.endswith(b"0\r\n\r\n"):
                    chunk = await recv(sock, 65536, timeout=SETTLED_WITHIN_S)
                    assert chunk, f"connection closed early: {data[-300:]!r}"
                    data += chunk
            finally:
                sock.close()
            resp = parse_response(data)
            assert resp.status == 200
            assert b'"error"' not in resp.body, resp.body[-400:]
            assert b"last-event" in resp.body, resp.body[-400:]
            assert resp.body.endswith(DONE) and resp.body.count(b"[DONE]") == 1, resp.body[-400:]
            assert stream_errors(g.gw, "idle_timeout") == 0
            await until(
                lambda: g.gw.registry.workers["w0"].in_flight == 0 and not g.gw.life.streams,
                SETTLED_WITHIN_S,
                "the stream is settled",
            )


def assert_settled_ok(settled: list[tuple[Call, str | None]]) -> None:
    assert [outcome for _call, outcome in settled] == ["ok"]
    call = settled[0][0]
    assert call.outcome == "ok"
    assert call.usage is not None and call.usage.completion_tokens == 2


@LOOPS
@pytest.mark.parametrize("client", ["h1", "aiohttp"])  # the spliced relay, and the generic one
@pytest.mark.parametrize(
    ("timeouts", "block_s"),
    [
        # The worker's silence passes idle_s while the loop is blocked.
        pytest.param({"idle_s": 1.0, "total_s": 60.0}, 1.6, id="idle"),
        # The total deadline passes while the loop is blocked (it started before the POST).
        pytest.param({"idle_s": 30.0, "total_s": 2.0}, 2.6, id="deadline"),
    ],
)
def test_a_timer_due_with_the_final_read_does_not_cut_the_complete_stream(
    monkeypatch: pytest.MonkeyPatch,
    runner: Runner,
    client: str,
    timeouts: dict[str, float],
    block_s: float,
) -> None:
    """Before the fix: the spliced relay (h1) forwarded the whole stream, then an idle_timeout
    error event (deadline); the generic one (aiohttp) lost the last read to the cut (both)."""
    settled = record_outcomes(monkeypatch)
    runner(_final_read_meets_the_timer(client, timeouts, block_s))
    assert_settled_ok(settled)


@LOOPS
def test_a_cut_overtaken_by_the_splice_feeding_done_completes_the_stream(
    monkeypatch: pytest.MonkeyPatch, runner: Runner
) -> None:
    """The timer asked for the cut (the worker was silent past idle_s), and [DONE] reached the
    relay before its task acted on it: the stream's end has been seen, so it is not cut.
    (The generic relay has not seen a read its task did not take: that cut stands.)"""
    settled = record_outcomes(monkeypatch)
    runner(_final_read_meets_the_timer("h1", {"idle_s": 1.0, "total_s": 60.0}, 1.6, True))
    assert_settled_ok(settled)


# -- a drain's cut and a stream already ending with a worker's error -------------------------------
def first_event_then(end: str) -> Script:
    """One event, then the worker breaks off (closes the connection) or goes silent."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + sse_chunks([FIRST]))
        await w.drain()
        if end == "silent":
            await r.read()

    return script


@pytest.mark.parametrize(
    ("end", "reason"), [("broken", "upstream_broken"), ("silent", "idle_timeout")]
)
async def test_a_drain_cut_while_the_error_event_is_sent_adds_no_second_end(
    monkeypatch: pytest.MonkeyPatch, end: str, reason: str
) -> None:
    """The relay has sent the worker's error event and is ending the response (a client's flow
    control can hold that send) when the drain's grace runs out and it cuts the live streams:
    the client gets one error event and one [DONE], and the outcome stays the worker's."""
    settled = record_outcomes(monkeypatch)
    real_end = RelayResponse._end
    cuts: list[int] = []

    async def end_after_a_cut(self: RelayResponse, send: Any, body: bytes = b"") -> None:
        # The race, on cue: the error event is out and the relay is about to end the response
        # when the drain (another task: a loop callback here) cuts the live streams.
        if self._call.outcome == reason and not cuts:
            loop = asyncio.get_running_loop()
            loop.call_soon(lambda: cuts.append(self._life.cut_streams(SHUTDOWN)))
            await asyncio.sleep(0)  # the drain's task runs the cut meanwhile
        await real_end(self, send, body)

    monkeypatch.setattr(RelayResponse, "_end", end_after_a_cut)
    async with raw_worker(first_event_then(end)) as (url, _):
        s = settings_for([url], timeouts={"first_byte_s": 10, "idle_s": 1.0, "total_s": 60})
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            resp = await whole_reply(g)
            assert cuts, "the drain's cut ran"
            assert resp.status == 200
            assert b"first-event" in resp.body
            assert resp.body.count(b'"error"') == 1, resp.body[-600:]
            assert SHUTDOWN.encode() not in resp.body, resp.body[-600:]
            assert resp.body.endswith(DONE) and resp.body.count(b"[DONE]") == 1, resp.body[-600:]
            await until(
                lambda: g.gw.registry.workers["w0"].in_flight == 0 and not g.gw.life.streams,
                SETTLED_WITHIN_S,
                "the stream is settled",
            )
            assert stream_errors(g.gw, "gateway_shutdown") == 0
            assert stream_errors(g.gw, reason) == 1
            assert [o for _c, o in settled] == [reason]
            assert settled[0][0].outcome == reason


# -- a client that stalls once the stream has settled ----------------------------------------------
async def whole_answer_then_no_end(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """The whole answer and [DONE] (one event far larger than any socket buffer first), but not
    the body's terminating chunk: the relay, settled, reads on for it."""
    w.write(SSE_HEAD + sse_chunks([BURST + USAGE + DONE]))
    await w.drain()
    await r.read()


async def test_a_client_stalling_after_the_settlement_leaves_the_outcome_ok(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client reads nothing (small socket buffers on both ends): the stream settles as ok
    at [DONE], and the stall check then cuts the rest (the read of the worker's tail). The
    settled outcome, logged and charged, stays ok: no `client_stalled` relabel, no count."""
    settled = record_outcomes(monkeypatch)
    async with raw_worker(whole_answer_then_no_end) as (url, _):
        timeouts = {"first_byte_s": 10, "client_stall_s": 1.0, "idle_s": 120, "total_s": 300}
        async with run_gateway(settings_for([url], timeouts=timeouts), sndbuf=8192) as g:
            await g.wait_healthy(1)
            sock = await connect(int(g.url.rsplit(":", 1)[1]), rcvbuf=8192)
            try:
                await send(sock, request())
                await until(lambda: bool(settled), SETTLED_WITHIN_S, "the stream is settled")
                await until(
                    lambda: g.gw.upstream.open_connections == 0,
                    SETTLED_WITHIN_S,
                    "the stall check ended the read of the worker's tail",
                )
                assert [o for _c, o in settled] == ["ok"]
                assert settled[0][0].outcome == "ok"
                assert stream_errors(g.gw, "client_stalled") == 0
                assert g.gw.registry.workers["w0"].in_flight == 0
            finally:
                sock.close()


# -- a worker's 5xx error body that does not end ---------------------------------------------------
HUGE_ERROR_BYTES = 32 * 1024 * 1024
PIECE = 64 * 1024


def huge_error_body(sent: list[int]) -> Script:
    """A 500 whose body is the worker's error envelope followed by 32 MiB of whitespace (still
    one JSON document), written until the gateway hangs up; ``sent`` gets the bytes the worker
    could write."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n")
        w.write(b"content-length: %d\r\n\r\n%b" % (HUGE_ERROR_BYTES, ERROR_BODY))
        n = len(ERROR_BODY)
        try:
            while n < HUGE_ERROR_BYTES:
                piece = b" " * min(PIECE, HUGE_ERROR_BYTES - n)
                w.write(piece)
                await w.drain()
                n += len(piece)
        except ConnectionError:
            pass
        finally:
            sent.append(n)

    return script


@pytest.mark.parametrize("client", ["h1", "aiohttp"])
async def test_a_huge_5xx_body_is_read_only_up_to_the_cap(client: str) -> None:
    """The gateway keeps the first 64 KiB of a worker's error body, stops reading there and
    closes the connection: the worker cannot deliver the rest, the client gets the worker's
    error (status and envelope, which fits in what was read), and no pool connection or worker
    slot is left behind."""
    sent: list[int] = []
    async with raw_worker(huge_error_body(sent)) as (url, _):
        s = settings_for(
            [url],
            retries={"max_attempts": 1},
            # Far longer than reading all 32 MiB takes: only the cap stops the read.
            timeouts={"first_byte_s": 60, "idle_s": 120, "total_s": 300},
            upstream={"client": client},
        )
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            # connection: close: the response ends where the gateway closes the connection
            port = int(g.url.rsplit(":", 1)[1])
            resp = await raw_exchange(port, request(stream=True), timeout=SETTLED_WITHIN_S)
            assert resp.status == 500, resp
            err = orjson.loads(resp.body)["error"]
            assert err["message"] == "overloaded" and err["type"] == "server_error", err
            await until(lambda: bool(sent), SETTLED_WITHIN_S, "the worker's write ended")
            assert sent[0] < HUGE_ERROR_BYTES, "the gateway read the whole error body"
            assert g.gw.registry.workers["w0"].in_flight == 0
            if client == "h1":
                await until(
                    lambda: g.gw.upstream.open_connections == 0,
                    SETTLED_WITHIN_S,
                    "the pool holds no connection",
                )
