"""Requests outside the completion walk get a request line too (logger `kvgate.request`, message
`request`): /v1/models, the admin API, 404 and 405, a route that fails. Before, only the walk's
requests (and the edge's refusals) had one: an operator could not see who listed models, who
tried the admin API, or which request id a 500 on /v1/models was answered with.

The line carries what the walk's line says of any request (request_id, client_request_id, path,
status, e2e_ms) plus the method and, on /v1/models, the tenant; its `request_id` is the one the
response carried. Probe and scrape paths (/health, /ready, /metrics) write none for their
ordinary answers (a success, /ready's 503), only for the unusual ones (a scrape refused its key);
`logging.requests = false` turns these lines off as it does the walk's.

Simulated workers and the gateway on 127.0.0.1; waits are bounded, never timed.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.gateway.test_unhandled_error_ids import uvicorn_logs
from tests.support.sim_workers import run_sim_workers

KEY = "sk-route-log"
ADMIN_KEY = "sk-route-log-admin"
WAIT_S = 10.0
ROUTE_FIELDS = {
    "request_id",
    "client_request_id",
    "method",
    "path",
    "status",
    "e2e_ms",
    "tenant",
}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _settings(urls: list[str], requests: bool = True) -> Settings:
    d = settings_for(
        urls,
        logging={"level": "info", "requests": requests},
        admin={"key_sha256": _sha(ADMIN_KEY), "metrics_require_key": True},
    ).model_dump()
    d["tenants"] = {"t": {"keys_sha256": [_sha(KEY)]}}
    return Settings(**d)


def _lines(caplog: pytest.LogCaptureFixture, cid: str) -> list[dict[str, Any]]:
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "kvgate.request"
        and r.getMessage() == "request"
        and r.fields.get("client_request_id") == cid  # type: ignore[attr-defined]
    ]


async def test_each_request_outside_the_walk_gets_one_line_under_its_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with run_sim_workers(1) as fleet, run_gateway(_settings(list(fleet))) as g:
        await g.wait_healthy(1)
        user = {"authorization": f"Bearer {KEY}"}
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        # (cid, method, path, headers, status, tenant)
        logged = [
            ("models", "GET", "/v1/models", user, 200, "t"),
            ("models-nokey", "GET", "/v1/models", {}, 401, None),
            ("admin", "GET", "/admin/workers", admin, 200, None),
            ("admin-nokey", "GET", "/admin/workers", {}, 401, None),
            ("nowhere", "GET", "/nowhere", {}, 404, None),
            ("bad-method", "DELETE", "/health", {}, 405, None),
            ("chat-get", "GET", "/v1/chat/completions", {}, 405, None),
            ("scrape-nokey", "GET", "/metrics", {}, 401, None),
        ]
        quiet = [
            ("health", "GET", "/health", {}, 200),
            ("ready", "GET", "/ready", {}, 200),
            ("scrape", "GET", "/metrics", admin, 200),
        ]
        ids: dict[str, str] = {}
        with caplog.at_level(logging.INFO), uvicorn_logs(caplog):
            async with httpx.AsyncClient(base_url=g.url, timeout=WAIT_S) as c:
                for cid, method, path, headers, status, _tenant in logged:
                    r = await c.request(method, path, headers={**headers, "x-request-id": cid})
                    assert r.status_code == status, (path, r.status_code, r.text)
                    ids[cid] = r.headers["x-kvgate-request-id"]
                for cid, method, path, headers, status in quiet:
                    r = await c.request(method, path, headers={**headers, "x-request-id": cid})
                    assert r.status_code == status, (path, r.status_code, r.text)
                # /ready's not-ready answer is what its probe asks: no line either.
                healthy = g.gw.registry.healthy
                g.gw.registry.healthy = list  # type: ignore[assignment,method-assign]
                r = await c.get("/ready", headers={"x-request-id": "not-ready"})
                g.gw.registry.healthy = healthy  # type: ignore[method-assign]
                assert r.status_code == 503, r.text
                # A completion's line is still the walk's own, one, without the route fields.
                r = await c.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                    headers={**user, "x-request-id": "chat"},
                )
                assert r.status_code == 200, r.text
                chat_rid = r.headers["x-kvgate-request-id"]
            await until(lambda: bool(_lines(caplog, "chat")), WAIT_S, "the chat's line")
    for cid, method, path, _headers, status, tenant in logged:
        (line,) = _lines(caplog, cid)
        assert set(line) == ROUTE_FIELDS, line
        assert line["request_id"] == ids[cid]
        assert (line["method"], line["path"], line["status"]) == (method, path, status)
        assert line["tenant"] == tenant, (cid, line)
        assert isinstance(line["e2e_ms"], float) and line["e2e_ms"] >= 0
    for cid in [q[0] for q in quiet] + ["not-ready"]:
        assert not _lines(caplog, cid), cid
    (chat,) = _lines(caplog, "chat")
    assert chat["request_id"] == chat_rid and "method" not in chat and chat["status"] == 200


async def test_a_failing_route_is_logged_once_under_the_id_it_answered_with(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A route's bug: the 500 envelope's id names both its traceback (logged once: not again
    by uvicorn after Starlette raises it on) and its request line."""
    async with run_sim_workers(1) as fleet, run_gateway(_settings(list(fleet))) as g:
        await g.wait_healthy(1)

        def boom() -> dict[str, object]:
            raise RuntimeError("a bug in /v1/models")

        g.gw.registry.served_models = boom  # type: ignore[method-assign]
        with caplog.at_level(logging.INFO), uvicorn_logs(caplog):
            async with httpx.AsyncClient(base_url=g.url, timeout=WAIT_S) as c:
                r = await c.get(
                    "/v1/models", headers={"authorization": f"Bearer {KEY}", "x-request-id": "m"}
                )
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "internal_error"
    assert r.json()["error"]["code"] == "internal_error"
    rid = r.headers["x-kvgate-request-id"]
    assert r.headers["x-request-id"] == "m"
    (line,) = _lines(caplog, "m")
    assert line["request_id"] == rid and line["status"] == 500 and line["tenant"] == "t"
    tracebacks = [x for x in caplog.records if x.levelno >= logging.ERROR and x.exc_info]
    (rec,) = tracebacks
    assert rid in rec.getMessage() and rec.fields["request_id"] == rid  # type: ignore[attr-defined]
    assert not [x for x in caplog.records if x.name.startswith("uvicorn")], caplog.text


async def test_logging_requests_false_silences_the_route_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The switch the walk's lines obey, live: on, a line per request; off (a reload), none."""
    async with run_sim_workers(1) as fleet, run_gateway(_settings(list(fleet))) as g:
        await g.wait_healthy(1)
        with caplog.at_level(logging.INFO), uvicorn_logs(caplog):
            async with httpx.AsyncClient(base_url=g.url, timeout=WAIT_S) as c:
                for cid in ("on", "off"):
                    if cid == "off":
                        g.gw.apply(_settings(list(fleet), requests=False))
                    for path in ("/v1/models", "/nowhere", "/admin/workers"):
                        r = await c.get(path, headers={"x-request-id": cid})
                        assert r.status_code in (401, 404), (path, r.status_code)
    assert [line["path"] for line in _lines(caplog, "on")] == [
        "/v1/models",
        "/nowhere",
        "/admin/workers",
    ]
    assert not _lines(caplog, "off")
