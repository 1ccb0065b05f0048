"""Inputs whose token count the body does not show: media parts and tensors.

Token review findings: a chat's image, audio and video parts counted 0 prompt tokens, so a vision
request of 50 images passed a 2,000-token `max_input_tokens` as the words of its question; and a
completions `prompt_embeds` (or a chat `*_embeds` part) is a tensor whose length is its token
count, passed on uncounted. Media now costs `[tenancy.media_tokens]` per part; tensors are a 400
unless the tenant has `accept_embeds` (the open gateway, which caps nothing, passes them on).
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import Settings
from gateway.errors import APIError
from gateway.validate import parse_request
from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.gateway.test_caps_e2e import AdmitSpy, leases

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PLAIN, TRUSTED = "kvg-media-plain", "kvg-media-trusted"
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
EMBEDS = "UEsDBAAACAgAAAAAAAAAAAAAAAAAAAAAAAAQABIAYXJjaGl2ZS9kYXRhLnBrbEZCDgBaWlpaWlpaWlpa"


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": "what do these show?"}, *parts]
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def media_settings(urls: list[str], image_tokens: int = 1024) -> Settings:
    data = settings_for(urls).model_dump()
    data["tenancy"]["media_tokens"]["image"] = image_tokens
    common = {"rpm": 100_000, "tpm": 10_000_000, "max_input_tokens": 4000}
    data["tenants"] = {
        "plain": {"keys_sha256": [h(PLAIN)], **common},
        "trusted": {"keys_sha256": [h(TRUSTED)], **common, "accept_embeds": True},
    }
    return Settings(**data)


# -- parse_request, pure ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"model": "m", "prompt": "x", "prompt_embeds": EMBEDS}, "prompt_embeds"),
        (
            CHAT,
            chat({"type": "image_embeds", "image_embeds": EMBEDS}),
            "messages[0].content[1]",
        ),
        (
            CHAT,
            chat({"type": "prompt_embeds", "data": EMBEDS}),
            "messages[0].content[1]",
        ),
        # A part with a `uuid` is parsed by vLLM by its media key, whatever `type` says.
        (
            CHAT,
            chat({"type": "text", "text": "", "uuid": "u", "audio_embeds": EMBEDS}),
            "messages[0].content[1]",
        ),
    ],
)
def test_tensor_inputs_are_refused_unless_accepted(
    path: str, body: dict[str, Any], param: str
) -> None:

    raw = orjson.dumps(body)
    with pytest.raises(APIError) as e:
        parse_request(path, raw)
    assert e.value.status == 400 and e.value.param == param
    assert "embeddings cannot be counted" in e.value.message
    assert parse_request(path, raw, accept_embeds=True).model == body["model"]


def test_media_and_a_null_prompt_embeds_are_not_tensors() -> None:

    body = {"model": "m", "prompt": "x", "prompt_embeds": None}
    assert parse_request(COMPLETIONS, orjson.dumps(body)).model == "m"
    assert parse_request(CHAT, orjson.dumps(chat(IMAGE))).model == MODEL


# -- through a gateway -----------------------------------------------------------------------------
async def post(c: httpx.AsyncClient, url: str, path: str, body: dict, key: str) -> httpx.Response:
    return await c.post(url + path, json=body, headers={"authorization": f"Bearer {key}"})


async def test_images_count_against_the_input_cap_and_the_reservation(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="instant")
    async with run_gateway(media_settings(fleet.urls)) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)
        spy = AdmitSpy(g)
        r = await post(c, g.url, CHAT, chat(*[IMAGE] * 5), PLAIN)  # 5 x 1,024 > 4,000
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert spy.take() == []  # refused before any quota was taken
        r = await post(c, g.url, CHAT, chat(*[IMAGE] * 3), PLAIN)
        assert r.status_code == 200, r.text
        (reserved,) = spy.take()
        assert 3 * 1024 <= reserved < 3 * 1024 + 40
        # Live: the operator states the model's real per-image count.
        g.gw.apply(media_settings(fleet.urls, image_tokens=100))
        r = await post(c, g.url, CHAT, chat(*[IMAGE] * 5), PLAIN)
        assert r.status_code == 200, r.text
        (reserved,) = spy.take()
        assert 5 * 100 <= reserved < 5 * 100 + 40
        assert await leases(g) == 0


async def test_embeds_reach_the_worker_only_from_a_tenant_that_accepts_them(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="instant")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "prompt_embeds": EMBEDS}
    async with run_gateway(media_settings(fleet.urls)) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)
        r = await post(c, g.url, COMPLETIONS, body, PLAIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds"
        r = await post(
            c, g.url, CHAT, chat({"type": "image_embeds", "image_embeds": EMBEDS}), PLAIN
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]"
        r = await post(c, g.url, COMPLETIONS, body, TRUSTED)
        assert r.status_code == 200, r.text
        assert await leases(g) == 0
    async with run_gateway(settings_for(fleet.urls)) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)  # the open gateway caps nothing: the workers' flags decide
        assert (await c.post(g.url + COMPLETIONS, json=body)).status_code == 200
