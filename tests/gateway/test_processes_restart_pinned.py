"""`kvgate serve --processes N`: a child restarted after the file changed runs what its siblings
run. Settings a reload cannot change ([server], [upstream], [quota], [cluster]'s Redis URL, key
prefix, enabled, share_learned) are the gateway's start's, whatever the file says by then, and a
file that would let in callers without a key that the gateway turned away (its siblings refused
it as a reload) keeps the child from starting until it is fixed. A restarted child used to read
the file from scratch: after `[quota] backend = "memory"` it enforced every limit on its own, on
top of the shared ones, and after `[tenants]` was dropped it served without authentication."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.redis_server import RedisServer
from gateway import process_child
from gateway.config import ConfigError, Settings
from gateway.process_child import ChildSpec
from tests.gateway import test_processes
from tests.gateway.conftest import settings_for
from tests.gateway.test_processes import Gateway, chat, wait_until, write_config

gateways = test_processes.gateways  # the fixture: `kvgate serve --processes N`, run for real

KEY = "kvg-pinned-tenant-key"
KEY_HASH = hashlib.sha256(KEY.encode()).hexdigest()
TENANT = {"t": {"keys_sha256": [KEY_HASH], "rpm": 3, "burst_requests": 3}}


# -- the pinning itself (no processes) -----------------------------------------------------------


def _spec(run_dir: Path) -> ChildSpec:
    return ChildSpec(index=1, processes=2, run_dir=str(run_dir), ready_fd=-1, lifeline_fd=-1)


def _start(tmp_path: Path, settings: Settings) -> ChildSpec:
    process_child.write_start(tmp_path, settings)
    assert (tmp_path / "start.json").stat().st_mode & 0o077 == 0  # it holds Redis URLs
    return _spec(tmp_path)


def test_a_restarted_child_runs_the_starts_restart_only_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    start = settings_for(
        ["http://127.0.0.1:9"],
        server={"max_connections": 100},
        quota={"backend": "redis", "redis_url": "redis://127.0.0.1:1/0"},
        cluster={"redis_url": "redis://127.0.0.1:2/0", "key_prefix": "kvgate:{a}:"},
        tenants=TENANT,
    )
    spec = _start(tmp_path, start)
    edited = settings_for(
        ["http://127.0.0.1:9", "http://127.0.0.1:10"],
        server={"max_connections": 50},
        quota={"backend": "memory"},
        cluster={"key_prefix": "kvgate:{b}:", "publish_interval_s": 0.5},
        tenants={"t": {**TENANT["t"], "rpm": 7}},
    )
    with caplog.at_level(logging.WARNING, logger="kvgate.supervisor"):
        got = process_child.start_settings(edited, spec)
    assert got.quota == start.quota and got.server == start.server
    assert (got.cluster.redis_url, got.cluster.key_prefix) == (
        "redis://127.0.0.1:2/0",
        "kvgate:{a}:",
    )
    # What a reload applies stays the file's: [cluster]'s live keys, the fleet, the tenants.
    assert got.cluster.publish_interval_s == 0.5
    assert len(got.workers) == 2 and got.tenants["t"].rpm == 7
    text = caplog.text
    assert "[quota]" in text and "[server]" in text and "[cluster]" in text
    # An unchanged file: nothing to say, the same settings.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvgate.supervisor"):
        assert process_child.start_settings(start, spec) == start
    assert not caplog.records


def test_the_environment_still_beats_the_starts_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor's copy of the settings lacks its children's overrides (`child_environment`:
    [cluster] on, the quota store's replica count): the child's environment still applies."""
    start = settings_for([], quota={"backend": "redis", "replicas": 1})
    spec = _start(tmp_path, start)
    monkeypatch.setenv("KVGATE_CLUSTER__ENABLED", "true")
    monkeypatch.setenv("KVGATE_QUOTA__REPLICAS", "4")
    got = process_child.start_settings(settings_for([], quota={"backend": "memory"}), spec)
    assert got.quota.backend == "redis" and got.quota.replicas == 4 and got.cluster.enabled


