"""HTTP/1.1 pipelining on the gateway's server layer (gateway/server.py).

uvicorn queues every complete head of a read behind the running request, and resumes reading
after each answer: a client that sent reads full of whole `GET /health` heads grew the queue by
thousands per answer, with no key (a gigabyte in seconds). And it marks only the last request
it parsed when the client goes or the framing breaks, which under pipelining is a queued one:
the running request went on upstream for nobody, was billed, and wrote after the refusal's
end of stream (an ERROR per such connection).

Now at most `MAX_PIPELINED` requests queue behind the running one: past it the connection
takes no more (the last queued answer closes it), reads and drops what still comes, and sees
its client leave. A refusal or a disconnect ends the running request and drops the queued ones.

Every test runs on 127.0.0.1 with raw sockets, on asyncio and on uvloop (production's loop, whose
transports pause and see a client's FIN their own way); waits are polled or bounded, never timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import orjson
import pytest
import uvloop

from gateway.server import MAX_PIPELINED
from tests.gateway.conftest import (
    MODEL,
    RunningGateway,
    chat_completion,
    run_gateway,
    settings_for,
    until,
)
from tests.gateway.test_upstream_h1 import SSE_HEAD
from tests.support.raw_worker import raw_worker

HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
BAD = b"BAD\x01 / HTTP/1.1\r\n\r\n"  # a request line the parser refuses
WAIT_S = 10.0  # bound on each wait for something the gateway does at once when fixed
RUNNERS = pytest.mark.parametrize("runner", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
Runner = Callable[[Coroutine[Any, Any, None]], None]


def _chat(stream: bool = False) -> bytes:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )


ANSWER = orjson.dumps(chat_completion("pipelined"))
WHOLE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
    len(ANSWER),
    ANSWER,
)


class HeldWorker:
    """A worker that holds each chat call until ``release`` is set, then answers it whole; a
    call whose upstream connection the gateway closes first counts as ``aborted``."""

    def __init__(self) -> None:
        self.got = asyncio.Event()
        self.release = asyncio.Event()
        self.aborted = asyncio.Event()
        self.answered = 0

    async def script(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.got.set()
        eof = asyncio.ensure_future(r.read(1))
        released = asyncio.ensure_future(self.release.wait())
        await asyncio.wait({eof, released}, return_when=asyncio.FIRST_COMPLETED)
        if eof.done():
            released.cancel()
            self.aborted.set()
            return
        eof.cancel()
        w.write(WHOLE)
        await w.drain()
        self.answered += 1


class Immediate:
    """A worker that answers each chat call at once."""

    async def script(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(WHOLE)
        await w.drain()


class StreamingWorker:
    """A worker streaming `EVENTS` SSE events 20 ms apart; ``outcome`` says whether the gateway
    closed the upstream stream before its end ("aborted") or it ran to the end ("finished")."""

    EVENTS = 150  # 3 s: a stream nobody aborts runs well past the client's leaving

    def __init__(self) -> None:
        self.outcome = ""

    async def script(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        event = (
            b"data: "
            + orjson.dumps(
                {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}],
                }
            )
            + b"\n\n"
        )
        eof = asyncio.ensure_future(r.read(1))
        try:
            w.write(SSE_HEAD)
            for _ in range(self.EVENTS):
                if eof.done():
                    self.outcome = "aborted"
                    return
                w.write(b"%x\r\n%b\r\n" % (len(event), event))
                await w.drain()
                await asyncio.sleep(0.02)
            done = b"data: [DONE]\n\n"
            w.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
            await w.drain()
            self.outcome = "finished"
        except ConnectionError:
            self.outcome = "aborted"
        finally:
            eof.cancel()


@contextlib.asynccontextmanager
async def _stack(script: Any) -> AsyncIterator[tuple[RunningGateway, int]]:
    async with (
        raw_worker(script) as (url, _posts),
        run_gateway(settings_for([url])) as g,
    ):
        await g.wait_healthy(1)
        yield g, int(g.url.rsplit(":", 1)[1])


def _conn(g: RunningGateway) -> Any:
    """The gateway's protocol for the one client connection open."""
    conns = list(g.server.server_state.connections)  # type: ignore[union-attr]
    assert len(conns) == 1, conns
    return conns[0]


