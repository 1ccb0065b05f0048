"""In token mode `max_input_tokens` is checked against the tokenizer's count too.

Review finding: the cap is checked on an estimate (UTF-8 bytes / chars_per_token) before any
tokenizing, and text a byte-level BPE splits finer (control characters, rare scripts) held up to
~4x the tokens it said. Where the gateway tokenizes the prompt anyway (token mode), the exact
count now refuses what the estimate let through, before any worker sees it.
"""

from __future__ import annotations

import hashlib

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

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


def capped(url: str) -> Settings:
    """Token mode on MODEL (the simulator's tokenizer), one tenant capped at CAP input tokens."""
    data = settings_for([url]).model_dump()
    data["routing"] = {"token_mode": {"models": {MODEL: "sim"}}}
    data["tenants"] = {
        "t": {"keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "max_input_tokens": CAP}
    }
    return Settings(**data)


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

    async with (
        serve_app(stub_app(ok)) as url,
        run_gateway(capped(url)) as g,
        httpx.AsyncClient(timeout=30) as c,
    ):
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


FINE = "a," * 248  # the estimate's 125 tokens (496 bytes / 4), the tokenizer's 496


@pytest.mark.parametrize(
    ("extra", "over"),
    [
        ({"prompt": ["hi", FINE]}, True),  # the batch's second prompt
        ({"prompt": "hi", "suffix": FINE}, True),  # the suffix
        ({"prompt": ["hi", "hi"], "suffix": "a," * 30}, False),
        ({"prompt": [[1, 2, 3], [4] * 200]}, True),  # token ids: counted as given
        ({"prompt": [[1, 2, 3], [4] * 100]}, False),
    ],
    ids=["batch", "suffix", "small-batch", "ids-batch", "small-ids-batch"],
)
async def test_a_completions_batch_and_its_suffix_count_whole(
    extra: dict[str, object], over: bool
) -> None:
    """Review: the exact count was the first prompt's alone (the one the chain stands for), so
    the rest of a batch and the suffix took the estimate's ~4x shortfall past the cap."""
    seen: list[bytes] = []

    async def ok(request: Request) -> Response:
        seen.append(await request.body())
        return JSONResponse(
            {
                "id": "c",
                "object": "text_completion",
                "created": 1,
                "model": MODEL,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )

    app = stub_app(ok)
    app.router.routes.append(Route("/v1/completions", ok, methods=["POST"]))
    async with (
        serve_app(app) as url,
        run_gateway(capped(url)) as g,
        httpx.AsyncClient(timeout=30) as c,
    ):
        await g.wait_healthy(1)
        r = await c.post(
            g.url + "/v1/completions",
            json={"model": MODEL, "max_tokens": 1, **extra},
            headers={"authorization": f"Bearer {KEY}"},
        )
        if over:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "prompt" and seen == []
        else:
            assert r.status_code == 200, r.text
            assert len(seen) == 1
