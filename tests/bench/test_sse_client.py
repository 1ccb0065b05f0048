"""bench.sse_client, the bench tools' one streaming client, against a scripted SSE server on
127.0.0.1: byte-mode TTFB, parse-mode TTFT/ITL/usage, error events, refusals, empty streams,
the TTFT and stream timeouts, cancellation, and the raw HTTP/1.1 variant."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from bench.peers import free_ports
from bench.replay import ReplayOptions, RequestRecord, _one
from bench.sse_client import StreamResult, stream, stream_http1
from bench.traces import TraceRequest
from tests.support.aiohttp_app import serve_aiohttp


def _ev(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _tok(text: str) -> bytes:
    return _ev({"choices": [{"index": 0, "text": text}]})


USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 3,
    "prompt_tokens_details": {"cached_tokens": 8},
}
DONE = b"data: [DONE]\n\n"
PAUSE = 0.02  # between the events of `tokens`, so each arrives in its own read

# What each path streams after a 200 (a float: pause that long; None: wait until the test ends).
SCRIPTS: dict[str, list[bytes | float | None]] = {
    "tokens": [
        b": keep-alive\n\n",
        _ev({"choices": []}),  # no choices: not a token
        PAUSE,
        _tok("a"),
        PAUSE,
        _tok("b"),
        PAUSE,
        _tok("c"),
        _ev({"choices": [], "usage": USAGE}),
        DONE,
    ],
    "no_usage": [_tok("a"), _tok("b"), DONE],
    "error_event": [_tok("a"), _ev({"error": {"message": "boom", "code": 500}}), DONE],
    "bad_payload": [b"data: {not json\n\n", DONE],
    "no_token": [_ev({"choices": [], "usage": {**USAGE, "completion_tokens": 0}}), DONE],
    "cut": [_tok("a")],
    "stall_first": [None],
    "stall_after_token": [_tok("a"), None],
}


@pytest.fixture
async def server() -> AsyncIterator[str]:
    """The base URL; `/<script>` streams a script, `/refuse` answers 503 with an error body,
    and `/<script>/v1/completions` is the same for bench.replay."""
    release = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        await request.read()
        if name == "refuse":
            return web.json_response(
                {"error": {"message": "busy", "type": "overloaded", "param": None, "code": "x"}},
                status=503,
                headers={"retry-after": "2", "x-kvgate-worker": "w1"},
            )
        r = web.StreamResponse(
            headers={"content-type": "text/event-stream", "x-kvgate-worker": "w1"}
        )
        await r.prepare(request)
        with contextlib.suppress(ConnectionError):
            for step in SCRIPTS[name]:
                if step is None:
                    await release.wait()
                    return r
                if isinstance(step, float):
                    await asyncio.sleep(step)
                else:
                    await r.write(step)
        return r

    app = web.Application()
    app.router.add_post("/{name}", handle)
    app.router.add_post("/{name}/v1/completions", handle)
    try:
        async with serve_aiohttp(app) as url:
            yield url
    finally:
        release.set()


async def _get(url: str, *, parse: bool, **kw: object) -> StreamResult:
    async with aiohttp.ClientSession() as session:
        return await stream(session, url, b"{}", {}, parse=parse, **kw)  # type: ignore[arg-type]


# -- byte mode ---------------------------------------------------------------------------------


async def test_byte_mode_times_the_first_bytes_and_counts_events(server: str) -> None:
    res = await _get(server + "/tokens", parse=False)
    assert res.status == 200 and res.error is None and res.worker == "w1"
    assert res.ttfb is not None and res.ttfb > 0
    assert res.ttft == res.ttfb  # byte mode: TTFT is TTFB, nothing is parsed
    assert res.e2e is not None and res.e2e >= res.ttfb
    assert res.events == 7 and res.done and not res.stream_error
    assert res.itl == [] and res.chunks == 0 and res.output_tokens is None


async def test_byte_mode_flags_an_error_event_and_a_missing_done(server: str) -> None:
    err = await _get(server + "/error_event", parse=False)
    assert err.stream_error and err.error is None  # the tool decides what it means
    cut = await _get(server + "/cut", parse=False)
    assert cut.ttfb is not None and not cut.done and not cut.stream_error


# -- parse mode --------------------------------------------------------------------------------


async def test_parse_mode_ttft_is_the_first_event_with_choices(server: str) -> None:
    res = await _get(server + "/tokens", parse=True)
    assert res.status == 200 and res.error is None and res.worker == "w1"
    assert res.ttfb is not None and res.ttft is not None
    assert res.ttft > res.ttfb  # the keep-alive and the choices-less event came first
    assert res.chunks == 3 and len(res.itl) == 2 and all(g > 0 for g in res.itl)
    assert res.e2e is not None and res.e2e >= res.ttft + sum(res.itl)
    assert (res.prompt_tokens, res.output_tokens, res.cached_tokens) == (10, 3, 8)


async def test_parse_mode_without_usage_leaves_the_tokens_unknown(server: str) -> None:
    res = await _get(server + "/no_usage", parse=True)
    assert res.error is None and res.chunks == 2 and len(res.itl) == 1
    assert res.prompt_tokens is None and res.output_tokens is None and res.cached_tokens is None


async def test_parse_mode_reports_an_error_event(server: str) -> None:
    res = await _get(server + "/error_event", parse=True)
    assert res.status == 200 and res.error is not None and "boom" in res.error
    assert res.ttft is not None and res.e2e is None  # stopped there, not read to the end


async def test_parse_mode_reports_a_bad_payload(server: str) -> None:
    res = await _get(server + "/bad_payload", parse=True)
    assert res.error is not None and res.error.startswith("bad SSE payload")


async def test_a_stream_without_a_token_is_an_error_in_parse_mode_only(server: str) -> None:
    res = await _get(server + "/no_token", parse=True)
    assert res.error == "stream ended without a token" and res.ttft is None
    assert res.e2e is not None and res.cached_tokens == 8 and res.output_tokens == 0
    raw = await _get(server + "/no_token", parse=False)
    assert raw.error is None and raw.done and raw.ttft == raw.ttfb


# -- refusals, timeouts, cancellation ----------------------------------------------------------


@pytest.mark.parametrize("parse", [True, False])
async def test_a_refusal_keeps_its_status_headers_and_body(server: str, parse: bool) -> None:
    res = await _get(server + "/refuse", parse=parse)
    assert res.status == 503 and res.error == "HTTP 503"
    assert res.headers is not None and res.headers["retry-after"] == "2" and res.worker == "w1"
    assert orjson.loads(res.body)["error"]["message"] == "busy" and '"busy"' in res.text
    assert res.ttfb is None and res.ttft is None and res.e2e is not None


async def test_the_ttft_timeout_and_the_stream_timeout(server: str) -> None:
    # The first bound covers the response head too (asserted to be in: status 200), so it is
    # generous; the stall itself is forever.
    first = await _get(server + "/stall_first", parse=False, ttft_timeout=2.0)
    assert isinstance(first.exc, TimeoutError) and first.ttft is None and first.status == 200
    later = await _get(
        server + "/stall_after_token", parse=False, ttft_timeout=30.0, stream_timeout=0.05
    )
    assert isinstance(later.exc, TimeoutError) and later.ttft is not None
    parsed = await _get(
        server + "/stall_after_token", parse=True, ttft_timeout=30.0, stream_timeout=0.05
    )
    assert isinstance(parsed.exc, TimeoutError) and parsed.chunks == 1


async def test_a_connection_error_is_reported_and_others_can_propagate() -> None:
    url = f"http://127.0.0.1:{free_ports(1)}/x"  # nothing listens
    res = await _get(url, parse=True)
    assert res.status == 0 and isinstance(res.exc, aiohttp.ClientError)
    assert res.error is not None and res.error.startswith(type(res.exc).__name__ + ": ")
    with pytest.raises(aiohttp.ClientError):
        await _get(url, parse=False, catch=(TimeoutError,))


async def test_cancellation_propagates_with_what_was_measured(server: str) -> None:
    res = StreamResult()
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(
            stream(session, server + "/stall_after_token", b"{}", {}, parse=True, result=res)
        )
        for _ in range(2000):  # until the token is in (the server then waits for the end)
            if res.ttft is not None:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert res.status == 200 and res.chunks == 1 and res.e2e is None and res.error is None


async def test_replay_records_a_cancelled_request_and_reraises(server: str) -> None:
    """bench.replay's adapter: the duration/drain bound cancels; the record says so."""
    req = TraceRequest(0.0, "r1", input_length=4, output_length=2, block_size=4, block_ids=[0])
    rec = RequestRecord("r1", 0.0, url=server + "/stall_after_token")
    opts = ReplayOptions(url=server)
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(_one(session, req, rec, opts, 0.0))
        await asyncio.sleep(0.05)  # sequencing only: whatever it got by then, it is cut
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert rec.error == "cancelled (duration/drain bound)" and not rec.ok and rec.e2e is None
    assert rec.sent_s is not None


# -- raw HTTP/1.1 ------------------------------------------------------------------------------


def _raw(port: int, path: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    ).encode()


async def test_raw_http1_times_the_stream_and_keeps_the_connection(server: str) -> None:
    port = int(server.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(2):  # the same keep-alive connection twice
            res = await stream_http1(reader, writer, _raw(port, "/tokens"))
            assert res.status == 200 and res.error is None
            assert res.ttft is not None and res.ttft == res.ttfb
            assert res.e2e is not None and res.e2e >= res.ttft
        refused = await stream_http1(reader, writer, _raw(port, "/refuse"))
        assert refused.status == 503 and refused.error == "HTTP 503"
    finally:
        writer.close()
