"""Request fields that reach vLLM's engine past what the gateway caps, and media caches keyed by
what a client chooses (caps review, third round; each test failed before its fix).

- `vllm_xargs` lands in the request's extra_args, where vLLM reads `kv_transfer_params` and
  `ec_transfer_params`: a malformed one was a 500 from the worker, which the gateway counted
  against healthy workers (three requests ejected one, for every tenant). Refused, with
  `ec_transfer_params` itself (the encoder cache's `kv_transfer_params`).
- `stream_interval` packs many tokens into each SSE event, and a stream its client cuts is
  charged by the events it received: 1,000 tokens were charged 4. Refused.
- `media_io_kwargs` / `mm_processor_kwargs` (video frames, image pixels) make a media part cost
  any number of tokens past `[tenancy.media_tokens]`: refused unless the tenant has
  `accept_media_kwargs`.
- A completions `suffix` renders into every prompt on a fill-in-the-middle model: counted.
- A media part's `uuid` keys vLLM's processor and encoder caches, `cache_salt` aside: mapped per
  tenant, so no tenant draws another's image into its prompt by naming its uuid.
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config import Settings, TenantSettings
from gateway.errors import APIError
from gateway.quota import TenantLimits
from gateway.tenancy import Tenant, apply_caps, estimate_prompt_tokens
from gateway.validate import parse_request
from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
KEY_A, KEY_B = "kvg-fields-a", "kvg-fields-b"
HI = [{"role": "user", "content": "hi"}]


def body(path: str, **extra: Any) -> bytes:
    base: dict[str, Any] = (
        {"model": MODEL, "messages": HI} if path == CHAT else {"model": MODEL, "prompt": "hi"}
    )
    return orjson.dumps({**base, **extra})


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    "field",
    [
        ("vllm_xargs", {"kv_transfer_params": "x"}),
        ("vllm_xargs", {"ec_transfer_params": {"ec_items": []}}),
        ("ec_transfer_params", {"ec_items": [{"transfer_id": "t"}]}),
        ("stream_interval", 999),
    ],
    ids=["xargs-kv", "xargs-ec", "ec", "stream_interval"],
)
def test_engine_fields_are_refused_from_clients(path: str, field: tuple[str, Any]) -> None:
    key, value = field
    with pytest.raises(APIError) as e:
        parse_request(path, body(path, **{key: value}))
    assert e.value.status == 400 and e.value.param == key
    assert "not accepted from clients" in e.value.message


@pytest.mark.parametrize(
    "field",
    [("media_io_kwargs", {"video": {"num_frames": 4096}}), ("mm_processor_kwargs", {"fps": 30})],
)
def test_media_processing_is_the_serving_stacks_unless_accepted(field: tuple[str, Any]) -> None:
    key, value = field
    raw = body(CHAT, **{key: value})
    with pytest.raises(APIError) as e:
        parse_request(CHAT, raw)
    assert e.value.status == 400 and e.value.param == key
    assert parse_request(CHAT, raw, accept_media_kwargs=True).data[key] == value


def test_a_completions_suffix_counts_in_every_prompt() -> None:
    suffix = "x = 1\n" * 33_000  # 198 kB: ~49.5k tokens at 4 bytes a token
    one = estimate_prompt_tokens(False, {"prompt": "a", "suffix": suffix}, 4.0)
    assert one >= len(suffix) // 4
    batch = estimate_prompt_tokens(False, {"prompt": ["a"] * 8, "suffix": suffix}, 4.0)
    assert batch >= 8 * (len(suffix) // 4)
    t = Tenant("t", TenantSettings(max_input_tokens=1000), TenantLimits(), "salt", "")
    with pytest.raises(APIError) as e:
        apply_caps(t, MODEL, {"prompt": "a", "suffix": suffix}, one, is_chat=False)
    assert e.value.status == 400


def _worker(received: list[dict[str, Any]]) -> Any:
    async def chat(request: Request) -> Response:
        received.append(orjson.loads(await request.body()))
        return JSONResponse(chat_completion())

    return stub_app(chat)


def _image(uuid: str, data: bool) -> dict[str, Any]:
    url = {"url": "data:image/png;base64,iVBORw0KGgo="} if data else None
    return {"type": "image_url", "image_url": url, "uuid": uuid}


def _uuids(sent: dict[str, Any]) -> list[str]:
    return [p["uuid"] for m in sent["messages"] for p in m["content"] if "uuid" in p]


async def test_media_uuids_are_the_tenants_own() -> None:
    received: list[dict[str, Any]] = []
    async with serve_app(_worker(received)) as url:
        data = settings_for([url]).model_dump()
        data["tenancy"] = {"cache_salt_secret": "s" * 40}
        data["tenants"] = {
            name: {"keys_sha256": [hashlib.sha256(k.encode()).hexdigest()], "isolate_cache": iso}
            for name, k, iso in (("a", KEY_A, True), ("b", KEY_B, False))
        }
        async with run_gateway(Settings(**data)) as g, httpx.AsyncClient(timeout=10) as c:
            await g.wait_healthy(1)
            for key, image in (
                (KEY_A, _image("scan-42", True)),  # A's private image, under its uuid
                (KEY_B, _image("scan-42", False)),  # B names that uuid, with no data
                (KEY_A, _image("scan-42", False)),  # A's own reuse of it
            ):
                msg = {"role": "user", "content": [image, {"type": "text", "text": "what?"}]}
                r = await c.post(
                    g.url + CHAT,
                    headers={"authorization": f"Bearer {key}"},
                    json={"model": MODEL, "max_tokens": 4, "messages": [msg]},
                )
                assert r.status_code == 200, r.text
    a, b, a_again = (_uuids(x) for x in received)
    assert a != ["scan-42"] and a != b, (a, b)  # never raw, never another tenant's
    assert a == a_again  # a tenant's own uuids still name its own items
