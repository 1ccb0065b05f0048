import random
from collections import Counter

import pytest

from scoring.policy import LeastLoaded, RoundRobin, make_policy
from scoring.views import RouteRequest, WorkerView

REQ = RouteRequest(model="m")


def test_round_robin_cycles_through_candidates() -> None:
    ws = [WorkerView(name=n) for n in "abc"]
    p = RoundRobin()
    assert [p.choose(ws, REQ).worker.name for _ in range(6)] == list("abcabc")


def test_least_loaded_prefers_fewest_outstanding_requests_per_weight() -> None:
    ws = [
        WorkerView(name="busy", in_flight=5),
        WorkerView(name="scraped-busy", in_flight=0, running=3, waiting=4),
        WorkerView(name="big", in_flight=4, weight=4.0),
        WorkerView(name="idle-ish", in_flight=2),
    ]
    assert LeastLoaded().choose(ws, REQ).worker.name == "big"


def test_least_loaded_breaks_ties_at_random_not_by_order() -> None:
    ws = [WorkerView(name=n) for n in "abcd"]
    p = LeastLoaded(random.Random(7))
    counts = Counter(p.choose(ws, REQ).worker.name for _ in range(400))
    assert set(counts) == set("abcd")
    assert min(counts.values()) > 50


def test_unknown_policy_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope")
    with pytest.raises(ValueError):
        RoundRobin().choose([], REQ)
