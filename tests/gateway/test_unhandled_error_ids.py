"""A bug on the completion path answers like every other failure of the gateway: an OpenAI
envelope (`internal_error`) carrying the request's ids, its traceback logged once at ERROR under
that id, and whatever the request held (its quota reservation and concurrency lease, its worker
slot) given back.

The walk caught a bug in its own steps, but not one in its answer to a refusal (the refund, the
request line): that escaped to uvicorn, whose plain-text "Internal Server Error" carried neither
`x-kvgate-request-id` nor the client's `x-request-id`, whose traceback named no request, and a
refund that raised kept the tenant's reservation and `max_concurrent` lease until they expired.

Simulated workers and the gateway on 127.0.0.1; waits are bounded, never timed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.call import Call
from gateway.config import Settings
from gateway.quota_gate import Ticket
from tests.gateway.conftest import MODEL, RunningGateway, run_gateway, settings_for
from tests.support.sim_workers import run_sim_workers

KEY = "sk-unhandled-error"
OURS = re.compile(r"kvg-[0-9a-f]{12}-[0-9a-f]+")
WAIT_S = 10.0


@contextlib.contextmanager
def uvicorn_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """What uvicorn logs, into ``caplog`` too: the config uvicorn applies when a server starts
    (the simulated workers') stops its loggers short of the root one and drops their handlers,
    so this attaches once the servers run. A failure logged a second time by uvicorn ("Exception
    in ASGI application") is what these tests look for."""
    uv = logging.getLogger("uvicorn.error")
    uv.addHandler(caplog.handler)
    try:
        yield
    finally:
        uv.removeHandler(caplog.handler)


def _settings(urls: list[str], **sections: Any) -> Settings:
    d = settings_for(urls, logging={"level": "info"}, **sections).model_dump()
    d["tenants"] = {
        "t": {"keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "max_concurrent": 1}
    }
    return Settings(**d)


def _chat(**kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


async def _post(c: httpx.AsyncClient, g: RunningGateway, cid: str, **kw: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": cid}
    return await c.post(g.url + "/v1/chat/completions", json=_chat(**kw), headers=headers)


def _assert_internal_error(r: httpx.Response, cid: str) -> str:
    """The 500 envelope with one id of ours and the client's echoed; returns ours."""
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/json", r.headers
    err = r.json()["error"]
    assert err["type"] == "internal_error" and err["code"] == "internal_error", err
    assert err["message"]
    ours = r.headers.get_list("x-kvgate-request-id")
    assert len(ours) == 1 and OURS.fullmatch(ours[0]), r.headers
    assert r.headers.get_list("x-request-id") == [cid], r.headers
    return ours[0]


def _tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]


def _in_flight(m: dict[str, float]) -> float:
    return m.get('kvgate_tenant_in_flight{tenant="t"}', 0.0)


async def test_a_refund_that_raises_still_answers_with_the_ids_and_gives_back_the_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream its worker refused (HTTP 500): nothing was generated, so the walk refunds it;
    the refund raises. The client gets the envelope with its ids, the reservation and the
    `max_concurrent = 1` lease go back (the next request is served, not a 429)."""
    async with run_sim_workers(1) as fleet, run_gateway(_settings(list(fleet))) as g:
        await g.wait_healthy(1)
        faults = fleet.workers[0].faults
        refund = g.gw.settlement.refund

        async def broken_refund(call: Call | None, ticket: Ticket | None) -> None:
            raise RuntimeError("a bug in the refund")

        async with httpx.AsyncClient(timeout=WAIT_S) as c:
            faults.update({"error_rate": 1.0, "error_status": 500})
            g.gw.settlement.refund = broken_refund  # type: ignore[method-assign]
            with caplog.at_level(logging.INFO), uvicorn_logs(caplog):
                r = await _post(c, g, "bug-refund", stream=True)
            g.gw.settlement.refund = refund  # type: ignore[method-assign]
            faults.update({"error_rate": 0.0})
            ours = _assert_internal_error(r, "bug-refund")
            m = await g.metrics()
            assert _in_flight(m) == 0, m
            assert g.gw.registry.workers["w0"].in_flight == 0
            ok = await _post(c, g, "after-refund")
            assert ok.status_code == 200, ok.text
    # Logged once, under the id the client was given; not again by uvicorn.
    (rec,) = _tracebacks(caplog)
    assert ours in rec.getMessage() and rec.fields["request_id"] == ours  # type: ignore[attr-defined]
    assert "a bug in the refund" in caplog.text
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")], caplog.text


async def test_a_request_line_that_raises_on_a_refusal_answers_with_the_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request the walk refuses (an unknown model, a 404) whose request line raises: the
    client gets the envelope with its ids (not uvicorn's plain text), the bug's traceback is
    logged once however often the broken step is met while cleaning up, and the next request
    is served."""
    async with run_sim_workers(1) as fleet, run_gateway(_settings(list(fleet))) as g:
        await g.wait_healthy(1)

        def broken_rejected(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug in the request line")

        async with httpx.AsyncClient(timeout=WAIT_S) as c:
            g.gw.life.rejected = broken_rejected  # type: ignore[method-assign]
            with caplog.at_level(logging.INFO), uvicorn_logs(caplog):
                r = await _post(c, g, "bug-line", model="no-such-model")
            del g.gw.life.rejected  # the class's own again
            ours = _assert_internal_error(r, "bug-line")
            ok = await _post(c, g, "after-line")
            assert ok.status_code == 200, ok.text
    (rec,) = _tracebacks(caplog)
    assert ours in rec.getMessage() and rec.fields["request_id"] == ours  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")], caplog.text


async def test_a_bug_while_a_response_is_sent_answers_with_the_ids_it_carried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The walk returned its response and sending it failed before anything went out: the
    envelope goes out instead, under the ids that response carried, logged once under them."""
    async with run_sim_workers(1) as fleet, run_gateway(_settings(list(fleet))) as g:
        await g.wait_healthy(1)
        completions = g.gw.completions
        made: list[_Unsendable] = []

        async def unsendable(request: Any) -> _Unsendable:
            made.append(_Unsendable(await completions(request)))
            return made[-1]

        async with httpx.AsyncClient(timeout=WAIT_S) as c:
            g.gw.completions = unsendable  # type: ignore[method-assign]
            with caplog.at_level(logging.INFO), uvicorn_logs(caplog):
                r = await _post(c, g, "bug-send")
            del g.gw.completions  # the class's own again
            ours = _assert_internal_error(r, "bug-send")
            ok = await _post(c, g, "after-send")
            assert ok.status_code == 200, ok.text
    (resp,) = made
    assert resp.headers["x-kvgate-request-id"] == ours
    (rec,) = _tracebacks(caplog)
    assert ours in rec.getMessage() and rec.fields["request_id"] == ours  # type: ignore[attr-defined]
    assert "a bug while sending" in caplog.text
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")], caplog.text


class _Unsendable:
    """The walk's response (its headers, so its ids), whose sending raises before its start."""

    def __init__(self, resp: Response) -> None:
        self.headers = resp.headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("a bug while sending")
