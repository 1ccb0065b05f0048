"""How the relay's byte scan (`RelayResponse._feed`) frames a worker's SSE stream when the worker
frames it oddly: an event that never ends, and [DONE] with more after it in the same read.

Each of these used to go wrong (review 3):
* a worker that never ends an event (lines without the blank line, or CRLF framing, which the
  scan does not take for a boundary) grew the relay's pending event without bound, re-copying
  all of it on every read (quadratic), while its client got nothing until idle_s or total_s;
* [DONE] was found only when it ended a read: `data: [DONE]\\n\\n: keep-alive\\n\\n` in one
  read sent the client the worker's [DONE], the comment, then (at the body's end) an
  upstream_broken error event and a second [DONE], and the call was recorded upstream_broken.

What must hold: the relay holds at most EVENT_MAX bytes of one unfinished event, past which the
stream ends with the in-band upstream error and the worker's connection is let go; [DONE] at an
event's start ends the stream wherever it sits in a read; and the scan stays byte-exact however
the worker's reads cut the events. Workers are raw sockets (`tests.support.raw_worker`); only
127.0.0.1. Bounds in time are generous (a failure waits them out, a pass never comes near them),
and the worker of the oversized event sends a bounded amount (16 MiB), so that a relay without
the cap fails the test instead of eating the host's memory.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from gateway import relay
from gateway.call import Call
from gateway.config import TimeoutSettings
from gateway.errors import sse_error_event
from gateway.lifecycle import Lifecycle
from gateway.relay import RelayResponse
from gateway.upstream import UpstreamStreamError
from tests.faults.conftest import http_request, parse_response
from tests.faults.test_clients import connect, recv, send
from tests.gateway.conftest import (
    MODEL,
    SCRIPTED_EVENTS,
    run_gateway,
    scripted_fragments,
    settings_for,
    until,
)
from tests.gateway.test_upstream_h1 import SSE_HEAD, sse_chunks
from tests.support.raw_worker import raw_worker

SETTLED_WITHIN_S = 30.0  # generous: what must happen within a second or two
CAP = 1 << 20  # EVENT_MAX in these tests: the mechanism, without 64 MiB per case
WORKER_SENDS = 16 << 20  # the most the oversized event's worker sends: 16 times the cap
DONE = b"data: [DONE]\n\n"
BROKEN = relay._STREAM_ERRORS["upstream_broken"]


def chunk_event(content: str) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": None}
    body = {"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


USAGE = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"sim-llama","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n'
)


def request() -> bytes:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    return http_request("/v1/chat/completions", body, headers={"content-type": "application/json"})


async def whole_reply(url: str) -> Any:
    """One streaming request on a raw socket, read to the response's terminating chunk."""
    sock = await connect(int(url.rsplit(":", 1)[1]))
    try:
        await send(sock, request())
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = await recv(sock, 1 << 16, timeout=SETTLED_WITHIN_S)
            assert chunk, f"connection closed early: {data[-300:]!r}"
            data += chunk
        return parse_response(data)
    finally:
        sock.close()


