"""Session ids are scoped per tenant unambiguously: no client-chosen id reaches another tenant's.

Security review finding 2: ids were scoped as ``f"{namespace}\\x00{id}"`` for isolated tenants
only, so a shared tenant (namespace "") sending ``user = "tenant:a\\u0000alice"`` landed on
isolated tenant a's session "alice" (its pin, and through ``x-kvgate-worker`` its worker).
"""

from __future__ import annotations

import itertools

from gateway.config import Settings, TokenModeSettings
from gateway.keying import route_key, route_key_now
from gateway.tenancy import Tenants
from scoring.policy import make_policy
from scoring.route_key import route_request
from scoring.views import RoutingOptions

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def session(namespace: str, sid: str) -> str | None:
    return route_request(
        "chat", BODY, namespace=namespace, session_id=sid, hash_prefix=False
    ).session_id


def test_a_shared_tenant_cannot_spell_an_isolated_tenants_session() -> None:
    alice = session("tenant:a", "alice")
    for forged in ("tenant:a\x00alice", "8:tenant:a\x00alice", alice or ""):
        assert session("", forged) != alice, f"{forged!r} reaches tenant a's session {alice!r}"


def test_an_isolated_tenant_cannot_spell_another_isolated_tenants_session() -> None:
    # Joined by a NUL alone, namespace "tenant:a" + id "b\x00x" met namespace "tenant:a\x00b"
    # + id "x" (tenant names are TOML keys: any characters).
    assert session("tenant:a", "b\x00x") != session("tenant:a\x00b", "x")


def test_no_two_scope_and_id_pairs_share_a_key() -> None:
    from scoring.route_key import scoped_session_id  # here: the older module had none

    parts = ["", "a", "tenant:a", "1:a", "0:", "a\x00", "\x00a", "\x00", "1", ":", "a:b\x00c"]
    pairs = list(itertools.product(parts, parts))
    keys = [scoped_session_id(scope, sid) for scope, sid in pairs]
    assert len(set(keys)) == len(pairs)


def test_an_unscoped_id_stays_as_sent() -> None:
    # The simulator and an open gateway (one tenant) key sessions by the client's id.
    assert session("", "s1") == "s1"
    assert route_request("chat", BODY, session_id="s1", hash_prefix=False).session_id == "s1"


def _tenants() -> Tenants:
    h = "0" * 63
    return Tenants(
        Settings(
            tenants={
                "a": {"keys_sha256": [h + "1"], "isolate_cache": True},
                "b": {"keys_sha256": [h + "2"]},
                "c": {"keys_sha256": [h + "3"]},
            }
        )
    )


def _key(tenant_name: str, sid: str, tenants: Tenants) -> str | None:
    t = tenants.by_name[tenant_name]
    return route_key_now(
        needs_chain=False,
        keyer=None,
        block_size=16,
        options=RoutingOptions(),
        is_chat=True,
        data=BODY,
        model="m",
        namespace=t.namespace,
        session_id=sid,
        tenant_priority=t.priority,
        request_id="r",
        precise=False,
        session_scope=t.session_scope,
    ).session_id


def test_every_configured_tenant_scopes_its_sessions_by_its_name() -> None:
    tenants = _tenants()
    # Shared tenants share the prefix cache, not each other's sessions.
    assert _key("b", "alice", tenants) != _key("c", "alice", tenants)
    assert _key("b", "alice", tenants) == _key("b", "alice", _tenants())  # every replica alike
    a = _key("a", "alice", tenants)
    for forged in ("tenant:a\x00alice", "a\x00alice", "1:a\x00alice", a or ""):
        assert _key("b", forged, tenants) != a


async def test_route_key_passes_the_scope_through() -> None:
    tenants = _tenants()
    t = tenants.by_name["b"]
    route = await route_key(
        policy=make_policy("session"),
        keyers={},
        views=(),
        options=RoutingOptions(),
        token_mode=TokenModeSettings(),
        is_chat=True,
        data=BODY,
        raw_len=0,
        model="m",
        namespace=t.namespace,
        headers={"x-session-id": "alice"},
        session_header="x-session-id",
        tenant_priority=t.priority,
        request_id="r",
        precise=False,
        session_scope=t.session_scope,
    )
    assert route.session_id == "1:b\x00alice"
