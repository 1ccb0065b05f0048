"""A tenant key may not also be the admin key (review: a config whose tenant key equalled
`admin.key_sha256` loaded, and that tenant's clients could list, add and remove workers, one at
any URL). A key listed twice in one tenant is refused as what it is, not as two tenants sharing
a key ("tenants 'a' and 'a' share an API key"). Neither message carries key material."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gateway.app import Gateway
from gateway.config import ConfigError, load_settings
from gateway.config_watcher import ConfigWatcher
from gateway.errors import APIError

ADMIN = "kvg-admin-shared-by-mistake"
OTHER = "kvg-tenant-own-key"
WORKERS = '[[workers]]\nname = "w0"\nurl = "http://127.0.0.1:9"\n'


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _config(tmp_path: Path, text: str) -> Path:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(text)
    return cfg


def _refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_settings(_config(tmp_path, text))
    return str(e.value)


def _no_key_material(message: str, *keys: str) -> None:
    for key in keys:
        digest = _sha(key)
        for leaked in (key, digest, digest.upper(), digest[:16], digest[-16:]):
            assert leaked not in message, message


def test_a_tenant_key_equal_to_the_admin_key_is_refused(tmp_path: Path) -> None:
    msg = _refused(
        tmp_path,
        f'[admin]\nkey_sha256 = "{_sha(ADMIN)}"\n'
        f'[tenants.acme]\nkeys_sha256 = ["{_sha(OTHER)}", "{_sha(ADMIN)}"]\n' + WORKERS,
    )
    assert "tenants.acme.keys_sha256[1]" in msg and "admin.key_sha256" in msg
    _no_key_material(msg, ADMIN, OTHER)


def test_the_admin_digest_is_compared_whatever_its_case(tmp_path: Path) -> None:
    # Digests are normalised to lower case when loaded: an upper-case admin digest names the
    # same key as the tenant's lower-case one.
    msg = _refused(
        tmp_path,
        f'[admin]\nkey_sha256 = "{_sha(ADMIN).upper()}"\n'
        f'[tenants.acme]\nkeys_sha256 = ["{_sha(ADMIN)}"]\n' + WORKERS,
    )
    assert "tenants.acme.keys_sha256[0]" in msg and "admin.key_sha256" in msg
    _no_key_material(msg, ADMIN)


def test_an_admin_key_from_the_environment_is_checked_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN__KEY_SHA256", _sha(ADMIN))
    msg = _refused(tmp_path, f'[tenants.acme]\nkeys_sha256 = ["{_sha(ADMIN)}"]\n' + WORKERS)
    assert "tenants.acme.keys_sha256[0]" in msg and "admin.key_sha256" in msg


def test_a_reload_that_gives_a_tenant_the_admin_key_is_refused(tmp_path: Path) -> None:
    admin = f'[admin]\nkey_sha256 = "{_sha(ADMIN)}"\n'
    cfg = _config(tmp_path, admin + f'[tenants.acme]\nkeys_sha256 = ["{_sha(OTHER)}"]\n' + WORKERS)
    gw = Gateway(load_settings(cfg), cfg)
    watcher = ConfigWatcher(cfg, gw.settings, gw.apply, gw._on_reload_error)
    running = watcher.current
    cfg.write_text(
        admin + f'[tenants.acme]\nkeys_sha256 = ["{_sha(OTHER)}", "{_sha(ADMIN)}"]\n' + WORKERS
    )
    assert watcher.reload() is False
    assert watcher.current is running and gw.settings is running
    with pytest.raises(APIError) as e:
        gw.tenants.authenticate(f"Bearer {ADMIN}")
    assert e.value.status == 401


def test_the_same_key_twice_in_one_tenant_is_named_as_such(tmp_path: Path) -> None:
    msg = _refused(
        tmp_path,
        f'[tenants.a]\nkeys_sha256 = ["{_sha(OTHER)}", "{_sha(ADMIN)}", "{_sha(OTHER)}"]\n'
        + WORKERS,
    )
    assert "tenants.a.keys_sha256[2]" in msg and "repeats" in msg
    assert "share" not in msg and "'a' and 'a'" not in msg
    _no_key_material(msg, OTHER, ADMIN)


def test_two_tenants_sharing_a_key_are_still_refused(tmp_path: Path) -> None:
    msg = _refused(
        tmp_path,
        f'[tenants.a]\nkeys_sha256 = ["{_sha(OTHER)}"]\n'
        f'[tenants.b]\nkeys_sha256 = ["{_sha(OTHER)}"]\n' + WORKERS,
    )
    assert "tenants 'a' and 'b' share an API key" in msg
    _no_key_material(msg, OTHER)


def test_distinct_admin_and_tenant_keys_load(tmp_path: Path) -> None:
    s = load_settings(
        _config(
            tmp_path,
            f'[admin]\nkey_sha256 = "{_sha(ADMIN)}"\n'
            f'[tenants.acme]\nkeys_sha256 = ["{_sha(OTHER)}"]\n' + WORKERS,
        )
    )
    assert s.admin.key_sha256 == _sha(ADMIN) and s.tenants["acme"].keys_sha256 == [_sha(OTHER)]
