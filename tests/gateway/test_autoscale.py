"""Autoscaling signals: the desired-workers formula, the sliding p95s, the collector, the deploy/
examples. Every clock is explicit, so nothing here depends on the speed of the machine."""

from __future__ import annotations

import itertools
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.autoscale import AutoscaleCollector, fleet_loads
from gateway.desired_workers import (
    AutoscaleSettings,
    DesiredWorkers,
    ModelLoad,
    WorkerLoad,
    request_tokens,
)
from gateway.window_quantile import WindowQuantile
from workers.registry import Registry
from workers.vllm_metrics import WorkerMetrics
from workers.worker import Health, WorkerSpec

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
M = "m"
REL = 0.01  # WindowQuantile's default relative error


def fleet(n: int, kv: float = 0.2, queued: int = 0, waiting: int = 0) -> dict[str, ModelLoad]:
    return {M: ModelLoad(tuple(WorkerLoad(kv, waiting=waiting) for _ in range(n)), queued)}


def ref_quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(1, math.ceil(q * len(s) - 1e-9)) - 1]


def close(est: float | None, ref: float) -> bool:
    """Within the sketch's guarantee: rel_err of the true order statistic, values at or below
    0.1 ms reported as 0."""
    assert est is not None
    return abs(est - ref) <= REL * ref + 1e-4 + 1e-12


# -- sliding-window p95 ----------------------------------------------------------------------------
def test_window_quantile_matches_sorted_reference_as_it_slides() -> None:
    rng = random.Random(7)
    w = WindowQuantile(window_s=60.0, slot_s=1.0)
    seen: list[tuple[float, float]] = []
    t = 0.0
    for i in range(6000):
        t += rng.expovariate(20.0)  # ~300 s of traffic at 20 req/s
        v = rng.lognormvariate(-1.0, 1.2) if i % 7 else 0.0
        w.observe(v, t)
        seen.append((t, v))
        if i % 250 == 0:
            live = [x for ts, x in seen if math.floor(t) - math.floor(ts) < 60]
            assert w.count(t) == len(live)
            for q in (0.5, 0.95, 0.99):
                assert close(w.quantile(q, t), ref_quantile(live, q)), (i, q)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=500.0, allow_nan=False), min_size=1, max_size=300),
    st.sampled_from([0.5, 0.9, 0.95, 0.99, 1.0]),
)
def test_window_quantile_property(values: list[float], q: float) -> None:
    w = WindowQuantile()
    for v in values:
        w.observe(v, 10.0)
    assert close(w.quantile(q, 10.5), ref_quantile(values, q))


def test_window_expires_old_samples_to_the_slot() -> None:
    w = WindowQuantile(window_s=60.0, slot_s=1.0)
    w.observe(100.0, 0.5)
    for t in (1.0, 30.0, 59.99):
        w.observe(1.0, t)
    assert w.count(59.99) == 4
    assert close(w.quantile(1.0, 59.99), 100.0)
    # Slot 0 leaves the window when slot 60 begins: the 100 s outlier is gone.
    assert w.count(60.0) == 3
    assert close(w.quantile(1.0, 60.0), 1.0)
    assert w.quantile(0.95, 200.0) is None and w.count(200.0) == 0


def test_window_out_of_order_and_too_old_samples() -> None:
    w = WindowQuantile(window_s=10.0, slot_s=1.0)
    w.observe(1.0, 20.0)
    w.observe(2.0, 15.5)  # earlier clock read, still in the window: counted in its own slot
    w.observe(3.0, 5.0)  # already outside: dropped
    assert w.count(20.0) == 2
    assert w.count(25.9) == 1  # slot 15 left the window, slot 20 is still in it
    w.observe(0.0, 25.0)
    assert w.quantile(0.5, 25.0) == 0.0  # a fast-path wait is reported as exactly 0


def test_window_since_counts_only_later_slots() -> None:
    w = WindowQuantile()
    for t in range(10):
        w.observe(5.0 if t < 5 else 1.0, float(t))
    assert w.count(9.5, since=5.0) == 5
    assert close(w.quantile(1.0, 9.5, since=5.0), 1.0)
    assert close(w.quantile(1.0, 9.5), 5.0)