async def _read_to_eof(r: asyncio.StreamReader, timeout: float = WAIT_S) -> tuple[bytes, bool]:
    """What the gateway sends until it closes (True) or ``timeout`` passes (False)."""
    out = b""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    with contextlib.suppress(TimeoutError, ConnectionError):
        while True:
            chunk = await asyncio.wait_for(r.read(65536), max(0.0, end - loop.time()))
            if not chunk:
                return out, True
            out += chunk
    return out, False


def _responses(out: bytes) -> list[tuple[bytes, bytes]]:
    """The whole responses (head, body) at the start of ``out``: all are content-length framed."""
    done = []
    while (end := out.find(b"\r\n\r\n")) >= 0:
        head = out[:end]
        n = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                n = int(value)
        if len(out) < end + 4 + n:
            break
        done.append((head, out[end + 4 : end + 4 + n]))
        out = out[end + 4 + n :]
    return done


def _statuses(out: bytes) -> list[bytes]:
    return [head.split(b"\r\n", 1)[0] for head, _ in _responses(out)]


async def _read_responses(r: asyncio.StreamReader, n: int) -> list[tuple[bytes, bytes]]:
    out = b""
    while len(got := _responses(out)) < n:
        chunk = await asyncio.wait_for(r.read(65536), WAIT_S)
        assert chunk, f"closed after {_statuses(out)}"
        out += chunk
    return got


# -- the queue is bounded ------------------------------------------------------------------------
@RUNNERS
def test_pipelined_heads_past_the_cap_are_not_queued_and_the_last_answer_closes(
    runner: Runner,
) -> None:
    """50 heads behind a held request, in one write: at most `MAX_PIPELINED` queue (uvicorn
    queued all 50), the running one and the queued ones are answered in order, and the last
    answer closes the connection (the client sends the others again)."""
    runner(_pipelined_heads_past_the_cap_are_not_queued_and_the_last_answer_closes())


async def _pipelined_heads_past_the_cap_are_not_queued_and_the_last_answer_closes() -> None:
    worker = HeldWorker()
    async with _stack(worker.script) as (g, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_chat() + HEALTH * 50)
        await asyncio.wait_for(worker.got.wait(), WAIT_S)
        conn = _conn(g)
        await until(lambda: len(conn.pipeline) >= MAX_PIPELINED, WAIT_S, "heads queued")
        queued = len(conn.pipeline)
        assert queued == MAX_PIPELINED, f"{queued} requests queued"
        worker.release.set()
        out, closed = await _read_to_eof(r)
        w.close()
        got = _responses(out)
        assert _statuses(out) == [b"HTTP/1.1 200 OK"] * (1 + MAX_PIPELINED)
        assert b"pipelined" in got[0][1]  # the completion's answer first, then the GETs'
        assert b"connection: close" in got[-1][0]
        assert not any(b"connection: close" in head for head, _ in got[:-1])
        assert closed
        await until(lambda: g.server.guard.open == 0, WAIT_S, "connection uncounted")  # type: ignore[union-attr]


@RUNNERS
def test_a_client_flooding_pipelined_heads_then_leaving_frees_its_connection(
    runner: Runner,
) -> None:
    """The review's flood: reads full of whole heads behind a held request. The queue stays at
    the cap while the rest is read and dropped, and once the client closes (a FIN, which a
    paused socket never sees) the running request's upstream call is aborted, the queued ones
    dropped and the connection freed, with the worker still holding the call."""
    runner(_a_client_flooding_pipelined_heads_then_leaving_frees_its_connection())


async def _a_client_flooding_pipelined_heads_then_leaving_frees_its_connection() -> None:
    worker = HeldWorker()
    async with _stack(worker.script) as (g, port):
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_chat())
        await asyncio.wait_for(worker.got.wait(), WAIT_S)
        conn = _conn(g)
        flood = HEALTH * 2000  # 66 kB of whole heads a write
        for _ in range(16):
            w.write(flood)
            with contextlib.suppress(TimeoutError):  # a gateway that stops reading fills up
                await asyncio.wait_for(w.drain(), 1.0)
            queued = len(conn.pipeline)
            assert queued <= MAX_PIPELINED, f"{queued} requests queued"
        w.close()
        await asyncio.wait_for(worker.aborted.wait(), WAIT_S)
        await until(
            lambda: g.server.guard.open == 0 and not g.server.server_state.connections,  # type: ignore[union-attr]
            WAIT_S,
            "connection freed",
        )
        assert len(conn.pipeline) == 0
        assert worker.answered == 0


