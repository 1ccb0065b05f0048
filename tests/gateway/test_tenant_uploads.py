"""One tenant's slow uploads cannot take every place under `server.max_concurrent_requests`.

Review finding: a body is read before the quota admits its request, while the request already
holds one of the gateway's completion places. A tenant limited to one request at a time
(`max_concurrent = 1`) opened 8 uploads that never finished, held all 8 places of the cap, and
every other tenant got a 503 until `client_body_s` ran out. Now a tenant uploads at most
`max_concurrent` bodies at once (per process); the next gets a 429 at once.
"""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import orjson

from gateway.config import Settings
from tests.gateway.conftest import MODEL, run_gateway, settings_for

KEY_A, KEY_B = "kvg-upload-a", "kvg-upload-b"


def head(key: str, body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    )


async def test_a_tenants_slow_uploads_leave_room_for_other_tenants(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1)
    data = settings_for(fleet.urls).model_dump()
    data["server"] = {**data["server"], "max_concurrent_requests": 8}
    data["timeouts"] = {**data["timeouts"], "client_body_s": 30}
    data["tenants"] = {
        "a": {"keys_sha256": [hashlib.sha256(KEY_A.encode()).hexdigest()], "max_concurrent": 1},
        "b": {"keys_sha256": [hashlib.sha256(KEY_B.encode()).hexdigest()]},
    }
    body = orjson.dumps(
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    )
    async with run_gateway(Settings(**data)) as g:
        await g.wait_healthy(1)
        host, port = g.url.removeprefix("http://").split(":")
        slow = []
        for _ in range(8):  # tenant a: head and all but the last byte of the body
            r, w = await asyncio.open_connection(host, int(port))
            w.write(head(KEY_A, body) + body[:-1])
            await w.drain()
            slow.append((r, w))
        # All but the first are refused at once, before their bodies come.
        lines = [await asyncio.wait_for(r.readline(), 10) for r, _w in slow[1:]]
        assert all(b" 429 " in line for line in lines), lines
        async with httpx.AsyncClient() as c:
            resp = await c.post(
                g.url + "/v1/chat/completions",
                content=body,
                headers={"authorization": f"Bearer {KEY_B}", "content-type": "application/json"},
                timeout=10,
            )
        assert resp.status_code == 200, resp.text
        r, w = slow[0]  # the one upload it may make finishes and is served
        w.write(body[-1:])
        await w.drain()
        assert b" 200 " in await asyncio.wait_for(r.readline(), 10)
        for _r, w in slow:
            w.close()
