"""A stream retried after a worker's first-byte timeout costs what any request costs.

Review line: "a first-byte-timeout retry refunds rpm". The rule (config.example.toml
[timeouts]/[retries], gateway/settlement.py): a request some worker answers is counted once
against rpm and charged its reported tokens once, whatever attempts came before; a request no
worker answered (every attempt timed out) is refunded whole, the request and its tokens.

Each test drives the real gateway (stub vLLM workers on real sockets, the production server)
and reads what the tenant has left in the quota store, on the memory backend and on a real
redis-server. The limits barely refill while a test runs (1 request and 1 token a minute, with
bursts to spend from), so what the store holds is what was charged, to the unit.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from bench.redis_server import RedisServer
from gateway.app import Gateway
from gateway.config import Settings
from tests.gateway.accounting_stubs import DONE, ROLE, RecordedSink, content, usage_chunk
from tests.gateway.conftest import (
    MODEL,
    RunningGateway,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
    until,
)

KEY = "kvg-retry-rpm"
HEADERS = {"authorization": f"Bearer {KEY}"}
PROMPT, COMPLETION = 5, 3  # the usage the answering worker reports
RPM_BURST, TPM_BURST = 10, 10_000
RETRIES = 'kvgate_retries_total{reason="upstream_timeout"}'


@pytest.fixture(params=["memory", "redis"])
def quota(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The `[quota]` section: in memory, or on the real redis-server with a prefix per test."""
    if request.param == "memory":
        return {"backend": "memory"}
    srv: RedisServer = request.getfixturevalue("redis")  # tests/gateway/conftest.py
    name = "".join(ch if ch.isalnum() else "-" for ch in request.node.name)
    return {"backend": "redis", "redis_url": srv.url, "key_prefix": f"{name}:"}


def _worker(release: asyncio.Event, stalled: list[str], head_first: bool, stall: int) -> Any:
    """A vLLM stand-in streaming an answer and its usage, except to the first ``stall``
    attempts whose prompt is "stall": those get nothing until ``release`` (with ``head_first``,
    their response head and then nothing). The workers share ``stalled`` (the x-request-id of
    each stalled attempt), so the count is over the whole fleet."""

    async def answer() -> AsyncIterator[bytes]:
        for e in (ROLE, content("ok"), content("!", "stop"), usage_chunk(PROMPT, COMPLETION), DONE):
            yield e

    async def silent() -> AsyncIterator[bytes]:
        await release.wait()
        yield DONE

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if body["messages"][0]["content"] == "stall" and len(stalled) < stall:
            stalled.append(request.headers.get("x-request-id", ""))
            if head_first:
                return StreamingResponse(silent(), media_type="text/event-stream")
            await release.wait()
        return StreamingResponse(answer(), media_type="text/event-stream; charset=utf-8")

    return stub_app(chat)


def _settings(urls: list[str], quota: dict[str, Any]) -> Settings:
    base = settings_for(
        urls,
        quota=quota,
        timeouts={"first_byte_s": 0.5, "idle_s": 5, "total_s": 30},
        # The stalling worker stays in rotation: its timeouts alone must not eject it.
        probes={"interval_s": 0.2, "timeout_s": 1.0, "unhealthy_after": 1000},
        retries={"max_attempts": 2},
    )
    data = base.model_dump()
    data["tenants"] = {
        "t": {
            "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
            "rpm": 1,
            "burst_requests": RPM_BURST,
            "tpm": 1,
            "burst_tokens": TPM_BURST,
        }
    }
    return Settings(**data)


async def _remaining(gw: Gateway) -> tuple[int, int]:
    """(requests, tokens) the tenant has left in the shared store."""
    u = await gw.quota.shared.usage("t", gw.tenants.by_name["t"].limits)
    return u["requests"]["remaining"], u["tokens"]["remaining"]


async def _in_flight(gw: Gateway) -> int:
    return int((await gw.quota.shared.usage("t"))["in_flight"])


