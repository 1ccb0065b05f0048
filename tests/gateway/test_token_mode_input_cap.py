"""In token mode `max_input_tokens` is checked against the tokenizer's count too.

Review finding: the cap is checked on an estimate (UTF-8 bytes / chars_per_token) before any
tokenizing, and text a byte-level BPE splits finer (control characters, rare scripts) held up to
~4x the tokens it said. Where the gateway tokenizes the prompt anyway (token mode), the exact
count now refuses what the estimate let through, before any worker sees it.
"""

from __future__ import annotations

import hashlib

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config import Settings
from gateway.tenancy import estimate_prompt_tokens
from gateway.tokenizers import sim_token_keyer
from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
)

KEY = "kvg-token-cap"
CAP = 130


def body(text: str) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}


async def test_the_tokenizers_count_refuses_what_the_estimate_let_through() -> None:
    long, short = "hello world " * 40, "hello world " * 20
    exact = sim_token_keyer().key("chat", body(long), model=MODEL, block_size=16).prompt_tokens
    assert estimate_prompt_tokens(True, body(long), 4.0) <= CAP < exact  # the case at hand
    seen: list[bytes] = []

    async def ok(request: Request) -> Response:
        seen.append(await request.body())
        return JSONResponse(chat_completion())

    async with serve_app(stub_app(ok)) as url:
        data = settings_for([url]).model_dump()
        data["routing"] = {"token_mode": {"models": {MODEL: "sim"}}}
        data["tenants"] = {
            "t": {
                "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                "max_input_tokens": CAP,
            }
        }
        async with run_gateway(Settings(**data)) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(1)
            auth = {"authorization": f"Bearer {KEY}"}
            r = await c.post(g.url + "/v1/chat/completions", json=body(long), headers=auth)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert f"{round(exact)} tokens" in err["message"] and err["param"] == "messages"
            assert seen == []
            r = await c.post(g.url + "/v1/chat/completions", json=body(short), headers=auth)
            assert r.status_code == 200, r.text
            assert len(seen) == 1