def test_window_memory_is_bounded_whatever_the_rate() -> None:
    w = WindowQuantile(window_s=60.0, slot_s=1.0)
    rng = random.Random(3)
    for i in range(100_000):
        w.observe(rng.lognormvariate(0.0, 3.0), i / 100.0)  # 1,000 s at 100 samples/s
    slots = list(w._slots)
    assert len(slots) <= 60
    buckets = math.ceil(math.log(1e5 / 1e-4) / math.log(1.01 / 0.99)) + 2
    assert all(len(counts) <= buckets for _, counts in slots)
    assert w.count(1000.0) <= 60 * 100


# -- the formula ------------------------------------------------------------------------------------
def est(**kw: Any) -> DesiredWorkers:
    return DesiredWorkers(AutoscaleSettings(**kw), clock=lambda: pytest.fail("clock read"))


def one(d: DesiredWorkers, loads: dict[str, ModelLoad], now: float) -> Any:
    (sig,) = d.evaluate(loads, now)
    return sig


def test_first_evaluation_keeps_the_current_fleet() -> None:
    d = est()
    sig = one(d, fleet(5), 0.0)
    assert sig.desired_workers == 5 and sig.decision == "cooldown"
    assert sig.healthy_workers == 5
    d2 = est(min_workers=2, max_workers=3)
    assert one(d2, fleet(1), 0.0).desired_workers == 2
    assert one(est(max_workers=3), fleet(5), 0.0).desired_workers == 3


def test_scale_out_on_ttft_breach() -> None:
    d = est()
    one(d, fleet(4), 0.0)
    for i in range(20):
        d.observe_ttft(M, 2.9, now=1.0 + i / 10)  # target 2.0: r_ttft = 1.45
    sig = one(d, fleet(4), 5.0)
    assert sig.ratios["ttft"] == pytest.approx(1.45, rel=REL)
    assert sig.desired_workers == 6 and sig.decision == "scale_out"  # ceil(4 * 1.45)
    assert sig.ttft_p95_s == pytest.approx(2.9, rel=REL)


def test_latency_with_too_few_samples_does_not_scale() -> None:
    d = est(min_samples=10)
    for i in range(9):
        d.observe_ttft(M, 30.0, now=float(i))
        d.observe_queue_wait(M, 30.0, now=float(i))
    sig = one(d, fleet(4), 9.0)
    assert sig.ratios["ttft"] == 0.0 and sig.ratios["queue_wait"] == 0.0
    assert sig.desired_workers == 4
    assert sig.ttft_p95_s == pytest.approx(30.0, rel=REL)  # still exported


def test_scale_out_on_queue_wait() -> None:
    d = est()
    for i in range(100):  # p95 over all requests: 93 fast-path, 7 waited 2.5 s
        d.observe_queue_wait(M, 2.5 if i % 16 == 0 else 0.0, now=float(i) / 10)
    sig = one(d, fleet(4), 10.0)
    assert sig.queue_wait_p95_s == pytest.approx(2.5, rel=REL)
    assert sig.desired_workers == 8  # r_wait = 2.5, capped at doubling


def test_scale_out_on_queue_depth_counts_workers_own_queues() -> None:
    d = est()  # max_queue_per_worker = 4
    sig = one(d, fleet(4, queued=10, waiting=2), 0.0)  # 10 + 4 * 2 = 18 waiting
    assert sig.queue_depth == 18
    assert sig.ratios["queue"] == pytest.approx(18 / 16)
    assert sig.desired_workers == 5 and sig.decision == "scale_out"


def test_scale_out_on_kv_pressure() -> None:
    d = est()  # target_kv_usage = 0.8
    sig = one(d, fleet(4, kv=0.96), 0.0)
    assert sig.ratios["kv"] == pytest.approx(1.2)
    assert sig.kv_headroom == pytest.approx(0.04)
    assert sig.desired_workers == 5


def test_scale_out_bounded_by_doubling_and_max_workers() -> None:
    assert one(est(), fleet(3, queued=1000), 0.0).desired_workers == 6
    assert one(est(max_scale_out_factor=1.5), fleet(4, queued=1000), 0.0).desired_workers == 6
    assert one(est(max_workers=64), fleet(40, queued=10_000), 0.0).desired_workers == 64
    assert one(est(max_workers=10), fleet(1, queued=1000), 0.0).desired_workers == 2