def _body(text: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "stream": True,
    }


async def _post(
    g: RunningGateway, c: httpx.AsyncClient, usage: RecordedSink, text: str
) -> tuple[httpx.Response, dict[str, Any]]:
    """One request, and its usage record once it is settled."""
    n = len(usage.records)
    r = await c.post(g.url + "/v1/chat/completions", json=_body(text), headers=HEADERS)
    await until(lambda: len(usage.records) > n, 10, "the request's usage record")
    return r, usage.records[-1]


@pytest.mark.parametrize("head_first", [False, True], ids=["no-head", "head-no-event"])
async def test_a_stream_served_after_a_first_byte_retry_is_charged_like_any_other(
    quota: dict[str, Any], head_first: bool
) -> None:
    release = asyncio.Event()
    stalled: list[str] = []
    app = _worker(release, stalled, head_first, stall=1)
    async with serve_app(app, force_exit=True) as u1, serve_app(app, force_exit=True) as u2:
        try:
            async with run_gateway(_settings([u1, u2], quota)) as g, httpx.AsyncClient() as c:
                await g.wait_healthy(2)
                usage = g.gw.settlement.usage = RecordedSink(g.gw.settlement.usage)
                assert await _remaining(g.gw) == (RPM_BURST, TPM_BURST)

                plain, rec = await _post(g, c, usage, "hi")
                assert plain.status_code == 200 and b"[DONE]" in plain.content
                assert rec["charged_tokens"] == PROMPT + COMPLETION
                after_plain = await _remaining(g.gw)
                # The baseline: one request, and the tokens the worker reported.
                assert after_plain == (RPM_BURST - 1, TPM_BURST - PROMPT - COMPLETION)

                retried, rec = await _post(g, c, usage, "stall")
                assert retried.status_code == 200 and b"[DONE]" in retried.content
                assert stalled == [retried.headers["x-request-id"]]  # its 1st attempt stalled
                assert (await g.metrics()).get(RETRIES) == 1
                assert rec["status"] == 200 and rec["charged_tokens"] == PROMPT + COMPLETION
                after_retried = await _remaining(g.gw)
                # What the plain request cost, again: one request (not refunded, not two) and
                # the reported tokens once.
                assert after_retried == (
                    after_plain[0] - 1,
                    after_plain[1] - PROMPT - COMPLETION,
                ), (after_plain, after_retried)
                assert await _in_flight(g.gw) == 0
        finally:
            release.set()


async def test_a_stream_every_worker_timed_out_is_refunded_whole(quota: dict[str, Any]) -> None:
    release = asyncio.Event()
    stalled: list[str] = []
    app = _worker(release, stalled, head_first=False, stall=2)
    async with serve_app(app, force_exit=True) as u1, serve_app(app, force_exit=True) as u2:
        try:
            async with run_gateway(_settings([u1, u2], quota)) as g, httpx.AsyncClient() as c:
                await g.wait_healthy(2)
                usage = g.gw.settlement.usage = RecordedSink(g.gw.settlement.usage)
                r = await c.post(
                    g.url + "/v1/chat/completions", json=_body("stall"), headers=HEADERS
                )
                assert r.status_code == 504, r.text
                assert r.json()["error"]["code"] == "upstream_timeout"
                assert len(stalled) == 2 and (await g.metrics()).get(RETRIES) == 1
                # No worker answered: the request and its reservation go back, the lease too.
                assert await _remaining(g.gw) == (RPM_BURST, TPM_BURST)
                assert await _in_flight(g.gw) == 0
                assert usage.records == []  # nothing served, nothing billed

                # And the next request is charged as usual.
                ok, rec = await _post(g, c, usage, "hi")
                assert ok.status_code == 200 and rec["charged_tokens"] == PROMPT + COMPLETION
                assert await _remaining(g.gw) == (RPM_BURST - 1, TPM_BURST - PROMPT - COMPLETION)
        finally:
            release.set()
