"""BatchedHistogram (gateway.metrics) must expose exactly what Histogram.observe would: it writes
into prometheus_client's private values, so a library change that moves them fails here."""

from __future__ import annotations

import math
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.metrics import BatchedHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


def pair() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    ra, rb = CollectorRegistry(), CollectorRegistry()
    a = Histogram("gap_seconds", "gaps", ["model"], buckets=BUCKETS, registry=ra)
    b = Histogram("gap_seconds", "gaps", ["model"], buckets=BUCKETS, registry=rb)
    return ra, a, rb, b


def test_same_exposition_as_observe_including_bounds_and_overflow() -> None:
    ra, a, rb, b = pair()
    rng = random.Random(3)
    values = [rng.choice([0.0, 0.001, 0.01, 1.0, 7.5]) for _ in range(50)]
    values += [rng.expovariate(20) for _ in range(300)]
    batched = BatchedHistogram(b.labels("m"))
    for v in values:
        a.labels("m").observe(v)
        batched.observe(v)
    batched.flush()
    batched.flush()  # idempotent
    want, got = series(ra), series(rb)
    # The sum is added in another order: equal up to float rounding.
    assert math.isclose(want.pop("gap_seconds_sum"), got.pop("gap_seconds_sum"), rel_tol=1e-12)
    assert got == want and got["gap_seconds_count"] == len(values)


def series(r: CollectorRegistry) -> dict[str, float]:
    """Every sample but the creation time, by name and `le`."""
    return {
        s.name + s.labels.get("le", ""): s.value
        for fam in r.collect()
        for s in fam.samples
        if not s.name.endswith("_created")
    }


def test_observations_reach_a_scrape_before_the_stream_ends() -> None:
    _ra, _a, rb, b = pair()
    batched = BatchedHistogram(b.labels("m"))
    for _ in range(100):
        batched.observe(0.02)
    text = generate_latest(rb).decode()
    assert 'gap_seconds_count{model="m"} 64.0' in text  # one batch flushed, 36 still local
    batched.flush()
    assert 'gap_seconds_count{model="m"} 100.0' in generate_latest(rb).decode()


def test_batched_counters_and_gauges_show_every_write_at_collection() -> None:
    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    w = m.child(m.in_flight, "w0")
    w.set(3)
    w.inc()
    w.set(5)  # a set replaces what came before it ...
    w.inc(2)
    w.dec()  # ... and moves after it add up
    for _ in range(3):
        m.child(m.requests, "sim", "w0", "200").inc()
    m.child(m.tenant_tokens, "a", "reserved").inc(40)
    get = m.registry.get_sample_value
    assert get("kvgate_worker_in_flight", {"worker": "w0"}) == 6
    assert get("kvgate_requests_total", {"model": "sim", "worker": "w0", "status": "200"}) == 3
    assert get("kvgate_tenant_tokens_total", {"tenant": "a", "kind": "reserved"}) == 40
    assert (
        get("kvgate_worker_in_flight", {"worker": "w0"}) == 6
    )  # collecting again adds nothing twice
    child = m.requests.labels("sim", "w0", "200")
    m.child(m.requests, "sim", "w0", "200").inc()
    # A removed worker's pending counts are flushed on the way out, then its series go.
    m.forget_worker("w0", [])
    assert child._value.get() == 4
    assert get("kvgate_requests_total", {"model": "sim", "worker": "w0", "status": "200"}) is None


def test_a_batched_counter_refuses_to_go_down_as_prometheus_does() -> None:
    import pytest

    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    with pytest.raises(ValueError, match="non-negative"):
        m.child(m.requests, "sim", "w0", "200").inc(-1)
