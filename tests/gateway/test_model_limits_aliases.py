"""A model's limits hold under every name it is served by.

vLLM serves one model under all its `--served-model-name`s (each card names the same `root`),
so `model_limits.<name>` keyed by the name the client sent was skipped by sending another name.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.gateway.conftest import MODEL, chat_completion, keyed_settings, run_gateway, serve_app

KEY = "kvg-aliases"
ALIAS = "llama-alias"
ADAPTER = "my-lora"


ROOT = "/models/llama-8b"


def _worker(*cards: dict[str, object]) -> Starlette:
    """A worker listing ``cards`` (each an id and its root, and a parent for an adapter)."""

    async def health(request: Request) -> Response:
        return Response(b"")

    async def models(request: Request) -> Response:
        data = [{"object": "model", "parent": None, **c} for c in cards]
        return JSONResponse({"object": "list", "data": data})

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


def _aliased() -> Starlette:
    """One model under two served names, and a LoRA adapter on it (its own model for vLLM's
    cache, and here for limits)."""
    return _worker(
        {"id": MODEL, "root": ROOT},
        {"id": ALIAS, "root": ROOT},
        {"id": ADAPTER, "root": "/adapters/my-lora", "parent": MODEL},
    )


async def _statuses(url: str, models: tuple[str, ...]) -> list[int]:
    out = []
    h = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=30) as c:
        for model in models:
            body = orjson.dumps(
                {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            )
            r = await c.post(url + "/v1/chat/completions", content=body, headers=h)
            out.append(r.status_code)
    return out


async def test_a_model_limit_holds_under_the_models_other_served_name(tmp_path: Path) -> None:
    async with serve_app(_aliased()) as url:
        tenant = {"model_limits": {MODEL: {"rpm": 1, "burst_requests": 1}}}
        async with run_gateway(keyed_settings([url], KEY, tmp_path / "u.jsonl", tenant)) as g:
            await g.wait_healthy(1)
            got = await _statuses(g.url, (MODEL, ALIAS, ALIAS, MODEL))
    assert got == [200, 429, 429, 429]


async def test_a_limit_set_on_the_alias_holds_under_the_first_name(tmp_path: Path) -> None:
    async with serve_app(_aliased()) as url:
        tenant = {"model_limits": {ALIAS: {"rpm": 1, "burst_requests": 1}}}
        async with run_gateway(keyed_settings([url], KEY, tmp_path / "u.jsonl", tenant)) as g:
            await g.wait_healthy(1)
            got = await _statuses(g.url, (MODEL, MODEL, ALIAS))
    assert got == [200, 429, 429]


async def test_an_adapter_is_limited_apart_from_its_base_model(tmp_path: Path) -> None:
    async with serve_app(_aliased()) as url:
        tenant = {"model_limits": {MODEL: {"rpm": 1, "burst_requests": 1}}}
        async with run_gateway(keyed_settings([url], KEY, tmp_path / "u.jsonl", tenant)) as g:
            await g.wait_healthy(1)
            got = await _statuses(g.url, (MODEL, ADAPTER, ADAPTER, MODEL))
    assert got == [200, 200, 200, 429]


async def test_two_deployments_of_the_same_weights_keep_their_own_limits(tmp_path: Path) -> None:
    """One root, two servers, one name each (a short- and a long-context deployment): two
    models to the operator, so a limit on one is not the other's."""
    async with (
        serve_app(_worker({"id": MODEL, "root": ROOT})) as a,
        serve_app(_worker({"id": ALIAS, "root": ROOT})) as b,
    ):
        tenant = {"model_limits": {MODEL: {"rpm": 1, "burst_requests": 1}}}
        async with run_gateway(keyed_settings([a, b], KEY, tmp_path / "u.jsonl", tenant)) as g:
            await g.wait_healthy(2)
            got = await _statuses(g.url, (MODEL, ALIAS, ALIAS, MODEL))
    assert got == [200, 200, 200, 429]
