"""Quota options an operator sets and the store must honour: `[quota] lease_ttl_s`, limit bounds.

How soon a crashed replica's concurrency slots come back is the operator's (`lease_ttl_s`).

The lease TTL was a constant (60 s, renewed every 10 s): a deployment whose replicas restart in
seconds could not free a crashed one's `max_concurrent` slots any sooner, nor one with long
event-loop stalls keep them any longer. The option reaches every tenant's limits and every store's
renewal period (a sixth of it). Real redis-server; "13 s without a renewal" is simulated by aging
the lease's score, as tests/quota/test_lease_renewal.py does.

A limit larger than the store computes exactly is refused at load: `rpm = 10^400` was read as
infinite, so the tenant ran with no limit and no word.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.redis_server import RedisServer
from gateway.config import ConfigError, load_settings
from gateway.metrics import GatewayMetrics
from gateway.quota import Reservation
from gateway.quota_gate import QuotaGate
from gateway.quota_redis import RedisQuotaStore
from gateway.tenancy import Tenants


def _settings(tmp_path: Path, url: str, prefix: str, ttl: str):  # type: ignore[no-untyped-def]
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(
        f'[quota]\nbackend = "redis"\nredis_url = "{url}"\nkey_prefix = "{prefix}"\n{ttl}\n'
        '[tenants.acme]\nkeys_sha256 = ["' + "ab" * 32 + '"]\nmax_concurrent = 1\n'
    )
    return load_settings(cfg)


async def test_a_shorter_lease_ttl_frees_a_crashed_replicas_slot_sooner(
    tmp_path: Path, redis_server: RedisServer, prefix: str
) -> None:
    s = _settings(tmp_path, redis_server.url, prefix, "lease_ttl_s = 12.0")
    limits = Tenants(s).by_name["acme"].limits
    assert limits.lease_ttl_s == 12.0
    crashed, live = QuotaGate(s.quota, GatewayMetrics()), QuotaGate(s.quota, GatewayMetrics())
    assert isinstance(live.shared, RedisQuotaStore)
    assert live.shared.lease_renew_s == 2.0  # a sixth of the TTL
    try:
        assert (await crashed.shared.admit(Reservation("acme", "a", "m", 1, limits))).allowed
        await crashed.shared.close()  # the replica dies: no settle, no renewal
        assert not (await live.shared.admit(Reservation("acme", "b", "m", 1, limits))).allowed
        key = live.shared.keys.leases("acme")
        await live.shared.client.zincrby(key, -13_000_000, "a")  # 13 s since its last renewal
        assert (await live.shared.admit(Reservation("acme", "b", "m", 1, limits))).allowed
    finally:
        await live.shared.close()


async def test_the_default_ttl_still_holds_a_lease_renewed_13_s_ago(
    tmp_path: Path, redis_server: RedisServer, prefix: str
) -> None:
    s = _settings(tmp_path, redis_server.url, prefix, "")
    limits = Tenants(s).by_name["acme"].limits
    assert limits.lease_ttl_s == 60.0
    gate = QuotaGate(s.quota, GatewayMetrics())
    try:
        assert (await gate.shared.admit(Reservation("acme", "a", "m", 1, limits))).allowed
        await gate.shared.client.zincrby(gate.shared.keys.leases("acme"), -13_000_000, "a")
        assert not (await gate.shared.admit(Reservation("acme", "b", "m", 1, limits))).allowed
    finally:
        await gate.shared.close()


@pytest.mark.parametrize("ttl", ["lease_ttl_s = 1.0", "lease_ttl_s = 86400.0"])
def test_a_lease_ttl_out_of_range_is_refused(tmp_path: Path, ttl: str) -> None:
    with pytest.raises(
        ConfigError, match=r"quota\.lease_ttl_s: Input should be (greater|less) than or equal"
    ):
        _settings(tmp_path, "redis://127.0.0.1:1/0", "p:", ttl)


@pytest.mark.parametrize(
    "field", ["rpm = 1" + "0" * 400, "tpm = 10000000000000000", "max_concurrent = 1" + "0" * 30]
)
def test_a_limit_too_large_to_enforce_is_refused_not_read_as_no_limit(
    tmp_path: Path, field: str
) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text('[tenants.acme]\nkeys_sha256 = ["' + "ab" * 32 + f'"]\n{field}\n')
    with pytest.raises(
        ConfigError, match=r"tenants\.acme\.\w+: Input should be less than or equal"
    ):
        load_settings(cfg)