@RUNNERS
def test_a_few_pipelined_requests_are_answered_in_order_on_a_kept_connection(
    runner: Runner,
) -> None:
    """What clients that pipeline do (two or three requests, and up to the cap): every one is
    answered in order and the connection stays open for the next."""
    runner(_a_few_pipelined_requests_are_answered_in_order_on_a_kept_connection())


async def _a_few_pipelined_requests_are_answered_in_order_on_a_kept_connection() -> None:
    async with _stack(Immediate().script) as (_g, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_chat() + HEALTH + _chat())
        got = await _read_responses(r, 3)
        assert [head.split(b"\r\n", 1)[0] for head, _ in got] == [b"HTTP/1.1 200 OK"] * 3
        assert [b"pipelined" in body for _, body in got] == [True, False, True]
        assert not any(b"connection: close" in head for head, _ in got)
        w.write(HEALTH * (1 + MAX_PIPELINED))  # exactly the running one and a full queue
        got = await _read_responses(r, 1 + MAX_PIPELINED)
        assert len(got) == 1 + MAX_PIPELINED
        assert not any(b"connection: close" in head for head, _ in got)
        w.write(HEALTH)
        assert len(await _read_responses(r, 1)) == 1
        w.close()


# -- a refusal or a disconnect ends the running request ----------------------------------------
@RUNNERS
def test_a_malformed_request_behind_pipelined_ones_ends_the_running_one(
    runner: Runner, caplog: pytest.LogCaptureFixture
) -> None:
    """The review's shape: a completion, a pipelined GET and malformed bytes in one write. The
    client gets the 400 alone; the completion (not the queued GET) is ended: it is not served
    and billed for nobody, and writes nothing after the refusal's end of stream (uvicorn
    logged that RuntimeError at ERROR, once per such connection)."""
    runner(_a_malformed_request_behind_pipelined_ones_ends_the_running_one(caplog))


async def _a_malformed_request_behind_pipelined_ones_ends_the_running_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    async with _stack(Immediate().script) as (g, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_chat() + HEALTH + BAD)
        out, closed = await _read_to_eof(r)
        w.close()
        assert closed
        assert _statuses(out) == [b"HTTP/1.1 400 Bad Request"]
        tasks = g.server.server_state.tasks  # type: ignore[union-attr]
        await until(lambda: not tasks, WAIT_S, "request tasks over")
        m = await g.metrics()
        served = [k for k in m if k.startswith("kvgate_requests_total") and '"200"' in k]
        assert not served, served
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@RUNNERS
def test_a_malformed_request_behind_a_running_one_aborts_its_upstream_call(
    runner: Runner, caplog: pytest.LogCaptureFixture
) -> None:
    """The same with the completion already upstream: its call is aborted at the refusal."""
    runner(_a_malformed_request_behind_a_running_one_aborts_its_upstream_call(caplog))


async def _a_malformed_request_behind_a_running_one_aborts_its_upstream_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    worker = HeldWorker()
    async with _stack(worker.script) as (_g, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_chat() + HEALTH)
        await asyncio.wait_for(worker.got.wait(), WAIT_S)
        w.write(BAD)
        await asyncio.wait_for(worker.aborted.wait(), WAIT_S)
        out, closed = await _read_to_eof(r)
        w.close()
        assert closed
        assert _statuses(out) == [b"HTTP/1.1 400 Bad Request"]
        assert worker.answered == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@RUNNERS
def test_a_client_leaving_mid_stream_with_a_pipelined_request_aborts_the_stream(
    runner: Runner,
) -> None:
    """The review's shape: a stream with a GET pipelined behind it, and the client hangs up.
    The stream upstream is aborted, as it is without the pipelined request (uvicorn marked the
    queued GET gone, and the worker generated every event for nobody)."""
    runner(_a_client_leaving_mid_stream_with_a_pipelined_request_aborts_the_stream())


