"""Credentials a request sends name its tenant or are refused; they never fall back to the
anonymous tenant (review: with `tenancy.anonymous_tenant` set, `Bearer<TAB><key>`, `Basic ...`,
a bare key and `Bearer` alone were served, and billed, as the anonymous tenant). Whitespace
after `Bearer` is read as RFC 7235 allows, and more (spaces or tabs, any number). `x-api-key`
(LiteLLM, Anthropic-style clients) names the tenant when it comes alone; sent with a different
`Authorization` key, it is a 401. An open gateway (no tenants) reads no credentials at all."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import Settings
from gateway.errors import APIError
from gateway.tenancy import Tenants, bearer_key
from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.gateway.test_tenancy_e2e import KEY_A, KEY_B, chat, tenant_settings

PUBLIC_KEYLESS = {"public": {"rpm": 600, "models": ["another-model"]}}

# Credentials that carry no readable Bearer key: each a 401, anonymous tenant or not.
UNUSABLE = [
    f"Basic {KEY_A}",
    KEY_A,  # a bare key, no scheme
    "Bearer",
    "Bearer   ",
    "",
    f"Bearer{KEY_A}",  # no separator
    f"Bearer\n{KEY_A}",  # not OWS
    f"Bearer\xa0{KEY_A}",  # Unicode space, not OWS
    f"Token {KEY_A}",
]
# Bearer credentials with whitespace a client may send (case-insensitive scheme, SP/HTAB runs).
READABLE = [
    f"Bearer {KEY_A}",
    f"bearer {KEY_A}",
    f"BEARER   {KEY_A}  ",
    f"Bearer\t{KEY_A}",
    f"Bearer \t {KEY_A}\t",
    f" Bearer {KEY_A}",
]


def _tenants(anonymous: bool) -> Tenants:
    data = tenant_settings([]).model_dump()
    if anonymous:
        data["tenants"].update(PUBLIC_KEYLESS)
        data["tenancy"] = {**data["tenancy"], "anonymous_tenant": "public"}
    return Tenants(Settings(**data))


def _refusal(t: Tenants, authorization: str | None, api_key: str | None = None) -> APIError:
    with pytest.raises(APIError) as e:
        if api_key is None:
            t.authenticate(authorization)
        else:
            t.authenticate(authorization, api_key)
    return e.value


@pytest.mark.parametrize("header", READABLE)
def test_a_bearer_key_is_read_through_any_sp_or_htab(header: str) -> None:
    assert bearer_key(header) == KEY_A
    for anonymous in (False, True):
        assert _tenants(anonymous).authenticate(header).name == "a"


@pytest.mark.parametrize("anonymous", [False, True])
@pytest.mark.parametrize("header", UNUSABLE)
def test_unreadable_credentials_are_a_401_never_the_anonymous_tenant(
    header: str, anonymous: bool
) -> None:
    assert bearer_key(header) == ""
    err = _refusal(_tenants(anonymous), header)
    assert err.status == 401 and err.code == "invalid_api_key"
    assert err.type == "invalid_request_error"
    assert KEY_A not in err.message  # the credential is not echoed


def test_no_credentials_are_still_the_anonymous_tenant_or_missing() -> None:
    assert _tenants(True).authenticate(None).name == "public"
    err = _refusal(_tenants(False), None)
    assert err.status == 401 and err.code == "missing_api_key"


@pytest.mark.parametrize("anonymous", [False, True])
def test_x_api_key_alone_names_the_tenant(anonymous: bool) -> None:
    t = _tenants(anonymous)
    assert t.authenticate(None, KEY_B).name == "b"
    assert t.authenticate(None, f" {KEY_B}\t").name == "b"
    for wrong in ("kvg-wrong", "", "  ", f"Bearer {KEY_B}"):
        err = _refusal(t, None, wrong)
        assert err.status == 401 and err.code == "invalid_api_key", wrong


@pytest.mark.parametrize("anonymous", [False, True])
def test_x_api_key_beside_authorization_must_be_the_same_key(anonymous: bool) -> None:
    t = _tenants(anonymous)
    assert t.authenticate(f"Bearer {KEY_A}", KEY_A).name == "a"
    for authorization, api_key in [
        (f"Bearer {KEY_A}", KEY_B),  # two valid keys of two tenants
        (f"Bearer {KEY_A}", "kvg-wrong"),
        (f"Bearer {KEY_A}", ""),
        (f"Basic {KEY_A}", KEY_A),  # x-api-key does not rescue an unreadable Authorization
    ]:
        err = _refusal(t, authorization, api_key)
        assert err.status == 401 and err.code == "invalid_api_key", (authorization, api_key)
        assert KEY_A not in err.message and KEY_B not in err.message


def test_an_open_gateway_reads_no_credentials() -> None:
    # No tenants: everyone is served; a proxy's own Basic credentials pass through unjudged.
    t = Tenants(settings_for([]))
    for authorization in (None, "", f"Basic {KEY_A}", "Bearer", f"Bearer {KEY_A}"):
        assert t.authenticate(authorization).name == "anonymous"
    assert t.authenticate(f"Bearer {KEY_A}", KEY_B).name == "anonymous"
    assert t.authenticate(None, "anything").name == "anonymous"


async def test_routes_refuse_unreadable_credentials_with_an_anonymous_tenant(sims) -> None:  # type: ignore[no-untyped-def]
    """Through the server: the completion route and /v1/models. The anonymous tenant may not
    use MODEL, so a request served as it would be a 404 or an empty model list, not a 401."""
    fleet = sims(1)
    data = tenant_settings(fleet.urls).model_dump()
    data["tenants"].update(PUBLIC_KEYLESS)
    data["tenancy"] = {**data["tenancy"], "anonymous_tenant": "public"}
    s = Settings(**data)
    async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)
        chat_url, models_url = g.url + "/v1/chat/completions", g.url + "/v1/models"
        for header in (f"Basic {KEY_B}", KEY_B, "Bearer", f"Token {KEY_B}"):
            hdrs = {"authorization": header}
            r = await c.post(chat_url, json=chat(max_tokens=4), headers=hdrs)
            assert r.status_code == 401, (header, r.status_code, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            r = await c.get(models_url, headers=hdrs)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # A tab after "Bearer" is read: tenant b, which may use MODEL.
        hdrs = {"authorization": f"Bearer\t{KEY_B}"}
        r = await c.post(chat_url, json=chat(max_tokens=4), headers=hdrs)
        assert r.status_code == 200, r.text
        r = await c.get(models_url, headers=hdrs)
        assert [m["id"] for m in r.json()["data"]] == [MODEL]
        # No credentials at all: still the anonymous tenant, kept to its own allowlist.
        r = await c.post(chat_url, json=chat(max_tokens=4))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert (await c.get(models_url)).json()["data"] == []
        # x-api-key alone names its tenant on both routes (it was served as the anonymous one).
        hdrs = {"x-api-key": KEY_B}
        r = await c.post(chat_url, json=chat(max_tokens=4), headers=hdrs)
        assert r.status_code == 200, r.text
        r = await c.get(models_url, headers=hdrs)
        assert [m["id"] for m in r.json()["data"]] == [MODEL]
        # Beside an Authorization carrying another key: refused.
        hdrs = {"x-api-key": KEY_B, "authorization": "Bearer k-other"}
        r = await c.post(chat_url, json=chat(max_tokens=4), headers=hdrs)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
