"""A stream cut before `data: [DONE]` is a failed request in parse mode (bench.sse_client) and so
in bench.replay: not ok, no e2e, not in the latency distributions or the goodput, even when it
carried tokens (vLLM ends every stream it completes, failed ones included, with [DONE])."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import orjson
from aiohttp import web

from bench.metrics import SLO
from bench.replay import ReplayOptions, replay, summarize
from bench.sse_client import StreamResult, stream
from bench.traces import Trace, TraceRequest
from tests.support.aiohttp_app import serve_aiohttp


def _ev(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _tok(text: str, finish: str | None = None) -> bytes:
    return _ev({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


USAGE = _ev({"choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": 2}})
DONE = b"data: [DONE]\n\n"
BODIES = {
    "full": _tok(" a") + _tok(" b", "length") + USAGE + DONE,
    # role/first token, then the body ends cleanly: no finish_reason, no usage, no [DONE]
    "trunc": _tok(" a"),
    # everything but the [DONE]
    "no_done": _tok(" a") + _tok(" b", "length") + USAGE,
}


@contextlib.asynccontextmanager
async def _server() -> AsyncIterator[str]:
    """`/<name>/v1/completions` streams `BODIES[name]`."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        r = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await r.prepare(request)
        await r.write(BODIES[request.match_info["name"]])
        await r.write_eof()
        return r

    app = web.Application()
    app.router.add_post("/{name}/v1/completions", handle)
    async with serve_aiohttp(app) as url:
        yield url


async def _parse(url: str) -> StreamResult:
    async with aiohttp.ClientSession() as session:
        return await stream(session, url, b"{}", {}, parse=True)


async def test_parse_mode_reports_a_stream_ended_without_done() -> None:
    async with _server() as base:
        full = await _parse(base + "/full/v1/completions")
        trunc = await _parse(base + "/trunc/v1/completions")
        no_done = await _parse(base + "/no_done/v1/completions")
        raw = await _parse_bytes(base + "/trunc/v1/completions")
    assert full.error is None and full.e2e is not None and full.output_tokens == 2
    for res in (trunc, no_done):
        assert res.status == 200 and res.error == "stream ended without [DONE]"
        assert res.ttft is not None and res.e2e is None  # not read to its end
    # Byte mode parses nothing and leaves the verdict to its tool (`done`, `stream_error`).
    assert raw.error is None and not raw.done and raw.e2e is not None


async def _parse_bytes(url: str) -> StreamResult:
    async with aiohttp.ClientSession() as session:
        return await stream(session, url, b"{}", {}, parse=False)


def _trace(n: int) -> Trace:
    reqs = [TraceRequest(0.0, f"r{i}", 16, 2, 16, [i, i + 100]) for i in range(n)]
    return Trace(reqs, "synthetic", "test")


async def test_replay_counts_truncated_streams_as_failed() -> None:
    async with _server() as base:
        for name in ("trunc", "no_done"):
            opts = ReplayOptions(url=f"{base}/{name}", model="m")
            recs = await replay(_trace(4), opts)
            assert [r.ok for r in recs] == [False] * 4, name
            assert all(r.error == "stream ended without [DONE]" for r in recs), name
            assert all(r.e2e is None for r in recs), name
            res = summarize(recs, opts, SLO(), keep_records=False)
            assert res["completed"] == 0 and res["failed"] == 4, name
            assert res["request_goodput"] == 0, name
        opts = ReplayOptions(url=f"{base}/full", model="m")
        recs = await replay(_trace(4), opts)
    assert all(r.ok and r.error is None and r.e2e is not None for r in recs)
    res = summarize(recs, opts, SLO(), keep_records=False)
    assert res["completed"] == 4 and res["failed"] == 0