def record_outcomes(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The outcome each finished call was settled (logged, charged) under."""
    settled: list[str | None] = []
    real = Lifecycle.finish

    async def finish(self: Lifecycle, call: Call) -> None:
        if not call.finished:
            settled.append(call.outcome)
        await real(self, call)

    monkeypatch.setattr(Lifecycle, "finish", finish)
    return settled


def bare_relay(wants_usage: bool = True) -> Any:
    """A relay for its byte scan alone (nothing it would send to is there)."""
    call = SimpleNamespace(
        client_wants_usage=wants_usage,
        client_wants_live_usage=False,
        events=0,
        usage=None,
        live_usage=b"",
        live_usage_upstream=False,
        account=None,
    )
    return RelayResponse(None, call, None, None, (None, b""), {}, TimeoutSettings(), 0.0)  # type: ignore[arg-type]


def held(r: Any) -> int:
    """Bytes the relay holds of an unfinished event (a bytes object before the fix)."""
    p = r._pending
    return len(p) if isinstance(p, bytes) else sum(map(len, p))


# -- an event that never ends ----------------------------------------------------------------------
LINES = b"data: " + b"x" * (64 * 1024 - 7) + b"\n"  # one line, never a blank one
MULTI = b"data: hi\n" * 8000  # a many-line event, CRLF or not, whose blank line never comes


@pytest.mark.parametrize("client", ["h1", "aiohttp"])  # the spliced relay, and the generic one
@pytest.mark.parametrize(
    "piece", [LINES, MULTI, MULTI.replace(b"\n", b"\r\n")], ids=["line", "lines", "crlf"]
)
async def test_an_event_that_never_ends_is_cut_off_at_event_max(
    monkeypatch: pytest.MonkeyPatch, client: str, piece: bytes
) -> None:
    """Before the fix the relay held all 16 MiB the worker sent (re-copied on every read), the
    client got nothing, and the stream ended only once the worker fell silent, with idle_s's
    error (504). Now the relay holds at most EVENT_MAX of the event, then ends the stream with
    the upstream error (502, none of the event's bytes sent) and lets the worker's connection
    go; the worker is never silent here, so no timer can end the stream instead."""
    monkeypatch.setattr(relay, "EVENT_MAX", CAP, raising=False)
    peak = 0
    real_feed = RelayResponse._feed

    def feed(self: RelayResponse, chunk: bytes) -> None:
        nonlocal peak
        try:
            real_feed(self, chunk)
        finally:
            peak = max(peak, held(self))

    monkeypatch.setattr(RelayResponse, "_feed", feed)
    settled = record_outcomes(monkeypatch)
    let_go = asyncio.Event()

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            w.write(SSE_HEAD)
            sent = 0
            while sent < WORKER_SENDS:
                w.write(sse_chunks([piece]))
                await w.drain()
                sent += len(piece)
            await r.read()  # then silent, until the gateway closes the connection
        finally:
            let_go.set()

    async with raw_worker(script) as (url, _):
        s = settings_for([url], timeouts={"idle_s": 2, "total_s": 60}, upstream={"client": client})
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            resp = await whole_reply(g.url)
            await asyncio.wait_for(let_go.wait(), SETTLED_WITHIN_S)
            await until(lambda: bool(settled), SETTLED_WITHIN_S, "the call is settled")
    assert resp.status == 200
    assert resp.body == sse_error_event(BROKEN, "upstream_error", 502), resp.body[:300]
    assert settled == ["upstream_broken"]
    assert peak <= CAP, f"the relay held {peak / 2**20:.1f} MiB of one unfinished event"


def test_an_event_over_event_max_ends_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan's side of the cap: the event's bytes are dropped at once (not held until the
    task fails the stream) and nothing the worker sends after it is taken for an event (the
    spliced relay's sink is fed until its task wakes)."""
    monkeypatch.setattr(relay, "EVENT_MAX", 1000, raising=False)
    r = bare_relay()
    r._feed(b"data: first\n\n" + b"data: " + b"y" * 500)
    with pytest.raises(UpstreamStreamError, match="over 1000 bytes"):
        r._feed(b"y" * 600)
    assert held(r) == 0
    r._feed(b"y\n\ndata: later\n\n")
    r._feed(DONE)
    assert r._out == [b"data: first\n\n"]
    assert not r._done


def test_a_straddling_blank_line_ends_the_event_and_resets_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the new read is searched for the blank line (the pending pieces hold none), plus the
    byte before it: "\\n" + "\\n..." ends the event. The size counted against EVENT_MAX is that
    of the event now pending, not of all the bytes seen."""
    monkeypatch.setattr(relay, "EVENT_MAX", 100, raising=False)
    r = bare_relay()
    for part in [b"data: a", b"\n", b"\ndata: b\n", b"\n"]:
        r._feed(part)
    assert r._out == [b"data: a\n\n", b"data: b\n\n"]
    assert held(r) == 0
    for _ in range(20):  # 20 events of 60 bytes, each cut in three: 1,200 bytes in all
        for part in [b"data: " + b"z" * 20, b"z" * 32 + b"\n", b"\n"]:
            r._feed(part)
    assert len(r._out) == 22 and held(r) == 0


# -- the scan stays byte-exact ---------------------------------------------------------------------
def test_events_cut_at_any_byte_come_out_whole_and_in_order() -> None:
    """Every way of cutting a stream in two, byte by byte, and the scripted fragments: the
    client gets exactly the worker's events, [DONE] is seen, and the usage chunk is parsed."""
    data = b"".join(SCRIPTED_EVENTS)
    want = b"".join(SCRIPTED_EVENTS[:-1])
    cuts: list[list[bytes]] = [[data[:i], data[i:]] for i in range(1, len(data))]
    cuts += [[data[i : i + 1] for i in range(len(data))], scripted_fragments()]
    for reads in cuts:
        r = bare_relay()
        for read in reads:
            r._feed(read)
        assert b"".join(r._out) == want, [len(x) for x in reads]
        assert r._done and held(r) == 0
        assert r._call.events == len(SCRIPTED_EVENTS)
        assert r._call.usage is not None and r._call.usage.completion_tokens == 2


# -- [DONE] with more after it in the same read ---------------------------------------------------
AFTER_DONE = [b": keep-alive\n\n", b"\n\n", b": ping\n\n: ping\n\n", b": ping\n\n\n"]


@pytest.mark.parametrize("after", AFTER_DONE)
def test_done_is_found_wherever_it_sits_in_a_read(after: bytes) -> None:
    """[DONE] at an event's start ends the stream, and what follows it in the read is dropped
    (as later reads are): the client gets no second end, and no error."""
    r = bare_relay(wants_usage=False)
    r._feed(chunk_event("hello") + USAGE + DONE + after)
    assert r._done
    assert r._out == [chunk_event("hello")]  # the usage chunk stripped: not asked for
    assert r._call.usage is not None and r._call.events == 2  # chunk, [DONE]
    r._feed(chunk_event("late"))
    assert r._out == [chunk_event("hello")]


def test_done_inside_an_event_is_not_the_end() -> None:
    """Only [DONE] at an event's start is the end, not the text inside an event."""
    r = bare_relay()
    read = chunk_event("data: [DONE]") + b": keep-alive\n\n"
    r._feed(read)
    assert not r._done and r._out == [read]


@pytest.mark.parametrize("client", ["h1", "aiohttp"])
@pytest.mark.parametrize("after", AFTER_DONE[:2])
async def test_done_followed_by_more_in_the_same_read_ends_the_stream(
    monkeypatch: pytest.MonkeyPatch, client: str, after: bytes
) -> None:
    """Before the fix the client got the worker's [DONE], then what followed it, then an
    upstream_broken error event and a second [DONE], and the call was settled upstream_broken.
    Now it gets the answer and one [DONE], settled ok."""
    settled = record_outcomes(monkeypatch)

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + sse_chunks([chunk_event("hello"), USAGE + DONE + after]))
        w.write(b"0\r\n\r\n")
        await w.drain()
        await r.read()

    async with raw_worker(script) as (url, _):
        s = settings_for([url], upstream={"client": client})
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            resp = await whole_reply(g.url)
            await until(lambda: bool(settled), SETTLED_WITHIN_S, "the call is settled")
    assert resp.status == 200
    assert resp.body == chunk_event("hello") + DONE, resp.body
    assert settled == ["ok"]


# -- continuous usage (forced upstream): kept for a cut stream's charge, stripped unless asked ------
def _live_event(text: str, completion: int) -> bytes:
    return (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
        b'{"content":"' + text.encode() + b'"},"finish_reason":null}],"usage":{"prompt_tokens":3,'
        b'"total_tokens":%d,"completion_tokens":%d,"completion_tokens_details":null}}\n\n'
        % (3 + completion, completion)
    )


FINAL_USAGE = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,'
    b'"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
)


@pytest.mark.parametrize("wants", ["none", "final", "live"])
def test_live_usage_is_kept_and_stripped_unless_asked(wants: str) -> None:
    r = bare_relay(wants_usage=wants != "none")
    r._live = True  # the worker was asked for usage on every event
    r._strip_live = wants != "live"
    first, second = _live_event('a \\"usage\\":{', 1), _live_event("b", 2)
    r._feed(first[:50])
    r._feed(first[50:] + second[:-1])
    assert r._call.live_usage == b'{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1,' + (
        b'"completion_tokens_details":null}'
    )
    r._feed(second[-1:] + FINAL_USAGE + b"data: [DONE]\n\n")
    out = b"".join(r._out)
    assert r._done and r._call.usage is not None and r._call.usage.completion_tokens == 2
    assert b'completion_tokens":2,"completion_tokens_details' in r._call.live_usage
    assert out.count(b'"usage":{') == {"none": 0, "final": 1, "live": 3}[wants], out
    assert out.count(b"data: ") == (2 if wants == "none" else 3)
    assert b'a \\"usage\\":{' in out  # content that looks like the mark is the client's text
    assert orjson.loads(out.split(b"\n\n")[0][6:])["choices"][0]["delta"]["content"] == (
        'a "usage":{'
    )
