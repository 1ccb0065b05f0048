"""Every response the gateway sends carries its request id, `x-kvgate-request-id`, once
(gateway/ids.py: what every response carries), and `x-request-id`, the client's echoed or ours.

The completion walk and the edge's refusals set them; the responses of Starlette's routes did not:
/v1/models, /health, /ready, /metrics, the admin API, and the 404, 405 and 500 envelopes. A
client quoting a failed /v1/models call in a support ticket had nothing to quote. The server
(gateway/server.py) now adds them to any response that lacks them, past the walk's two paths,
and to its own protocol refusals.

Raw sockets and httpx on 127.0.0.1; waits are bounded, never timed.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import orjson

from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.gateway.test_pipelining import WAIT_S, Immediate, _read_to_eof, _responses
from tests.support.raw_worker import raw_worker

OURS = re.compile(r"kvg-[0-9a-f]{12}-[0-9a-f]+")
CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})


def _ids(resp: httpx.Response) -> tuple[str, str]:
    """The response's one `x-kvgate-request-id` (ours) and one `x-request-id`."""
    ours = resp.headers.get_list("x-kvgate-request-id")
    echoed = resp.headers.get_list("x-request-id")
    assert len(ours) == 1 and len(echoed) == 1, (resp.status_code, resp.headers)
    assert OURS.fullmatch(ours[0]), ours
    return ours[0], echoed[0]


async def test_every_route_and_error_carries_the_request_id() -> None:
    async with (
        raw_worker(Immediate().script) as (url, _posts),
        run_gateway(settings_for([url], server={"max_header_bytes": 1024})) as g,
    ):
        await g.wait_healthy(1)

        def boom() -> dict[str, object]:
            raise RuntimeError("a bug")

        seen: set[str] = set()
        async with httpx.AsyncClient(base_url=g.url, timeout=WAIT_S) as c:
            checks = [
                ("GET", "/v1/models", {}, 200),
                ("GET", "/health", {}, 200),
                ("GET", "/ready", {}, 200),
                ("GET", "/metrics", {}, 200),
                ("GET", "/admin/workers", {}, 403),  # admin endpoints disabled: an envelope
                ("POST", "/admin/reload", {}, 403),
                ("GET", "/nowhere", {}, 404),
                ("DELETE", "/health", {}, 405),
                ("GET", "/v1/chat/completions", {}, 405),  # a walk path, not the walk's method
                # The edge's 431 on a Starlette route sets its own ids: not a second pair.
                ("GET", "/health", {"x-pad": "a" * 1500}, 431),
            ]
            for method, path, headers, status in checks:
                r = await c.request(method, path, headers=headers)
                assert r.status_code == status, (path, r.status_code, r.text)
                ours, echoed = _ids(r)
                assert echoed == ours, path  # no client id: ours under both
                seen.add(ours)
                if status >= 400:
                    assert set(orjson.loads(r.content)["error"]) >= {"message", "type"}
            # A client's id is echoed; one that is no id is not (as the walk does).
            r = await c.get("/v1/models", headers={"x-request-id": "client-7"})
            ours, echoed = _ids(r)
            assert echoed == "client-7" and ours not in seen
            seen.add(ours)
            r = await c.get("/v1/models", headers={"x-request-id": "not an id"})
            ours, echoed = _ids(r)
            assert echoed == ours
            seen.add(ours)
            # A route that fails: Starlette's 500 envelope.
            g.gw.registry.served_models = boom  # type: ignore[method-assign]
            r = await c.get("/v1/models")
            assert r.status_code == 500, r.text
            seen.add(_ids(r)[0])
            # The walk's own ids, once (the server adds none there).
            r = await c.post("/v1/chat/completions", content=CHAT, headers={"x-request-id": "c-1"})
            assert r.status_code == 200, r.text
            ours, echoed = _ids(r)
            assert echoed == "c-1"
            seen.add(ours)
        assert len(seen) == len(checks) + 4  # one id per response


async def test_the_servers_own_refusals_carry_a_request_id() -> None:
    """A head the server refuses never reaches the app: its envelope carries an id of ours."""
    async with (
        raw_worker(Immediate().script) as (url, _posts),
        run_gateway(settings_for([url])) as g,
    ):
        await g.wait_healthy(1)
        port = int(g.url.rsplit(":", 1)[1])
        for data in (
            b"GET /health HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",  # two Hosts
            b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"a:\r\n" * 1000 + b"\r\n",  # 431
            b"BAD\x01 / HTTP/1.1\r\n\r\n",  # malformed
        ):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(data)
            out, closed = await _read_to_eof(r)
            w.close()
            assert closed
            [(head, _body)] = _responses(out)
            lines = head.lower().split(b"\r\n")
            ids = [ln.split(b": ", 1)[1] for ln in lines if ln.startswith(b"x-kvgate-request-id:")]
            assert len(ids) == 1 and OURS.fullmatch(ids[0].decode()), head
