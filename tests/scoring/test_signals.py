from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scoring.kv_aware import KVAware
from scoring.signals import (
    affinity_yield,
    is_saturated,
    kv_capacity_tokens,
    kv_pressure,
    load_estimate,
    prefix_signal,
    queue_signal,
    queued_requests,
    session_signal,
    tenant_signal,
)
from scoring.views import RouteRequest, RoutingOptions, WorkerView

OPTS = RoutingOptions()


def test_queue_counts_the_gateways_sends_since_the_last_scrape() -> None:
    scraped = WorkerView("a", in_flight=3, running=3, waiting=1, in_flight_at_scrape=3)
    burst = WorkerView("a", in_flight=9, running=3, waiting=1, in_flight_at_scrape=3)
    drained = WorkerView("a", in_flight=1, running=3, waiting=1, in_flight_at_scrape=3)
    assert queued_requests(scraped) == 1
    assert queued_requests(burst) == 7  # 1 waiting + 6 sent since the scrape
    assert queued_requests(drained) == 0  # 2 finished since: the waiting one has started
    # without the scrape-time count, our own excess over `running` is still queued somewhere
    assert queued_requests(WorkerView("a", in_flight=5, running=2)) == 3


def test_wait_uses_the_larger_of_the_count_and_the_size_aware_backlog() -> None:
    few_big = WorkerView("a", waiting=1, prefill_tokens=32_000)
    many_small = WorkerView("a", waiting=10, prefill_tokens=500)
    wait_big, _, _ = load_estimate(few_big, OPTS)
    wait_small, _, _ = load_estimate(many_small, OPTS)
    assert wait_big == pytest.approx(32_000 / OPTS.prefill_tokens_per_s)
    assert wait_small == pytest.approx(10 * OPTS.mean_prompt_tokens / OPTS.prefill_tokens_per_s)
    # a worker twice as big drains its queue twice as fast
    double, _, _ = load_estimate(WorkerView("a", waiting=10, prefill_tokens=500, weight=2.0), OPTS)
    assert double == pytest.approx(wait_small / 2)


def test_kv_estimate_adds_what_was_sent_since_the_scrape() -> None:
    w = WorkerView("a", kv_usage=0.5, num_blocks=100, block_size=16, sent_tokens_since_scrape=400)
    _, _, kv = load_estimate(w, OPTS)
    assert kv == pytest.approx(0.75)
    assert kv_capacity_tokens(w) == 1600
    assert kv_pressure(kv, 800, 1600) == 1.0  # capped
    assert kv_pressure(0.2, 160, 1600) == pytest.approx(0.3)
    assert kv_pressure(0.2, 10_000, None) == 0.2  # no capacity known: scraped usage only
    assert kv_pressure(0.2, 160, 1600, fill=0.7) == pytest.approx(0.8)  # cached prefixes count


@given(st.floats(0, 1e4), st.floats(0, 1e4))
def test_queue_signal_is_bounded_and_monotone(a: float, b: float) -> None:
    qa, qb = queue_signal(a, 0.5), queue_signal(b, 0.5)
    assert 0.0 <= qa < 1.0
    if a < b:
        assert qa <= qb
    assert queue_signal(0.5, 0.5) == pytest.approx(0.5)


def test_prefix_share_is_relative_to_the_whole_prompt() -> None:
    assert prefix_signal(4096, 32_000) == pytest.approx(0.128)
    assert prefix_signal(160, 100) == 1.0
    assert prefix_signal(0, 100) == 0.0 and prefix_signal(10, 0) == 0.0


def test_affinity_yield_reaches_zero_at_the_ttft_break_even() -> None:
    saved = 0.2
    assert affinity_yield(0.0, saved, 1.0) == 1.0
    assert affinity_yield(0.1, saved, 1.0) == pytest.approx(0.5)
    assert affinity_yield(0.2, saved, 1.0) == 0.0
    assert affinity_yield(0.2, saved, 2.0) == pytest.approx(0.5)
    assert affinity_yield(0.01, 0.0, 1.0) == 0.0


def test_session_and_tenant_signals() -> None:
    assert session_signal(0.0, 0.5) == 1.0 and session_signal(0.25, 0.5) == 0.5
    assert session_signal(5.0, 0.5) == 0.0
    assert tenant_signal(1.0, 0.2) == pytest.approx(0.8)
    assert tenant_signal(0.0, 0.2) == 0.0 and tenant_signal(7.0, 0.0) == 1.0


def test_saturation_thresholds() -> None:
    assert is_saturated(8, 0.1, OPTS) and is_saturated(0, 0.9, OPTS)
    assert not is_saturated(7, 0.89, OPTS)


def test_kv_aware_scores_agree_with_the_documented_signal_functions() -> None:
    """The scorer inlines the formulas for speed; this pins it to scoring.signals."""
    rng = random.Random(3)
    p = KVAware(rng=random.Random(0))
    chain = tuple(range(1, 41))
    p.state.index.record("w0", chain[:30])
    p.state.index.record("w1", chain[:10])
    p.state.sessions.put("s", "w2", now=p._clock())
    for _ in range(50):
        views = [
            WorkerView(
                f"w{i}",
                in_flight=rng.randint(0, 6),
                running=rng.randint(0, 6),
                waiting=rng.randint(0, 3),
                kv_usage=rng.uniform(0, 0.8),
                block_size=16,
                num_blocks=rng.choice([None, 5_000]),
                in_flight_at_scrape=rng.choice([None, 2]),
                prefill_tokens=rng.randint(0, 3_000),
            )
            for i in range(4)
        ]
        req = RouteRequest(
            "m",
            chain=chain,
            block_tokens=16.0,
            prompt_tokens=1_000,
            tenant_priority=rng.random(),
            session_id="s",
        )
        d = p.choose(views, req)
        loads = {w.name: load_estimate(w, OPTS) for w in views}
        ok = [n for n, (_wt, q, kv) in loads.items() if not is_saturated(q, kv, OPTS)] or list(
            loads
        )
        best_wait = min(loads[n][0] for n in ok)
        wait, _q, kv = loads[d.worker.name]
        m = d.matched_blocks
        q = queue_signal(wait, OPTS.queue_horizon_s)
        prefix = prefix_signal(m * 16.0, 1_000)
        eff = prefix * affinity_yield(
            wait - best_wait, m * 16 / OPTS.prefill_tokens_per_s, OPTS.affinity_slack
        )
        fill = p.state.index.fill.get(d.worker.name, 0.0)
        kvp = kv_pressure(kv, 1_000 - m * 16, kv_capacity_tokens(d.worker), fill)
        sess = (
            session_signal(wait - best_wait, OPTS.queue_horizon_s) if d.worker.name == "w2" else 0
        )
        s = d.scores
        assert s["queue"] == pytest.approx(q) and s["kv"] == pytest.approx(kvp)
        assert s["prefix"] == pytest.approx(prefix) and s["affinity"] == pytest.approx(eff)
        assert s["tenant"] == pytest.approx(tenant_signal(req.tenant_priority, q))
        assert s["session"] == pytest.approx(sess)
        expected = 0.45 * eff - 0.25 * q - 0.2 * kvp + 0.1 * s["tenant"] + 0.15 * sess
        assert s["score"] == pytest.approx(expected)
