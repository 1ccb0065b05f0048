"""Token accounting review findings, each a test that failed before its fix.

- A whole (non-streaming) 200 answer without a usable `usage` was settled as "nothing generated":
  charged 0 tokens and its RPM cell refunded, so such a key was unlimited.
- A usage chunk with a negative count made the charge negative; the settlement raised after its
  ticket was done: no [DONE], no usage record, the lease held (a false 429 next).
- Errors answered after admission (a worker's 5xx, timeouts) carried no `x-ratelimit-*` headers.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.gateway.accounting_stubs import (
    DONE,
    HEADERS,
    ROLE,
    chat_body,
    completion_doc,
    content,
    ev,
    streaming_worker,
    tenant_settings,
    whole_worker,
)
from tests.gateway.conftest import MODEL, run_gateway, serve_app


@pytest.mark.parametrize("usage", [None, "null"], ids=["absent", "null"])
async def test_a_whole_answer_without_usage_is_charged(tmp_path, usage) -> None:  # type: ignore[no-untyped-def]
    def make(body):  # type: ignore[no-untyped-def]
        doc = completion_doc()
        if usage == "null":
            doc["usage"] = None
        return 200, doc

    usage_file = tmp_path / "usage.jsonl"
    async with serve_app(whole_worker(make)) as wurl:
        s = tenant_settings(
            [wurl],
            {"backend": "memory", "usage_file": str(usage_file)},
            rpm=60,
            tpm=10_000,
            burst_requests=10,
        )
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=15) as c:
                r = await c.post(
                    g.url + "/v1/chat/completions", content=chat_body(False), headers=HEADERS
                )
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
            limits = g.gw.tenants.by_name["t"].limits
            left = await g.gw.quota.shared.usage("t", limits)
    rec = orjson.loads(usage_file.read_bytes().splitlines()[-1])
    assert rec["charged_tokens"] > 0 and left["requests"]["remaining"] < 10, (
        f"a 200 answer the worker generated was charged {rec['charged_tokens']} tokens "
        f"(outcome {rec['outcome']!r}); tokens left {left['tokens']['remaining']}/10000, "
        f"requests left {left['requests']['remaining']}/10 (the RPM cell was refunded too)"
    )


BAD_USAGE = ev(
    {
        "id": "chatcmpl-r",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": -100, "total_tokens": -95},
    }
)


async def test_a_negative_usage_chunk_neither_breaks_the_stream_nor_leaks_the_lease(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    app = streaming_worker([ROLE, content("a", "length"), BAD_USAGE, DONE], [])
    usage_file = tmp_path / "usage.jsonl"
    async with serve_app(app) as wurl:
        s = tenant_settings(
            [wurl], {"backend": "memory", "usage_file": str(usage_file)}, max_concurrent=1
        )
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=15) as c:
                body, broke = b"", ""
                try:
                    async with c.stream(
                        "POST",
                        g.url + "/v1/chat/completions",
                        content=chat_body(True),
                        headers=HEADERS,
                    ) as resp:
                        async for chunk in resp.aiter_bytes():
                            body += chunk
                except httpx.HTTPError as e:
                    broke = type(e).__name__
                nxt = await c.post(
                    g.url + "/v1/chat/completions", content=chat_body(False), headers=HEADERS
                )
            limits = g.gw.tenants.by_name["t"].limits
            held = (await g.gw.quota.shared.usage("t", limits))["in_flight"]
    records = usage_file.read_bytes().splitlines() if usage_file.exists() else []
    assert body.endswith(DONE) and held == 0 and nxt.status_code != 429, (
        f"[DONE] delivered: {body.endswith(DONE)} (client error {broke!r}); leases still held: "
        f"{held}; next request at max_concurrent=1: HTTP {nxt.status_code}; usage records: "
        f"{len(records)}"
    )


async def test_an_upstream_error_after_admission_carries_rate_limit_headers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    err = {
        "error": {
            "message": "engine dead",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    async with serve_app(whole_worker(lambda body: (500, err))) as wurl:
        s = tenant_settings([wurl], {"backend": "memory"}, rpm=60, tpm=10_000)
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=15) as c:
                r = await c.post(
                    g.url + "/v1/chat/completions", content=chat_body(False), headers=HEADERS
                )
    assert r.status_code >= 500
    got = sorted(k for k in r.headers if k.startswith("x-ratelimit"))
    assert "x-ratelimit-remaining-requests" in r.headers, (
        f"HTTP {r.status_code} after admission carries x-ratelimit headers {got}"
    )
