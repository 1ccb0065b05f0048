"""A bug of the relay's own (an exception it does not handle, not an upstream error) answers like
a bug anywhere else on the completion path, as long as the client has no byte of the response
yet: the OpenAI-shaped 500 envelope (`internal_error`) with the request's ids, its traceback
logged once under that id, the quota reservation refunded and the `max_concurrent` lease freed.

Before the fix such a bug in the relay's scan of the worker's first chunk reached the client as
a dropped connection: with kvgate's own upstream client the relay holds the response head back to
go out with the first events, but uvicorn had rendered it and took the response for started, so
the edge (`FastPathApp._failed`) closed the connection with nothing sent ("Server disconnected
without sending a response"); with the generic relay (aiohttp) the head had gone out first, and
the client got a 200 and a chunked body cut off. The call was settled as a client that left
(charged its prompt), though the client never had anything. Past the first byte the response
cannot be answered again: the connection still closes on the bug.

Simulated and scripted workers and the gateway on 127.0.0.1; waits are bounded, never timed.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from gateway.config import Settings
from gateway.relay import RelayResponse
from tests.gateway.conftest import (
    MODEL,
    SCRIPTED_EVENTS,
    RunningGateway,
    keyed_settings,
    last_usage,
    run_gateway,
)
from tests.gateway.test_unhandled_error_ids import (
    _assert_internal_error,
    _in_flight,
    _tracebacks,
    uvicorn_logs,
)
from tests.gateway.test_upstream_h1 import SSE_HEAD, sse_chunks
from tests.support.raw_worker import raw_worker
from tests.support.sim_workers import run_sim_workers

KEY = "sk-relay-bug"
WAIT_S = 10.0
CLIENTS = ["h1", "aiohttp"]  # the spliced relay (head held back), and the generic one
DONE = b"data: [DONE]\n\n"


def _settings(url: str, usage_file: Path, client: str) -> Settings:
    """One worker, one tenant (`t`, `max_concurrent = 1`), the upstream ``client`` under test."""
    return keyed_settings(
        [url],
        KEY,
        usage_file,
        {"max_concurrent": 1},
        upstream={"client": client},
        logging={"level": "info"},
    )


def _request(cid: str) -> dict[str, object]:
    return {
        "json": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        },
        "headers": {"authorization": f"Bearer {KEY}", "x-request-id": cid},
    }


async def _served_whole(c: httpx.AsyncClient, g: RunningGateway) -> None:
    """The tenant's next stream (its one `max_concurrent` lease free again) is served whole."""
    r = await c.post(g.url + "/v1/chat/completions", **_request("after"))  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    assert r.content.endswith(DONE), r.content[-200:]


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_relay_bug_before_the_first_byte_answers_with_the_envelope(
    client: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """The relay's scan of the worker's first chunk (`RelayResponse._feed`) raises: the client
    gets the 500 envelope with its ids, not a dropped connection; the traceback is logged once,
    under that id, and not again by uvicorn; nothing is charged (the reservation is refunded
    whole) and the lease goes back, so the tenant's next stream is served, not a 429."""
    usage_file = tmp_path / "usage.jsonl"
    async with (
        run_sim_workers(1) as fleet,
        run_gateway(_settings(fleet[0], usage_file, client)) as g,
    ):
        await g.wait_healthy(1)
        async with httpx.AsyncClient(timeout=WAIT_S) as c:
            with monkeypatch.context() as mp, caplog.at_level(logging.INFO), uvicorn_logs(caplog):

                def feed(self: RelayResponse, chunk: bytes) -> None:
                    raise RuntimeError("a bug in the relay")

                mp.setattr(RelayResponse, "_feed", feed)
                try:
                    r = await c.post(g.url + "/v1/chat/completions", **_request("bug-relay"))  # type: ignore[arg-type]
                except httpx.TransportError as e:
                    pytest.fail(f"the client got no answer: {e!r}")
            ours = _assert_internal_error(r, "bug-relay")
            record = await last_usage(usage_file)
            m = await g.metrics()
            assert _in_flight(m) == 0, m
            assert g.gw.registry.workers["w0"].in_flight == 0
            await _served_whole(c, g)
    assert record["request_id"] == ours
    assert (record["status"], record["outcome"], record["charged_tokens"]) == (
        500,
        "internal_error",
        0,
    ), record
    refunded = m['kvgate_tenant_tokens_total{kind="refunded",tenant="t"}']
    assert refunded == m['kvgate_tenant_tokens_total{kind="reserved",tenant="t"}'] > 0, m
    assert m.get('kvgate_tenant_tokens_total{kind="settled",tenant="t"}', 0.0) == 0, m
    assert m[f'kvgate_requests_total{{model="{MODEL}",status="500",worker="w0"}}'] == 1, m
    (rec,) = _tracebacks(caplog)
    assert ours in rec.getMessage() and rec.fields["request_id"] == ours  # type: ignore[attr-defined]
    assert "a bug in the relay" in caplog.text
    assert not [x for x in caplog.records if x.name.startswith("uvicorn")], caplog.text


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_relay_bug_after_the_first_byte_still_closes_the_connection(
    client: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """Once the client has the head and an event, a bug (here in the settlement at [DONE]) can
    no longer be answered with a status: the connection closes, as before the fix; no second
    response is attempted, the traceback is logged once, and the lease still goes back."""
    first_out = asyncio.Event()  # the client has the stream's first event: the worker goes on

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + sse_chunks(SCRIPTED_EVENTS[:1]))
        await w.drain()
        await asyncio.wait_for(first_out.wait(), WAIT_S)
        w.write(sse_chunks(SCRIPTED_EVENTS[1:]) + b"0\r\n\r\n")
        await w.drain()

    async def broken_settle(self: RelayResponse) -> None:
        raise RuntimeError("a bug in the relay")

    usage_file = tmp_path / "usage.jsonl"
    async with raw_worker(script) as (url, _), run_gateway(_settings(url, usage_file, client)) as g:
        await g.wait_healthy(1)
        async with httpx.AsyncClient(timeout=WAIT_S) as c:
            got = b""
            with monkeypatch.context() as mp, caplog.at_level(logging.INFO), uvicorn_logs(caplog):
                mp.setattr(RelayResponse, "_settle_before_done", broken_settle)
                with pytest.raises(httpx.RemoteProtocolError):
                    url_ = g.url + "/v1/chat/completions"
                    async with c.stream("POST", url_, **_request("bug-late")) as r:  # type: ignore[arg-type]
                        assert r.status_code == 200
                        async for part in r.aiter_raw():
                            got += part
                            if got.endswith(SCRIPTED_EVENTS[0]):
                                first_out.set()
            assert got == SCRIPTED_EVENTS[0], got
            ours = r.headers["x-kvgate-request-id"]
            await last_usage(usage_file)  # settled
            m = await g.metrics()
            assert _in_flight(m) == 0, m
            assert g.gw.registry.workers["w0"].in_flight == 0
            await _served_whole(c, g)
    (rec,) = _tracebacks(caplog)
    assert ours in rec.getMessage() and rec.fields["request_id"] == ours  # type: ignore[attr-defined]
    assert not [x for x in caplog.records if x.name.startswith("uvicorn")], caplog.text
