"""A client that leaves while reading is paused ends its requests (gateway/server.py).

uvicorn pauses reading once a request holds more than 64 KiB of body that nobody reads: a
pipelined request queued behind a long completion, whose turn comes after that answer. The
client's FIN then sat unread in the kernel, and the running completion worked on to its end for
nobody, its worker slot and tenant lease held. Now, while reading is paused, the server reads the
socket's TCP state (`PAUSED_CHECK_S`) and a client that closed ends the requests.

Raw sockets on 127.0.0.1, on asyncio and on uvloop; waits are polled or bounded, never timed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson

from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.gateway.test_pipelining import RUNNERS, WAIT_S, HeldWorker, Runner, _chat, _conn
from tests.support.raw_worker import raw_worker


def _chat_with_body(pad: int) -> bytes:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    body = body[:-1] + b" " * pad + b"}"  # valid JSON
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )


@RUNNERS
def test_a_client_leaving_with_a_big_queued_body_aborts_the_running_request(
    runner: Runner,
) -> None:
    """The review's shape: a held completion, a second one with a 200 kB body pipelined behind
    it (reading pauses past 64 KiB of it), then the client closes. The running completion's
    upstream call is aborted and the connection freed while the worker still holds the call."""
    runner(_a_client_leaving_with_a_big_queued_body_aborts_the_running_request())


@contextlib.asynccontextmanager
async def _paused() -> AsyncIterator[tuple[HeldWorker, Any, Any, asyncio.StreamReader, Any]]:
    """A gateway over a held worker, and a client whose completion runs there with a second one,
    of a 200 kB body, pipelined behind it: reading paused on the queued body. Yields (worker,
    gateway, the client's connection in the server, reader, writer)."""
    worker = HeldWorker()
    async with (
        raw_worker(worker.script) as (url, _posts),
        run_gateway(settings_for([url])) as g,
    ):
        await g.wait_healthy(1)
        port = int(g.url.rsplit(":", 1)[1])
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_chat())
        await asyncio.wait_for(worker.got.wait(), WAIT_S)
        conn = _conn(g)
        w.write(_chat_with_body(200_000))
        await until(lambda: conn.flow.read_paused, WAIT_S, "reading paused on the queued body")
        yield worker, g, conn, r, w


async def _a_client_leaving_with_a_big_queued_body_aborts_the_running_request() -> None:
    async with _paused() as (worker, g, conn, _r, w):
        assert len(conn.pipeline) == 1
        w.close()
        await asyncio.wait_for(worker.aborted.wait(), WAIT_S)
        await until(
            lambda: g.server.guard.open == 0 and not g.server.server_state.connections,  # type: ignore[union-attr]
            WAIT_S,
            "connection freed",
        )
        assert len(conn.pipeline) == 0
        assert worker.answered == 0
        assert not g.gw.life.streams


@RUNNERS
def test_a_big_queued_body_is_served_after_the_running_request(runner: Runner) -> None:
    """The same pipeline with the client staying: the pause holds until the running answer is
    out, then the queued request is read and answered (the check does not end a live one)."""
    runner(_a_big_queued_body_is_served_after_the_running_request())


async def _a_big_queued_body_is_served_after_the_running_request() -> None:
    async with _paused() as (worker, g, conn, r, w):
        # A check of the paused socket runs (and re-arms) before the answer: the client is there.
        first = conn._paused_timer
        assert first is not None
        await until(lambda: conn._paused_timer is not first, WAIT_S, "a check of the socket")
        assert conn._paused_timer is not None and conn.flow.read_paused
        assert g.server.guard.open == 1  # type: ignore[union-attr]
        worker.release.set()
        out = b""
        while out.count(b"HTTP/1.1 200 OK") < 2:
            chunk = await asyncio.wait_for(r.read(65536), WAIT_S)
            assert chunk, out
            out += chunk
        w.close()
        assert worker.answered == 2
