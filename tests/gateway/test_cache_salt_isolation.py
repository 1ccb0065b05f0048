"""No client input reaches another tenant's `cache_salt` (vLLM's prefix-cache fence), whatever the
client knows, and salts stay the same across replicas of one config.

Security review finding 3: a shared tenant's own `cache_salt` went to vLLM raw, and without
`tenancy.cache_salt_secret` the secret was the configured key hashes, which a client holding every
key knows: it computed an isolated tenant's salt, sent it, and joined that tenant's KV cache. The
tests here assume the worst, a client that knows the secret outright.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config import Settings, load_settings
from gateway.errors import APIError
from gateway.tenancy import Tenants, apply_caps
from gateway.validate import parse_request

CHAT = "/v1/chat/completions"
MODEL = "m"
SECRET = "known-to-every-client"
KEYS = {name: hashlib.sha256(f"key-{name}".encode()).hexdigest() for name in "acd"}
ROOT = Path(__file__).resolve().parents[2]


def settings(secret: str = SECRET, admin: str = "") -> Settings:
    return Settings(
        admin={"key_sha256": admin},
        tenancy={"anonymous_tenant": "public", "cache_salt_secret": secret},
        tenants={
            "public": {"isolate_cache": True},  # keyless and isolated
            "a": {"keys_sha256": [KEYS["a"]], "isolate_cache": True},
            "c": {"keys_sha256": [KEYS["c"]]},  # shared namespace
            "d": {"keys_sha256": [KEYS["d"]]},
        },
    )


def forwarded(tenants: Tenants, name: str, salt: Any = None) -> Any:
    """The `cache_salt` the worker receives for tenant `name` sending `salt` (None: no field)."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    if salt is not None:
        body["cache_salt"] = salt
    data = parse_request(CHAT, orjson.dumps(body)).data
    apply_caps(tenants.by_name[name], MODEL, data, 1, is_chat=True)
    return data.get("cache_salt")


def client_guesses(secret: bytes) -> list[str]:
    """What a client knowing `secret` (and every key) would try as an isolated tenant's salt."""
    old_default = "".join(sorted(KEYS.values())).encode()  # the derived secret before the fix
    return [
        hmac.new(s, b"kvgate-cache-salt:" + n.encode(), hashlib.sha256).hexdigest()[:32]
        for s in (secret, old_default)
        for n in ("public", "a")
    ]


def test_a_shared_tenant_cannot_send_an_isolated_tenants_salt() -> None:
    tenants = Tenants(settings())
    isolated = {tenants.by_name[n].cache_salt for n in ("public", "a")}
    assert isolated == {forwarded(tenants, n, "anything") for n in ("public", "a")}
    for guess in [*client_guesses(SECRET.encode()), *isolated]:
        for name in ("c", "d"):
            got = forwarded(tenants, name, guess)
            assert got not in isolated, f"tenant {name} reached an isolated tenant's salt {got}"
            assert got != guess, f"tenant {name}'s cache_salt went to the worker raw"


def test_without_a_secret_a_client_holding_every_key_cannot_either() -> None:
    tenants = Tenants(settings(secret=""))
    isolated = {tenants.by_name[n].cache_salt for n in ("public", "a")}
    for guess in client_guesses(b""):
        assert forwarded(tenants, "c", guess) not in isolated


def test_a_tenant_keeps_its_own_salts_apart_and_stable_across_replicas() -> None:
    one, other = Tenants(settings()), Tenants(settings())  # two replicas of one config
    assert forwarded(one, "c", "s1") == forwarded(other, "c", "s1")  # cache reuse across replicas
    assert forwarded(one, "c", "s1") != forwarded(one, "c", "s2")  # its requests kept apart
    assert forwarded(one, "c", "s1") != forwarded(one, "d", "s1")  # another tenant's own
    assert forwarded(one, "c") is None  # no salt: the shared cache, as before
    derived = Tenants(settings(secret=""))
    assert forwarded(derived, "c", "s1") == forwarded(Tenants(settings(secret="")), "c", "s1")
    assert derived.by_name["a"].cache_salt == Tenants(settings(secret="")).by_name["a"].cache_salt


def test_the_derived_secret_takes_in_the_admin_key() -> None:
    # A client holding every tenant key does not hold the admin key.
    plain = Tenants(settings(secret="")).by_name["a"].cache_salt
    admin = Tenants(settings(secret="", admin="ab" * 32)).by_name["a"].cache_salt
    assert plain != admin


def test_isolated_salts_without_a_secret_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvgate.tenancy"):
        Tenants(settings(secret=""))
    assert "cache_salt_secret is not set" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvgate.tenancy"):
        Tenants(settings())
    assert "cache_salt_secret" not in caplog.text


def test_the_example_config_still_loads() -> None:
    # `make run` starts on config.example.toml, which sets isolated tenants and no secret.
    tenants = Tenants(load_settings(ROOT / "config.example.toml"))
    assert any(t.cfg.isolate_cache for t in tenants.by_name.values())


@pytest.mark.parametrize("salt", ["", 7, ["s"], "a/b", "a@b", "a\\b", "a\x00b", "s" * 129])
def test_a_salt_vllm_refuses_is_a_400_before_mapping_could_make_it_valid(salt: Any) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt}
    with pytest.raises(APIError) as e:
        parse_request(CHAT, orjson.dumps(body))
    assert e.value.status == 400 and e.value.param == "cache_salt"
