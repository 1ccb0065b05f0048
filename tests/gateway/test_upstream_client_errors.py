"""Every upstream client maps a failure before the response head to a connect error.

Review finding (medium): `AiohttpUpstream.post` let `aiohttp.ClientResponseError` (a malformed
head, a header line over aiohttp's 8190 bytes) escape, and `HttpxUpstream.post` let
`httpx.ReadError` (a worker that resets the connection once it has read the request) escape: the
walk's catch-all answered 500 `internal_error` with an ERROR traceback per request, the request
was not retried on the healthy worker, and the bad worker was never blamed. The default h1
client hands every https:// worker to aiohttp, so this was reachable by default. Now they are
`UpstreamConnectError`s, as the h1 client's are: retried elsewhere, the worker blamed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import httpx
import pytest

from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.support.raw_worker import raw_worker

OK = (
    b'{"id":"x","object":"chat.completion","model":"%b","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,'
    b'"completion_tokens":1,"total_tokens":4}}' % MODEL.encode()
)


def bad(kind: str):  # type: ignore[no-untyped-def]
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if kind == "reset":  # RST once the request is read (SO_LINGER 0)
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
            return
        if kind == "garbage":
            w.write(b"HTTP/1.1 200 OK\r\nthis is not a header line\r\ncontent-length: 2\r\n\r\n{}")
        else:  # one 16 KiB header line: over aiohttp's max_field_size
            w.write(
                b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 16384 + b"\r\ncontent-length: 2\r\n\r\n{}"
            )
        await w.drain()
        await r.read()  # until the gateway closes

    return script


async def good(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
        % (len(OK), OK)
    )
    await w.drain()


@pytest.mark.parametrize(
    ("client", "kind"),
    [
        ("aiohttp", "garbage"),
        ("aiohttp", "bigheader"),
        ("aiohttp", "reset"),
        ("httpx", "garbage"),
        ("httpx", "reset"),
        ("h1", "garbage"),
        ("h1", "reset"),
    ],
)
async def test_a_malformed_or_reset_answer_is_retried_on_another_worker(
    client: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        raw_worker(bad(kind)) as (bad_url, bad_posts),
        raw_worker(good) as (good_url, _good_posts),
    ):
        s = settings_for(
            [bad_url, good_url],
            upstream={"client": client},
            routing={"policy": "round_robin"},
            probes={"interval_s": 60},  # only requests judge the workers
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(2)
            caplog.set_level(logging.WARNING, logger="kvgate")
            statuses = []
            for _ in range(4):
                r = await c.post(
                    g.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                )
                statuses.append((r.status_code, r.content[:120]))
            assert bad_posts, "round robin sent nothing to the bad worker"
    assert statuses == [(200, OK[:120])] * 4, statuses
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    blamed = [
        r.getMessage() for r in caplog.records if "w0 failed before first byte" in r.getMessage()
    ]
    assert blamed and "connect:" in blamed[0], blamed
