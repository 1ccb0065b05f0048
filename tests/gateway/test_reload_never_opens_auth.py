"""A live reload never turns authentication off: a file that drops every `[tenants]` entry (or
adds an anonymous tenant where there was none) is refused, the running config kept, an ERROR
says how to do it on purpose (a restart), and it counts as a rejected reload. A rewrite caught
half done is a valid config too (workers written, tenants not yet), and the gateway used to
serve anyone until the rest landed. Closing a gateway (tenants added, the anonymous tenant
removed) stays live, and a restart runs whatever the file says."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import httpx
import pytest

from gateway.app import Gateway
from gateway.config import load_settings
from gateway.config_watcher import ConfigWatcher
from gateway.errors import APIError
from tests.gateway.conftest import MODEL, run_gateway
from tests.support.polling import until as _until

KEY = "kvg-auth-reload-key"
ADMIN = "kvg-auth-reload-admin"
WORKERS = '[[workers]]\nname = "w0"\nurl = "http://127.0.0.1:9"\n'
BODY = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _tenants(key: str = KEY) -> str:
    return f'[tenants.acme]\nkeys_sha256 = ["{_sha(key)}"]\nrpm = 100\n'


def _who(gw: Gateway, authorization: str | None) -> str:
    try:
        return gw.tenants.authenticate(authorization).name
    except APIError as e:
        return str(e.status)


def _errors(gw: Gateway) -> float:
    return gw.metrics.registry.get_sample_value("kvgate_config_reload_errors_total") or 0.0


def _loaded(gw: Gateway) -> bool:
    """The watcher loaded a changed file: applied it or refused it."""
    applied = gw.metrics.registry.get_sample_value("kvgate_config_reloads_total") or 0.0
    return applied + _errors(gw) >= 1


def _watched(tmp_path: Path, text: str) -> tuple[Path, Gateway, ConfigWatcher]:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(text)
    gw = Gateway(load_settings(cfg), cfg)
    return cfg, gw, ConfigWatcher(cfg, gw.settings, gw.apply, gw._on_reload_error)


def test_a_reload_without_tenants_is_refused_counted_and_explained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, gw, watcher = _watched(tmp_path, _tenants() + WORKERS)
    running = watcher.current
    cfg.write_text(WORKERS)  # a valid file: the fleet, no tenants
    with caplog.at_level(logging.ERROR, logger="kvgate.config"):
        assert watcher.reload() is False
    assert watcher.current is running and gw.settings is running
    assert gw.tenants.enabled
    assert _who(gw, None) == "401" and _who(gw, "Bearer anything") == "401"
    assert _who(gw, f"Bearer {KEY}") == "acme"
    assert _errors(gw) == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "[tenants]" in errors[0].getMessage()
    assert "restart" in errors[0].getMessage()  # how to do it on purpose
    # The same file read again is refused again; a fixed one (a rotated key) applies.
    assert watcher.reload() is False and _errors(gw) == 2
    cfg.write_text(_tenants("kvg-new-key") + WORKERS)
    assert watcher.reload() is True
    assert _who(gw, f"Bearer {KEY}") == "401" and _who(gw, "Bearer kvg-new-key") == "acme"


def test_a_reload_adding_an_anonymous_tenant_is_refused(tmp_path: Path) -> None:
    cfg, gw, watcher = _watched(tmp_path, _tenants() + WORKERS)
    cfg.write_text('[tenancy]\nanonymous_tenant = "acme"\n' + _tenants() + WORKERS)
    assert watcher.reload() is False
    assert _who(gw, None) == "401" and _errors(gw) == 1


def test_reloads_that_close_or_keep_access_still_apply(tmp_path: Path) -> None:
    # Open -> tenants: closing is live.
    cfg, gw, watcher = _watched(tmp_path, WORKERS)
    assert _who(gw, None) == "anonymous"
    cfg.write_text('[tenancy]\nanonymous_tenant = "acme"\n' + _tenants() + WORKERS)
    assert watcher.reload() is True
    assert _who(gw, None) == "acme" and _who(gw, "Bearer nope") == "401"
    # An anonymous tenant kept (other settings changed), then removed: both live.
    cfg.write_text('[tenancy]\nanonymous_tenant = "acme"\n' + _tenants().replace("100", "50"))
    assert watcher.reload() is True and gw.tenants.anonymous is not None
    cfg.write_text(_tenants() + WORKERS)
    assert watcher.reload() is True
    assert _who(gw, None) == "401" and _errors(gw) == 0


def test_a_restart_runs_an_open_config(tmp_path: Path) -> None:
    """The way to open a gateway on purpose: it starts on whatever the file says."""
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(WORKERS)
    assert _who(Gateway(load_settings(cfg), cfg), None) == "anonymous"


async def test_a_writer_that_pauses_before_the_tenants_never_opens_the_gateway(
    sims,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """The real watcher against a rewrite in two parts with a pause longer than its settle
    window between them (a slow copy): the first part is a valid config without tenants."""
    fleet = sims(1)
    head = (
        '[logging]\nlevel = "warning"\n[probes]\ninterval_s = 0.2\n'
        f'[admin]\nkey_sha256 = "{_sha(ADMIN)}"\n'
        f'[[workers]]\nname = "w0"\nurl = "{fleet.urls[0]}"\n'
    )
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(head + _tenants())
    async with run_gateway(load_settings(cfg), cfg) as g, httpx.AsyncClient(timeout=10) as c:
        await g.wait_healthy(1)
        url = g.url + "/v1/chat/completions"
        statuses: list[int] = []

        async def anonymous() -> None:
            statuses.append((await c.post(url, json=BODY)).status_code)

        await anonymous()
        loop = asyncio.get_running_loop()
        with cfg.open("w") as f:  # truncate, write the first part, and pause
            f.write(head + "# the tenants follow\n")
            f.flush()
            end = loop.time() + 15
            while not _loaded(g.gw) and loop.time() < end:  # until the watcher took the part
                await anonymous()
                await asyncio.sleep(0.05)
            assert _loaded(g.gw), "the watcher never loaded the first part"
            for _ in range(5):
                await anonymous()
            f.write(_tenants())
        await anonymous()
        assert set(statuses) == {401}, statuses
        assert g.gw.tenants.enabled
        ok = await c.post(url, json=BODY, headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text

        # POST /admin/reload of such a file is refused too, and says so.
        cfg.write_text(head)
        assert await _until(lambda: _errors(g.gw) >= 2)
        r = await c.post(g.url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400, r.text
        assert (await c.post(url, json=BODY)).status_code == 401