@pytest.mark.parametrize(
    "edit",
    [{"tenants": {}}, {"tenancy": {"anonymous_tenant": "t"}}],
    ids=["no tenants", "anonymous tenant"],
)
def test_a_child_does_not_start_open_where_the_gateway_started_closed(
    tmp_path: Path, edit: dict[str, Any]
) -> None:
    spec = _start(tmp_path, settings_for([], tenants=TENANT))
    with pytest.raises(ConfigError, match="without an API key"):
        process_child.start_settings(settings_for([], **{"tenants": TENANT, **edit}), spec)
    # Closed -> closed (a rotated key) and open -> open start as usual.
    process_child.start_settings(settings_for([], tenants={"t": {"keys_sha256": ["b" * 64]}}), spec)
    opened = tmp_path / "open"
    opened.mkdir()
    process_child.start_settings(settings_for([]), _start(opened, settings_for([])))


def test_without_the_start_file_a_child_refuses_to_guess(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="started with"):
        process_child.start_settings(settings_for([]), _spec(tmp_path))


# -- for real: supervisor, children, Redis -------------------------------------------------------


async def _statuses(url: str, n: int, key: str | None) -> list[int]:
    """`n` requests one after the other, each on a new connection (spread by SO_REUSEPORT)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(30)) as s:
        out = []
        for _ in range(n):
            async with s.post(url + "/v1/chat/completions", json=chat(2), headers=headers) as r:
                await r.read()
                out.append(r.status)
        return out


def _tenant_config(tmp_path: Path, urls: list[str], redis: RedisServer) -> Path:
    cfg = write_config(tmp_path, urls, redis)
    tenant = f'\n[tenants.t]\nkeys_sha256 = ["{KEY_HASH}"]\nrpm = 3\nburst_requests = 3\n'
    cfg.write_text(cfg.read_text() + tenant)
    return cfg


def _restart_child(gw: Gateway, index: int) -> None:
    before = gw.pids()
    os.kill(before[index], signal.SIGKILL)  # a crash, an OOM kill
    wait_until(
        lambda: gw.serving() and gw.pids().get(index) not in (None, before[index]),
        90,
        f"process {index} restarted",
        gw,
    )


def test_a_child_restarted_after_a_quota_edit_keeps_the_shared_quotas(
    tmp_path: Path, sims: Any, redis: RedisServer, gateways: Callable[..., Gateway]
) -> None:
    fleet = sims(2)
    cfg = _tenant_config(tmp_path, fleet.urls, redis)
    gw = gateways(cfg)
    first = asyncio.run(_statuses(gw.url, 12, KEY))
    assert first.count(200) == 3 and first.count(429) == 9, first  # the shared rpm is spent
    assert "since the gateway started" not in gw.log.read_text()  # the file as it started
    cfg.write_text(cfg.read_text().replace('backend = "redis"', 'backend = "memory"'))
    wait_until(lambda: gw.log.read_text().count("[quota] changed") >= 2, 30, "both warned", gw)
    _restart_child(gw, 1)
    # Still the same minute, still the shared limit: no process admits the tenant on its own.
    second = asyncio.run(_statuses(gw.url, 20, KEY))
    assert second.count(200) == 0, second
    assert "[quota] changed since the gateway started" in gw.log.read_text()


def test_a_child_restarted_after_the_tenants_were_dropped_does_not_serve_open(
    tmp_path: Path, sims: Any, redis: RedisServer, gateways: Callable[..., Gateway]
) -> None:
    fleet = sims(2)
    cfg = _tenant_config(tmp_path, fleet.urls, redis)
    closed = cfg.read_text()
    gw = gateways(cfg)
    assert set(asyncio.run(_statuses(gw.url, 6, None))) == {401}
    cfg.write_text(closed.split("\n[tenants.t]")[0] + "\n")  # the tenants dropped: valid

    def refused() -> bool:
        m = gw.metrics()
        return all(m.get(f'kvgate_config_reload_errors_total{{process="{k}"}}') for k in (0, 1))

    wait_until(refused, 30, "both processes refused the reload", gw)
    pid = gw.pids()[1]
    os.kill(pid, signal.SIGKILL)

    def came_back() -> bool:  # refused to start, or (the bug) serving
        return "refused the config file" in gw.log.read_text() or (
            gw.serving() and gw.pids().get(1) not in (None, pid)
        )

    wait_until(came_back, 60, "process 1 restarted", gw)
    # The process left serves with its tenants; the refused one serves nothing.
    assert set(asyncio.run(_statuses(gw.url, 10, None))) == {401}
    assert "process 1 refuses to start" in gw.log.read_text()
    cfg.write_text(closed)  # fixed: the next restart starts
    wait_until(
        lambda: gw.serving() and gw.pids().get(1) not in (None, pid), 90, "process 1 back", gw
    )
    assert set(asyncio.run(_statuses(gw.url, 10, None))) == {401}
