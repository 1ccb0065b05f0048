"""Through the gateway: an isolated tenant's requests never hit the token-mode prefix-ids cache
entries another tenant's requests stored (review finding 4: a hit skips the tokenizer, so its
latency, even on a 429, told whether another tenant had sent that system prompt).

The gateway runs in token mode with a counting character-level keyer (cache enabled) put in place
of the sim's, so the test checks the cache, not wall-clock time: the probe's lookup misses and
none of its keys can match what the victim stored. Same-tenant repeats still hit.
"""

from __future__ import annotations

import hashlib

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config import Settings
from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
)
from tests.scoring.test_token_cache_scope import SYSTEM, keyer

KEYS = {"victim": "kvg-iso-victim", "attacker": "kvg-iso-attacker"}


async def _ok(request: Request) -> Response:
    await request.body()
    return JSONResponse(chat_completion())


async def test_an_isolated_tenant_cannot_hit_another_tenants_cached_prefix() -> None:
    k, _ = keyer()
    async with serve_app(stub_app(_ok)) as url:
        data = settings_for([url]).model_dump()
        data["routing"] = {"token_mode": {"models": {MODEL: "sim"}}}
        data["tenancy"] = {"cache_salt_secret": "s" * 40}
        data["tenants"] = {
            name: {"keys_sha256": [hashlib.sha256(key.encode()).hexdigest()], "isolate_cache": True}
            for name, key in KEYS.items()
        }
        async with run_gateway(Settings(**data)) as g:
            g.gw.token_keyers[MODEL] = k  # the sim's keyer caches nothing: one that does
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=30) as c:

                async def post(who: str, user: str) -> None:
                    body = {
                        "model": MODEL,
                        "max_tokens": 1,
                        "messages": [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": user},
                        ],
                    }
                    r = await c.post(
                        g.url + "/v1/chat/completions",
                        content=orjson.dumps(body),
                        headers={"authorization": f"Bearer {KEYS[who]}"},
                    )
                    assert r.status_code == 200, r.text

                await post("victim", "hello")
                stored = set(k._cache._lru)
                assert stored and k.cache_stats()["hits"] == 0
                await post("attacker", "probe")  # the victim's system prompt, guessed right
                assert k.cache_stats()["hits"] == 0, "the attacker's lookup hit the victim's entry"
                scopes = {s for s, _, _ in k._cache._lru}
                # Each tenant under its own namespace and salt; never each other's.
                assert len(scopes) == 2 and all(
                    ns.startswith("tenant:") and salt for ns, salt in scopes
                )
                await post("victim", "again")  # the victim's own repeat still hits
                assert k.cache_stats()["hits"] == 1


async def test_a_request_the_quota_refuses_is_never_tokenized() -> None:
    # Defence in depth (same review): admission comes before keying, so an over-quota key spends
    # no tokenizer time, and its refusals' latency carries nothing of the tokenizer's cache.
    k, enc = keyer()
    async with serve_app(stub_app(_ok)) as url:
        data = settings_for([url]).model_dump()
        data["routing"] = {"token_mode": {"models": {MODEL: "sim"}}}
        data["tenants"] = {
            "t": {
                "keys_sha256": [hashlib.sha256(KEYS["attacker"].encode()).hexdigest()],
                "rpm": 1,
                "burst_requests": 1,
            }
        }
        async with run_gateway(Settings(**data)) as g, httpx.AsyncClient(timeout=30) as c:
            g.gw.token_keyers[MODEL] = k
            await g.wait_healthy(1)
            body = {
                "model": MODEL,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": SYSTEM}],
            }
            auth = {"authorization": f"Bearer {KEYS['attacker']}"}
            r = await c.post(g.url + "/v1/chat/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
            tokenized = enc.chars
            assert tokenized > 0
            r = await c.post(g.url + "/v1/chat/completions", json=body, headers=auth)
            assert r.status_code == 429, r.text
            assert enc.chars == tokenized  # refused before any tokenizing
