"""What the overhead bench counts as a success (bench.sse_client byte mode underneath).

vLLM reports a failure inside a started stream as `data: {"error": ...}` and still ends the
stream with `data: [DONE]`; a stream cut short has no [DONE]. Neither is a success: the classic
`drive` and the ladder's `closed_loop` count both as errors, with no latency sample, and the
classic `drive` does not count its warm-up's errors among the measured requests.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from bench import overhead
from bench.overhead import Shot, closed_loop
from tests.support.aiohttp_app import serve_aiohttp

ROLE = (
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
TOKEN = (
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" a"},"logprobs":null,"finish_reason":null}]}\n\n'
)
FINISH = (
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" b"},"logprobs":null,"finish_reason":"length",'
    b'"stop_reason":null}]}\n\n'
)
# vLLM's in-stream error (an engine failure after the stream started), then [DONE] as vLLM does.
ERROR = (
    b'data: {"error":{"message":"engine died","type":"InternalServerError","param":null,'
    b'"code":500}}\n\n'
)
DONE = b"data: [DONE]\n\n"

TAILS = {"ok": FINISH + DONE, "err": ERROR + DONE, "trunc": b""}


@contextlib.asynccontextmanager
async def _server(mode: str, fail_first: int = 0) -> AsyncIterator[str]:
    """`/v1/chat/completions` streams role + token + the `mode`'s tail (`TAILS`); `fail` answers
    500 to everything, and the first `fail_first` requests get a 500 in any mode."""
    seen = 0

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal seen
        seen += 1
        await request.read()
        if mode == "fail" or seen <= fail_first:
            return web.json_response(
                {"error": {"message": "no", "type": "InternalServerError", "code": 500}},
                status=500,
            )
        r = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await r.prepare(request)
        await r.write(ROLE + TOKEN)
        await r.write(TAILS[mode])
        await r.write_eof()
        return r

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serve_aiohttp(app) as url:
        yield url


# -- the classic drive -----------------------------------------------------------------------


async def test_drive_counts_complete_streams_as_successes() -> None:
    async with _server("ok") as url:
        st = await overhead.drive(url, n=5, concurrency=2, max_tokens=2)
    assert st.errors == 0 and len(st.e2e) == 5 and len(st.ttft) == 5
    assert st.events == 5 * 4  # role, token, finish, [DONE]


async def test_drive_counts_an_error_event_before_done_as_an_error() -> None:
    async with _server("err") as url:
        st = await overhead.drive(url, n=5, concurrency=2, max_tokens=2)
    assert st.errors == 5
    assert st.e2e == [] and st.ttft == []  # no latency sample from a failed stream


async def test_drive_counts_a_stream_without_done_as_an_error() -> None:
    async with _server("trunc") as url:
        st = await overhead.drive(url, n=5, concurrency=2, max_tokens=2)
    assert st.errors == 5 and st.e2e == [] and st.ttft == []


async def test_drive_does_not_count_the_warm_ups_errors() -> None:
    # Every request fails: the 16 warm-up requests are not among the 5 measured.
    async with _server("fail") as url:
        st = await overhead.drive(url, n=5, concurrency=16, max_tokens=2)
    assert st.errors == 5 and st.e2e == [] and st.ttft == []
    # Only the warm-up fails: the measured requests are clean.
    async with _server("ok", fail_first=16) as url:
        st = await overhead.drive(url, n=5, concurrency=16, max_tokens=2)
    assert st.errors == 0 and len(st.e2e) == 5 and len(st.ttft) == 5


# -- the ladder's closed loop ----------------------------------------------------------------


def _shot(url: str) -> Shot:
    return Shot(url=url, concurrency=2, warmup_s=0.1, seconds=0.3, tag="t", seed=0, drain_s=5)


async def test_closed_loop_counts_an_error_event_as_a_stream_error() -> None:
    async with _server("err") as url:
        s = await closed_loop(_shot(url))
    assert s.completed == 0 and s.e2e == [] and s.ttfb == []
    assert s.errors > 0 and s.error_kinds == {"stream_error": s.errors}


async def test_closed_loop_still_completes_clean_streams() -> None:
    async with _server("ok") as url:
        s = await closed_loop(_shot(url))
    assert s.errors == 0 and s.completed > 0 and len(s.e2e) >= s.completed
