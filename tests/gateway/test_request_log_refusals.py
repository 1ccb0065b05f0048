"""One request line per request (README "Logs"), refused ones included: the same logger, message
and fields as a finished request's, outcome `rejected`; `logging.requests = false` silences them
all; the edge's own refusals (431, the 503 past `server.max_concurrent_requests`) carry
`x-kvgate-request-id` and are logged under it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.support.sim_workers import run_sim_workers

KEY = "sk-log-refusals"
FIELDS = {
    "request_id",
    "client_request_id",
    "model",
    "path",
    "worker",
    "status",
    "outcome",
    "attempts",
    "stream",
    "ttft_ms",
    "sent_ms",
    "e2e_ms",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "error",
}


def _chat(content: str = "hi", **kw: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **kw,
    }


def _settings(urls: list[str], requests: bool = True, **sections: Any) -> Settings:
    d = settings_for(
        urls,
        server={"max_body_bytes": 2048},
        timeouts={"total_s": 0.1},
        logging={"level": "info", "requests": requests},
        **sections,
    ).model_dump()
    d["tenants"] = {"t": {"keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]}}
    return Settings(**d)


def _lines(caplog: pytest.LogCaptureFixture, cid: str) -> list[dict[str, Any]]:
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "request" and getattr(r, "fields", {}).get("client_request_id") == cid
    ]


async def _post(c: httpx.AsyncClient, url: str, cid: str, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": cid, **kw.pop("headers", {})}
    return await c.post(url + "/v1/chat/completions", headers=headers, **kw)


async def test_each_refusal_is_one_request_line_like_a_finished_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with run_sim_workers(1, faults={"added_latency_ms": 300}) as fleet:
        s = _settings(list(fleet))
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            with caplog.at_level(logging.INFO):
                async with httpx.AsyncClient(timeout=10) as c:
                    r401 = await _post(
                        c, g.url, "c401", json=_chat(), headers={"authorization": ""}
                    )
                    r404 = await _post(c, g.url, "c404", json={**_chat(), "model": "nope"})
                    r413 = await _post(c, g.url, "c413", json=_chat("x" * 5000))
                    r504 = await _post(c, g.url, "c504", json=_chat())
                assert [r401.status_code, r404.status_code, r413.status_code] == [401, 404, 413]
                assert r504.status_code == 504
                await until(lambda: len(_lines(caplog, "c504")) >= 1, 10, "the 504's line")
    for cid, status, model in (("c401", 401, None), ("c404", 404, "nope"), ("c413", 413, None)):
        (line,) = _lines(caplog, cid)
        assert set(line) == FIELDS
        assert line["status"] == status and line["outcome"] == "rejected"
        assert line["model"] == model and line["attempts"] == 0 and line["worker"] is None
        assert line["e2e_ms"] is not None and line["error"]
    # A worker had it: one line, the finished request's, not a second one for the refusal.
    (line,) = _lines(caplog, "c504")
    assert set(line) == FIELDS - {"error"}  # only where the gateway answered itself
    assert line["worker"] == "w0" and line["outcome"] == "upstream_timeout"
    assert line["attempts"] == 1 and line["model"] == MODEL
    assert not [r for r in caplog.records if r.getMessage() == "rejected"]


async def test_logging_requests_false_writes_no_line_for_refusals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with run_sim_workers(1) as fleet:
        s = _settings(list(fleet), requests=False)
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            with caplog.at_level(logging.INFO):
                async with httpx.AsyncClient(timeout=10) as c:
                    r = await _post(c, g.url, "c404", json={**_chat(), "model": "nope"})
                    assert r.status_code == 404
                    r = await _post(c, g.url, "c200", json=_chat())
                    assert r.status_code == 200
                # The finished request's counting runs before its answer is sent; so do the
                # refusal's. Nothing may have been logged for either.
                m = await g.metrics()
    assert m['kvgate_rejected_requests_total{reason="404"}'] == 1
    assert not [r for r in caplog.records if r.getMessage() in ("request", "rejected")], (
        caplog.records
    )


async def test_edge_refusals_carry_the_request_id_and_are_logged_under_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with run_sim_workers(1, faults={"added_latency_ms": 2000}) as fleet:
        s = settings_for(
            list(fleet),
            server={"max_concurrent_requests": 1, "max_header_bytes": 1024},
            logging={"level": "info"},
        )
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            w0 = g.gw.registry.workers["w0"]
            with caplog.at_level(logging.INFO):
                async with httpx.AsyncClient(timeout=10) as c:
                    u = g.url + "/v1/chat/completions"
                    held = asyncio.create_task(c.post(u, json=_chat()))
                    await until(lambda: w0.in_flight == 1, 10, "the first request on its worker")
                    r503 = await c.post(u, json=_chat(), headers={"x-request-id": "edge-503"})
                    r431 = await c.post(
                        u, json=_chat(), headers={"x-request-id": "edge-431", "x-pad": "a" * 2000}
                    )
                    held.cancel()
                    await asyncio.gather(held, return_exceptions=True)
    assert r503.status_code == 503 and r431.status_code == 431
    for r, cid, status in ((r503, "edge-503", 503), (r431, "edge-431", 431)):
        rid = r.headers["x-kvgate-request-id"]
        assert rid.startswith("kvg-") and r.headers["x-request-id"] == cid
        assert r.json()["error"]["code"]
        (line,) = _lines(caplog, cid)
        assert set(line) == FIELDS
        assert line["request_id"] == rid and line["status"] == status
        assert line["outcome"] == "rejected" and line["attempts"] == 0
    assert r503.headers["retry-after"] == "1"
