"""A worker's redirect is neither followed nor relayed.

Review finding (medium): the aiohttp client followed a worker's redirects (aiohttp's default
`allow_redirects=True`), re-sending the tenant's request body to wherever `Location` pointed, any
host; the default h1 client hands every https:// worker to aiohttp. The h1 and httpx clients
relayed the 3xx to the client as a bare, bodiless answer to its POST. Now a 3xx is the worker's
failure: retried on another worker, and with none left an OpenAI-shaped 502. A worker's 4xx
(vLLM's 400s) still reaches the client as it was sent.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.support.raw_worker import raw_worker, read_request, server

OK = (
    b'{"id":"x","object":"chat.completion","model":"%b","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,'
    b'"completion_tokens":1,"total_tokens":4}}' % MODEL.encode()
)
CLIENTS = ["h1", "aiohttp", "httpx"]


def answer(status: bytes, body: bytes, extra: bytes = b""):  # type: ignore[no-untyped-def]
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 "
            + status
            + b"\r\ncontent-type: application/json\r\n"
            + extra
            + b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        await w.drain()

    return script


def chat(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "secret"}], "stream": stream}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("client", CLIENTS)
async def test_a_redirect_is_not_followed_and_answers_a_502(client: str, stream: bool) -> None:
    elsewhere: list[bytes] = []

    async def other(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        line, body = await read_request(r)
        elsewhere.append(line + b" " + body)
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(OK), OK)
        )
        await w.drain()

    async with server(other) as (other_url, _accepted):
        location = f"location: {other_url}/elsewhere\r\n".encode()
        redirect = answer(b"307 Temporary Redirect", b"", location)
        async with raw_worker(redirect) as (url, posts):
            s = settings_for([url], upstream={"client": client})
            async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
                await g.wait_healthy(1)
                r = await c.post(g.url + "/v1/chat/completions", json=chat(stream))
                assert g.gw.registry.workers["w0"].in_flight == 0
    assert elsewhere == [], "the tenant's request went where the worker's redirect pointed"
    assert len(posts) == 1
    assert r.status_code == 502, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "upstream_error" and err["code"] == "upstream_redirect", err


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_redirecting_worker_is_passed_over_for_another(client: str) -> None:
    async with (
        raw_worker(answer(b"301 Moved Permanently", b"", b"location: /v2\r\n")) as (bad, posts),
        raw_worker(answer(b"200 OK", OK)) as (good, _good_posts),
    ):
        s = settings_for(
            [bad, good],
            upstream={"client": client},
            routing={"policy": "round_robin"},
            probes={"interval_s": 60},
        )
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(2)
            for _ in range(2):
                r = await c.post(g.url + "/v1/chat/completions", json=chat(False))
                assert r.status_code == 200 and r.content == OK, (r.status_code, r.text)
    assert posts, "round robin sent nothing to the redirecting worker"


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_workers_400_still_reaches_the_client_with_its_message(client: str) -> None:
    # An older vLLM's top-level error shape is passed on as the OpenAI envelope (what every
    # refusal is), its message, type and code kept (tests/gateway/test_upstream_answers.py).
    old = (
        b'{"object":"error","message":"This model\'s maximum context length is 8 tokens.",'
        b'"type":"BadRequestError","param":null,"code":400}'
    )
    err = (
        b'{"error":{"message":"This model\'s maximum context length is 8 tokens.",'
        b'"type":"BadRequestError","param":null,"code":400}}'
    )
    async with raw_worker(answer(b"400 Bad Request", old)) as (url, _posts):
        s = settings_for([url], upstream={"client": client})
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(1)
            for stream in (False, True):
                r = await c.post(g.url + "/v1/chat/completions", json=chat(stream))
                assert (r.status_code, r.content) == (400, err)
