"""/v1/models with a worker card orjson cannot write.

Review finding: the gateway passes each worker's model card on as the worker wrote it, and a
card with an integer past 64 bits (`"max_model_len": 100000000000000000000`) or nesting past
255 levels, both valid JSON, made /v1/models a 500 for every client and tenant while chat
still worked. Such a card is listed with the fields the gateway vouches for; the others are
listed whole.
"""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.gateway.conftest import MODEL, chat_completion, run_gateway, serve_app, settings_for

OTHER = "other-model"
DEEP = "[" * 300 + "]" * 300


def _worker(bad_value: str) -> Starlette:
    async def health(request: Request) -> Response:
        return Response(b"")

    async def models(request: Request) -> Response:
        body = (
            '{"object": "list", "data": ['
            f'{{"id": "{MODEL}", "object": "model", "owned_by": "vllm", "bad": {bad_value}}},'
            f'{{"id": "{OTHER}", "object": "model", "owned_by": "vllm", "max_model_len": 4096}}'
            "]}"
        )
        return Response(body.encode(), media_type="application/json")

    async def chat(request: Request) -> Response:
        await request.body()
        return JSONResponse(chat_completion())

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


@pytest.mark.parametrize("bad_value", ["100000000000000000000", DEEP], ids=["bigint", "deep"])
async def test_a_card_json_cannot_carry_is_listed_without_its_fields(bad_value: str) -> None:
    async with (
        serve_app(_worker(bad_value)) as url,
        run_gateway(settings_for([url])) as g,
        httpx.AsyncClient(timeout=30) as c,
    ):
        await g.wait_healthy(1)
        r = await c.get(g.url + "/v1/models")
        assert r.status_code == 200, r.text
        by_id = {m["id"]: m for m in r.json()["data"]}
        assert by_id[MODEL] == {
            "id": MODEL,
            "object": "model",
            "created": by_id[MODEL]["created"],
            "owned_by": "vllm",
        }
        assert isinstance(by_id[MODEL]["created"], int)
        assert by_id[OTHER]["max_model_len"] == 4096  # the printable card is whole
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert (await c.post(g.url + "/v1/chat/completions", json=body)).status_code == 200