def test_repeated_evaluations_do_not_compound_while_workers_start() -> None:
    d = est()
    sigs = [one(d, fleet(4, queued=1000), float(t)) for t in range(0, 300, 15)]
    assert {s.desired_workers for s in sigs} == {8}
    assert d.scale_events(M) == (1, 0)


def test_desired_never_drops_on_the_way_out() -> None:
    d = est()
    assert one(d, fleet(4, kv=1.0), 0.0).desired_workers == 5  # r = 1.25
    assert one(d, fleet(4, kv=0.84), 10.0).desired_workers == 5  # r = 1.05: target 5, holds
    assert one(d, fleet(4, kv=0.6), 20.0).desired_workers == 5  # in the band: holds


def test_latency_restarts_after_the_fleet_grows() -> None:
    d = est()
    one(d, fleet(4), 0.0)
    for i in range(20):
        d.observe_ttft(M, 2.9, now=1.0 + i / 10)
    assert one(d, fleet(4), 5.0).desired_workers == 6
    # The new workers are up 20 s later; the slow samples are still in the 60 s window but were
    # taken at the old size: they must not ask for ceil(6 * 1.45) = 9.
    sig = one(d, fleet(6), 25.0)
    assert sig.ratios["ttft"] == 0.0 and sig.desired_workers == 6
    assert sig.ttft_p95_s == pytest.approx(2.9, rel=REL)  # the gauge still shows the window
    for i in range(20):
        d.observe_ttft(M, 2.9, now=30.0 + i / 10)  # still slow at the new size: scale again
    assert one(d, fleet(6), 35.0).desired_workers == 9


def test_no_healthy_workers_with_demand_asks_for_one() -> None:
    d = est(min_workers=0)
    assert one(d, fleet(0), 0.0).desired_workers == 0
    sig = one(d, fleet(0, queued=3), 1.0)
    assert sig.desired_workers == 1 and sig.decision == "scale_out"
    assert sig.kv_headroom == 0.0 and sig.kv_free_tokens == 0
    d2 = est(min_workers=0)
    lease = d2.begin(M, 500, now=0.0)
    assert one(d2, fleet(0), 0.0).desired_workers == 1  # tokens in flight are demand too
    lease.end()
    assert one(est(min_workers=3), fleet(0, queued=1), 0.0).desired_workers == 3


def test_scale_in_after_cooldown_one_step_at_a_time_not_below_min() -> None:
    d = est(min_workers=2, scale_in_cooldown_s=300, scale_in_step=1)
    history = []
    for t in range(0, 3000, 10):
        sig = one(d, fleet(5, kv=0.05), float(t))
        history.append((t, sig.desired_workers))
    desired = dict(history)
    assert desired[0] == 5 and desired[290] == 5
    assert desired[300] == 4 and desired[590] == 4  # each step restarts the cooldown
    assert desired[600] == 3 and desired[900] == 2
    assert desired[2990] == 2  # min_workers
    steps = [b - a for (_, a), (_, b) in itertools.pairwise(history) if a != b]
    assert steps == [-1, -1, -1]
    assert d.scale_events(M) == (0, 3)


def test_scale_in_step_is_configurable_and_to_zero_needs_no_demand() -> None:
    d = est(min_workers=0, scale_in_step=2, scale_in_cooldown_s=60)
    one(d, fleet(4, kv=0.0), 0.0)
    assert one(d, fleet(4, kv=0.0), 60.0).desired_workers == 2
    assert one(d, fleet(2, kv=0.0), 120.0).desired_workers == 0
    d2 = est(min_workers=0, scale_in_cooldown_s=60)
    one(d2, fleet(1, kv=0.0), 0.0)
    held = d2.begin(M, 10, now=1.0)
    assert one(d2, fleet(1, kv=0.0), 100.0).desired_workers == 1  # a request is in flight
    held.end()
    held.end()  # idempotent
    assert d2.tokens_in_flight(M) == 0
    assert one(d2, fleet(1, kv=0.0), 200.0).desired_workers == 0


def test_scale_in_waits_for_an_empty_admission_queue() -> None:
    d = est(scale_in_cooldown_s=100)
    for t in range(0, 500, 10):  # one queued request on 4 workers: r_queue tiny, queue not empty
        assert one(d, fleet(4, queued=1), float(t)).desired_workers == 4