async def _a_client_leaving_mid_stream_with_a_pipelined_request_aborts_the_stream() -> None:
    worker = StreamingWorker()
    async with _stack(worker.script) as (g, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_chat(stream=True) + HEALTH)
        first = await asyncio.wait_for(r.read(300), WAIT_S)
        assert first.startswith(b"HTTP/1.1 200 OK")
        w.transport.abort()
        await until(lambda: worker.outcome != "", WAIT_S, "the worker's stream over")
        assert worker.outcome == "aborted"
        await until(lambda: g.server.guard.open == 0, WAIT_S, "connection freed")  # type: ignore[union-attr]
        assert not g.gw.life.streams


@RUNNERS
def test_a_client_leaving_with_a_request_queued_aborts_the_running_one(runner: Runner) -> None:
    """A whole completion upstream, a request pipelined behind it a moment later, then the
    client closes. uvicorn stopped reading at the queued request, so the close went unseen (and
    would have been told to the queued request): the worker answered for nobody, billed. Now
    the upstream call is aborted and the connection freed while the worker still holds it."""
    runner(_a_client_leaving_with_a_request_queued_aborts_the_running_one())


async def _a_client_leaving_with_a_request_queued_aborts_the_running_one() -> None:
    worker = HeldWorker()
    async with _stack(worker.script) as (g, port):
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_chat())
        await asyncio.wait_for(worker.got.wait(), WAIT_S)
        conn = _conn(g)
        w.write(HEALTH)
        await until(lambda: len(conn.pipeline) == 1, WAIT_S, "the GET queued")
        w.close()
        await asyncio.wait_for(worker.aborted.wait(), WAIT_S)
        await until(
            lambda: g.server.guard.open == 0 and not g.server.server_state.connections,  # type: ignore[union-attr]
            WAIT_S,
            "connection freed",
        )
        assert len(conn.pipeline) == 0
        assert worker.answered == 0


# -- a pipelined head is bounded by its own bytes --------------------------------------------------
@RUNNERS
def test_a_pipelined_head_split_after_a_body_tail_is_not_charged_the_tail(runner: Runner) -> None:
    """The review's shape: a completion with a body, its last bytes and the first bytes of a
    pipelined GET in one read, the rest of the GET's head in the next. The whole first read was
    counted as head bytes: past the head's bound (here 2 KiB) the GET got a 431 and the running
    completion was ended unanswered. Now both are answered."""
    runner(_a_pipelined_head_split_after_a_body_tail_is_not_charged_the_tail())


async def _a_pipelined_head_split_after_a_body_tail_is_not_charged_the_tail() -> None:
    worker = HeldWorker()
    async with (
        raw_worker(worker.script) as (url, _posts),
        # The server's head bound is twice max_header_bytes: 2 KiB.
        run_gateway(settings_for([url], server={"max_header_bytes": 1024})) as g,
    ):
        await g.wait_healthy(1)
        port = int(g.url.rsplit(":", 1)[1])
        body = (
            orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})[:-1]
            + b" " * 40_000
            + b"}"
        )  # valid JSON, padded
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(head + body[:-10_000])
        await w.drain()
        await until(lambda: bool(g.server.server_state.connections), WAIT_S, "connected")  # type: ignore[union-attr]
        conn = _conn(g)
        await until(lambda: not conn._waiting, WAIT_S, "the completion's head read")
        # 10 kB of body tail (5 times the head bound) and the GET's first bytes: one segment.
        w.write(body[-10_000:] + HEALTH[:20])
        await asyncio.wait_for(worker.got.wait(), WAIT_S)  # the whole body was read
        await until(lambda: conn._waiting, WAIT_S, "the GET's head begun")
        w.write(HEALTH[20:])
        await until(lambda: len(conn.pipeline) == 1, WAIT_S, "the GET queued")
        worker.release.set()
        got = await _read_responses(r, 2)
        w.close()
        assert [head.split(b"\r\n", 1)[0] for head, _ in got] == [b"HTTP/1.1 200 OK"] * 2
        assert b"pipelined" in got[0][1]
        assert g.server.guard.head_too_large == 0  # type: ignore[union-attr]
