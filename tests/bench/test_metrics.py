"""Percentile math, SLOs and the small helpers every report uses."""

from __future__ import annotations

import math
import random

import pytest

from bench.metrics import SLO, balance, dist, nearest_rank, tpot
from workers.sim.vclock import percentile


def test_nearest_rank_on_known_values() -> None:
    v = list(range(1, 101))  # 1..100
    d = dist(v)
    assert (d["p50"], d["p90"], d["p95"], d["p99"], d["max"]) == (50, 90, 95, 99, 100)
    assert d["mean"] == 50.5 and d["count"] == 100
    assert dist([7.0])["p99"] == 7.0
    # Nearest rank never interpolates: every percentile is a value some request had.
    d = dist([1.0, 2.0, 10.0])
    assert d["p50"] == 2.0 and d["p90"] == 10.0


def test_empty_distributions_are_none_not_zero() -> None:
    d = dist([])
    assert d["mean"] is None and d["p99"] is None and d["count"] == 0
    assert math.isnan(nearest_rank([], 50))


def test_same_definition_as_the_virtual_clock() -> None:
    rng = random.Random(4)
    for n in (1, 2, 3, 10, 99, 1000):
        v = [rng.expovariate(1.0) for _ in range(n)]
        s = sorted(v)
        for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
            assert nearest_rank(s, q) == percentile(v, q)


def test_slo_and_tpot() -> None:
    slo = SLO(ttft=1.0, tpot=0.05)
    assert slo.met(0.5, 0.04, 10.0)
    assert not slo.met(1.5, 0.04, 10.0)
    assert not slo.met(0.5, 0.06, 10.0)
    assert slo.met(0.5, None, 0.5)  # single-token output: TPOT unconstrained
    assert not slo.met(None, None, None)  # failed requests are never good
    assert not SLO(ttft=None, tpot=None, e2e=2.0).met(0.1, 0.01, 3.0)
    assert slo.describe() == "TTFT <= 1 s, TPOT <= 0.05 s"
    assert tpot(2.0, 1.0, 11) == pytest.approx(0.1)
    assert tpot(2.0, 1.0, 1) is None and tpot(None, 1.0, 5) is None


def test_balance() -> None:
    assert balance([5, 5, 5, 5]) == 1.0
    assert balance([20, 0, 0, 0]) == 4.0
    assert balance([]) is None and balance([0, 0]) is None
