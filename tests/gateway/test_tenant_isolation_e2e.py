"""Tenant fences end to end, through a running gateway (security review findings 1, 2 and 3):
a prompt hidden in `documents` meets `max_input_tokens`, a shared tenant cannot reach an isolated
tenant's session, and a client's `cache_salt` reaches the worker mapped, never as sent."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from gateway.config import Settings
from tests.gateway.conftest import MODEL, run_gateway, run_scripted_worker, settings_for

KEY_A, KEY_B, KEY_C = "kvg-iso-a", "kvg-iso-b", "kvg-iso-c"
SECRET = "known-to-every-client"


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_settings(urls: list[str], **sections: Any) -> Settings:
    data = settings_for(urls, **sections).model_dump()
    data["tenancy"] = {"anonymous_tenant": "public", "cache_salt_secret": SECRET}
    data["tenants"] = {
        "public": {"isolate_cache": True},  # keyless, isolated
        "a": {"keys_sha256": [h(KEY_A)], "isolate_cache": True, "max_input_tokens": 2000},
        "b": {"keys_sha256": [h(KEY_B)]},  # shared namespace
        "c": {"keys_sha256": [h(KEY_C)]},  # shared namespace too
    }
    return Settings(**data)


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


async def test_a_prompt_in_documents_meets_max_input_tokens(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="instant")
    big = "lorem ipsum dolor sit amet " * 8000  # ~54k tokens
    async with run_gateway(tenant_settings(fleet.urls)) as g:
        await g.wait_healthy(1)
        auth = {"authorization": f"Bearer {KEY_A}"}
        async with httpx.AsyncClient(timeout=30) as c:
            small = await c.post(g.url + "/v1/chat/completions", json=chat(), headers=auth)
            assert small.status_code == 200, small.text
            for extra in (
                {"documents": [{"title": "t", "text": big}]},
                {"chat_template_kwargs": {"custom_tools": [{"description": big}]}},
            ):
                r = await c.post(g.url + "/v1/chat/completions", json=chat(**extra), headers=auth)
                assert r.status_code == 400, f"{list(extra)}: forwarded ({r.status_code})"
                assert "input tokens" in r.json()["error"]["message"]


async def chat_as(c: httpx.AsyncClient, url: str, key: str, user: str) -> httpx.Response:
    """A chat from tenant ``key`` whose session id (``user``) is ``user``."""
    return await c.post(
        url + "/v1/chat/completions",
        json=chat(user=user),
        headers={"authorization": f"Bearer {key}"},
    )


@contextlib.asynccontextmanager
async def session_gateway(sims: Any) -> AsyncIterator[tuple[Any, Any, httpx.AsyncClient]]:
    """A tenant gateway routing by session on two instant sims: (gateway, its session table,
    a client)."""
    fleet = sims(2, profile="instant")
    async with run_gateway(tenant_settings(fleet.urls, routing={"policy": "session"})) as g:
        await g.wait_healthy(2)
        async with httpx.AsyncClient(timeout=30) as c:
            yield g, g.gw.policy.state.sessions, c  # type: ignore[union-attr]


async def test_a_shared_tenant_cannot_reach_an_isolated_tenants_session(sims) -> None:  # type: ignore[no-untyped-def]
    async with session_gateway(sims) as (g, sessions, c):
        r = await chat_as(c, g.url, KEY_A, "alice")
        assert r.status_code == 200 and len(sessions) == 1
        for forged in ("tenant:a\x00alice", "1:a\x00alice", "8:tenant:a\x00alice"):
            r = await chat_as(c, g.url, KEY_B, forged)
            assert r.status_code == 200, r.text
    # Each forged id is a session of b's own: tenant a's one session was never touched.
    assert len(sessions) == 4, "tenant b's forged id landed on tenant a's session"


async def test_two_shared_tenants_sending_one_session_id_get_a_session_each(sims) -> None:  # type: ignore[no-untyped-def]
    # Sharing a prefix namespace is not sharing sessions: b's "alice" is not c's.
    async with session_gateway(sims) as (g, sessions, c):
        for key in (KEY_B, KEY_C):
            r = await chat_as(c, g.url, key, "alice")
            assert r.status_code == 200, r.text
    assert len(sessions) == 2, "two tenants' sessions were one"


async def test_a_client_salt_reaches_the_worker_mapped() -> None:
    # The client knows the secret and every name: it computes the anonymous tenant's salt.
    guess = hmac.new(SECRET.encode(), b"kvgate-cache-salt:public", hashlib.sha256).hexdigest()[:32]
    async with (
        run_scripted_worker() as (url, received),
        run_gateway(tenant_settings([url])) as g,
    ):
        await g.wait_healthy(1)
        async with httpx.AsyncClient(timeout=30) as c:
            for salt, auth in ((None, {}), (guess, {"authorization": f"Bearer {KEY_B}"})):
                body = chat(stream=True, **({"cache_salt": salt} if salt else {}))
                r = await c.post(g.url + "/v1/chat/completions", json=body, headers=auth)
                assert r.status_code == 200, r.text
    assert len(received) == 2  # recorded before the worker answered
    victim, attacker = (orjson.loads(b).get("cache_salt") for b in received)
    assert victim == guess  # the anonymous, isolated tenant's salt: what the client computed
    assert attacker != victim, f"tenant b reached public's KV cache salt {victim}"
    assert attacker is not None and attacker != guess