def test_scale_in_refused_when_the_rest_would_run_hot() -> None:
    d = est(scale_in_cooldown_s=100)  # scale_in_max_projected = 0.8
    for t in range(0, 1000, 10):  # kv 0.36 -> r 0.45 < 0.5, but on 1 worker it would be 0.9
        sig = one(d, fleet(2, kv=0.36), float(t))
        assert sig.desired_workers == 2
    assert sig.decision == "cooldown"


def test_the_band_restarts_the_cooldown() -> None:
    d = est(scale_in_cooldown_s=300)
    for t in range(0, 200, 10):
        one(d, fleet(4, kv=0.1), float(t))
    assert one(d, fleet(4, kv=0.6), 200.0).decision == "hold"  # r = 0.75: in the band
    for t in range(210, 500, 10):
        assert one(d, fleet(4, kv=0.1), float(t)).desired_workers == 4
    assert one(d, fleet(4, kv=0.1), 510.0).desired_workers == 3


def test_hysteresis_prevents_flapping_under_oscillating_load() -> None:
    """Demand swings between 5 and 1 worker-equivalents every minute; the fleet follows the
    desired count 30 s late. A proportional controller would chase it (5, 1, 5, ...); this one
    scales out once and stays."""
    d = est()
    n, target_at = 4, None
    desired_seen = [n]
    for t in range(0, 7200, 5):
        demand = 5.0 if (t // 60) % 2 == 0 else 1.0
        kv = min(1.0, 0.8 * demand / n)
        sig = one(d, fleet(n, kv=kv), float(t))
        desired_seen.append(sig.desired_workers)
        if sig.desired_workers != n and target_at is None:
            target_at = t + 30
        if target_at is not None and t >= target_at:
            n, target_at = sig.desired_workers, None
    changes = sum(1 for a, b in itertools.pairwise(desired_seen) if a != b)
    assert desired_seen[-1] == 5 and changes == 1
    assert d.scale_events(M) == (1, 0)


def test_slow_oscillation_scales_in_only_after_sustained_calm() -> None:
    """Busy for 10 min, idle for 20 min: one scale-out, then at most one step in per cooldown."""
    d = est(scale_in_cooldown_s=300)
    out = []
    for t in range(0, 3600, 10):
        busy = (t // 600) % 3 == 0
        out.append(one(d, fleet(4, kv=1.0 if busy else 0.05), float(t)).desired_workers)
    assert max(out) == 5
    drops = [i for i in range(1, len(out)) if out[i] < out[i - 1]]
    assert all(b - a >= 30 for a, b in itertools.pairwise(drops))  # >= 300 s apart


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        AutoscaleSettings(min_workers=5, max_workers=2)
    with pytest.raises(ValueError):
        AutoscaleSettings(scale_in_below=1.0)
    with pytest.raises(ValueError):
        AutoscaleSettings(max_scale_out_factor=1.0)
    with pytest.raises(ValueError):
        AutoscaleSettings(target_ttft_p95_s=0.0)


def test_configure_applies_at_the_next_evaluation() -> None:
    d = est()
    one(d, fleet(4), 0.0)
    d.configure(AutoscaleSettings(max_workers=3))
    assert one(d, fleet(4), 1.0).desired_workers == 3


# -- tokens in flight and KV ------------------------------------------------------------------------
def test_tokens_in_flight_and_stale_leases() -> None:
    d = est(in_flight_max_age_s=100)
    a = d.begin(M, 300, now=0.0)
    d.begin(M, 200, now=50.0)
    d.begin("other", 7, now=0.0)
    assert d.tokens_in_flight(M) == 500
    a.end()
    a.end()
    assert d.tokens_in_flight(M) == 200
    sigs = {s.model: s for s in d.evaluate(fleet(2), 120.0)}
    assert sigs[M].tokens_in_flight == 200
    assert "other" not in sigs  # its only lease was older than the max age: swept and forgotten
    assert one(d, fleet(2), 151.0).tokens_in_flight == 0


def test_request_tokens() -> None:
    assert request_tokens(100, {"max_tokens": 50}) == 150
    assert request_tokens(100, {"max_completion_tokens": 20, "max_tokens": 50}) == 120
    assert request_tokens(100, {"max_tokens": 50}, max_out=30) == 130
    assert request_tokens(100, {"max_tokens": True}) == 100
    assert request_tokens(100, {}) == 100


def test_kv_is_capacity_weighted_when_sizes_are_known() -> None:
    big = WorkerLoad(0.5, num_blocks=3000, block_size=16)
    small = WorkerLoad(0.9, num_blocks=1000, block_size=16)
    sig = one(est(), {M: ModelLoad((big, small))}, 0.0)
    assert sig.kv_free_tokens == int(3000 * 16 * 0.5 + 1000 * 16 * 0.1)
    assert sig.kv_usage == pytest.approx(1 - (24000 + 1600) / 64000)
    unknown = WorkerLoad(0.9)
    sig = one(est(), {M: ModelLoad((big, unknown))}, 0.0)
    assert sig.kv_free_tokens is None and sig.kv_usage == pytest.approx(0.7)


def test_fleet_loads_from_registry_and_admission() -> None:
    reg = Registry(
        [WorkerSpec("a", "http://a"), WorkerSpec("b", "http://b"), WorkerSpec("c", "http://c")]
    )
    metrics = WorkerMetrics(running=3, waiting=2, kv_usage=0.5, block_size=16, num_blocks=100)
    for name in ("a", "b", "c"):
        reg.probe_ok(name, [{"id": "m"}] if name != "c" else [{"id": "m2"}], metrics)
    reg.workers["b"].health = Health.UNHEALTHY
    reg.workers["c"].health = Health.UNHEALTHY

    class Admission:
        def pools(self) -> list[str]:
            return ["m", "queued-only"]

        def depth_by_tier(self, pool: str | None = None) -> dict[int, int]:
            return {0: 2, 5: 1} if pool == "m" else {}

    loads = fleet_loads(reg, Admission())  # type: ignore[arg-type]
    assert set(loads) == {"m", "m2", "queued-only"}
    assert loads["m"].queued == 3 and len(loads["m"].workers) == 1
    assert loads["m"].workers[0] == WorkerLoad(0.5, 100, 16, 2)
    assert loads["m2"].workers == ()  # its only worker is down: N = 0, still reported


# -- the collector ----------------------------------------------------------------------------------
def scrape(reg: CollectorRegistry) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    text = generate_latest(reg).decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_collector_exports_every_signal() -> None:
    t = [0.0]
    d = DesiredWorkers(clock=lambda: t[0])
    calls = []
    loads = {
        M: ModelLoad((WorkerLoad(0.5, 1000, 16, waiting=1), WorkerLoad(0.7, 1000, 16)), queued=4),
        "idle": ModelLoad((WorkerLoad(0.1),)),
    }

    def snapshot() -> dict[str, ModelLoad]:
        calls.append(1)
        return loads

    reg = CollectorRegistry(auto_describe=True)
    reg.register(AutoscaleCollector(d, snapshot))
    assert calls == []  # registering describes; it must not evaluate
    for i in range(20):
        d.observe_ttft(M, 3.0 if i == 0 else 0.5, now=0.1 * i)
        d.observe_queue_wait(M, 0.0, now=0.1 * i)
    lease = d.begin(M, 1234, now=1.0)
    t[0] = 5.0
    got = scrape(reg)
    m = (("model", M),)
    assert got["kvgate_autoscale_queue_depth"][m] == 5
    assert got["kvgate_autoscale_ttft_p95_seconds"][m] == pytest.approx(0.5, rel=REL)
    assert got["kvgate_autoscale_queue_wait_p95_seconds"][m] == 0.0
    assert got["kvgate_autoscale_kv_headroom"][m] == pytest.approx(0.4)
    assert got["kvgate_autoscale_kv_free_tokens"][m] == 16000 * 0.5 + 16000 * 0.3
    assert got["kvgate_autoscale_tokens_in_flight"][m] == 1234
    assert got["kvgate_autoscale_healthy_workers"][m] == 2
    assert got["kvgate_autoscale_desired_workers"][m] == 2
    assert got["kvgate_autoscale_pressure"][(("model", M), ("signal", "kv"))] == pytest.approx(0.75)
    assert got["kvgate_autoscale_scale_events_total"][(("direction", "out"), ("model", M))] == 0
    idle = (("model", "idle"),)
    assert got["kvgate_autoscale_desired_workers"][idle] == 1
    assert idle not in got.get("kvgate_autoscale_ttft_p95_seconds", {})  # no samples: absent
    assert idle not in got.get("kvgate_autoscale_kv_free_tokens", {})  # cache size unknown
    assert len(calls) == 1
    lease.end()
    loads[M] = ModelLoad(loads[M].workers, queued=40)
    t[0] = 6.0
    got = scrape(reg)
    assert got["kvgate_autoscale_desired_workers"][m] == 4
    assert got["kvgate_autoscale_tokens_in_flight"][m] == 0
    assert got["kvgate_autoscale_scale_events_total"][(("direction", "out"), ("model", M))] == 1


def test_collector_failure_does_not_break_the_scrape() -> None:
    def broken() -> dict[str, ModelLoad]:
        raise RuntimeError("boom")

    reg = CollectorRegistry(auto_describe=True)
    reg.register(AutoscaleCollector(DesiredWorkers(clock=lambda: 0.0), broken))
    assert scrape(reg) == {}


# -- deploy/ and README -----------------------------------------------------------------------------
def exported_names() -> set[str]:
    """Family names (a counter's without ``_total``)."""
    return {f.name for f in AutoscaleCollector(DesiredWorkers(), dict).describe()}


def test_deploy_examples_are_valid_yaml_and_consume_the_gauge() -> None:
    keda = yaml.safe_load((DEPLOY / "keda-scaledobject.yaml").read_text())
    assert keda["apiVersion"] == "keda.sh/v1alpha1" and keda["kind"] == "ScaledObject"
    (trig,) = keda["spec"]["triggers"]
    # AverageValue with threshold 1: the HPA KEDA drives sets replicas = ceil(desired / 1).
    assert trig["type"] == "prometheus" and trig["metricType"] == "AverageValue"
    assert trig["metadata"]["threshold"] == "1"
    assert "kvgate_autoscale_desired_workers{" in trig["metadata"]["query"]
    s = AutoscaleSettings()
    assert keda["spec"]["minReplicaCount"] == s.min_workers
    assert keda["spec"]["maxReplicaCount"] == s.max_workers

    hpa = yaml.safe_load((DEPLOY / "hpa.yaml").read_text())
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter.yaml").read_text())
    rules = adapter["rules"]["external"]
    names = {r["name"]["as"] for r in rules}
    assert metric["external"]["metric"]["name"] in names
    for r in rules:
        assert r["resources"] == {"namespaced": False}
        assert "kvgate_autoscale_desired_workers" in r["seriesQuery"]


def test_every_kvgate_autoscale_name_in_docs_exists() -> None:
    exported = exported_names()
    texts = [p.read_text() for p in DEPLOY.glob("*.yaml")]
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Autoscaling") :]
    found = re.findall(r"kvgate_autoscale_[a-z0-9_]+", "\n".join([*texts, section]))
    mentioned = {re.sub(r"_total$", "", n) for n in found}
    assert mentioned and mentioned <= exported, mentioned - exported
    # The README's section names every series the collector exports.
    section_names = {
        re.sub(r"_total$", "", n) for n in re.findall(r"kvgate_autoscale_\w+", section)
    }
    assert exported <= section_names, exported - section_names


async def test_a_running_gateway_exports_the_signals_per_model() -> None:
    """Wired into the walk: TTFT, queue wait and tokens in flight come from real requests."""
    import httpx

    from tests.gateway.conftest import MODEL, run_gateway, settings_for
    from tests.support.sim_workers import run_sim_workers

    async with (
        run_sim_workers(2, profile="fast") as fleet,
        run_gateway(settings_for(list(fleet))) as g,
        httpx.AsyncClient() as c,
    ):
        await g.wait_healthy(2)
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True}
        for _ in range(12):
            r = await c.post(g.url + "/v1/completions", json=body)
            assert r.status_code == 200
        m = await g.metrics()
    label = f'{{model="{MODEL}"}}'
    assert m[f"kvgate_autoscale_healthy_workers{label}"] == 2
    assert m[f"kvgate_autoscale_desired_workers{label}"] >= 1
    assert m[f"kvgate_autoscale_ttft_p95_seconds{label}"] > 0
    assert m[f"kvgate_autoscale_queue_wait_p95_seconds{label}"] == 0  # nothing queued
    assert m[f"kvgate_autoscale_tokens_in_flight{label}"] == 0  # all settled
