"""A half-open worker's trial budget counts trial requests, not what it still runs from before its
ejection; and a worker on trial still serves its models (`serving`) while its trial slots are
taken.

Review findings: a stream that outlived the ejection took the only trial slot, so no trial could
start until it ended (12 s, 23 requests refused meanwhile); and a worker whose trial ran left the
registry's answer to "who serves this model", so the gateway refused requests for it with 503.
"""

from __future__ import annotations

from tests.workers.test_protection import CARD, Clock, make
from workers.registry import Registry
from workers.worker import Health, Worker


def _half_open_with(in_flight: int, trials: int = 1) -> tuple[Registry, Worker, Clock]:
    """A worker ejected for failed requests while ``in_flight`` of its requests ran, then on
    trial."""
    clock = Clock()
    r = make(1, clock, unhealthy_after=2, backoff_initial_s=1, half_open_requests=trials)
    w = r.workers["w0"]
    w.in_flight = in_flight
    r.passive_failure("w0", "HTTP 502")
    r.passive_failure("w0", "HTTP 502")
    assert w.health is Health.UNHEALTHY
    clock.t += 1
    r.probe_ok("w0", CARD, None)
    assert w.health is Health.HALF_OPEN
    return r, w, clock


def test_requests_from_before_the_ejection_take_no_trial_slot() -> None:
    r, w, _ = _half_open_with(in_flight=1)
    assert r.candidates("m") == [w]  # the old stream is no trial: one may start
    assert r.trial_room(w) == 1
    w.in_flight += 1  # the trial request
    assert r.candidates("m") == [] and r.trial_room(w) == 0
    assert r.serving("m") == [w]  # on trial, taken: still the model's worker


def test_old_requests_that_end_before_the_trial_make_no_extra_room() -> None:
    r, w, _ = _half_open_with(in_flight=2, trials=1)
    assert r.candidates("m") == [w]
    w.in_flight = 1  # one old stream ended (no verdict: its client left)
    assert r.candidates("m") == [w]
    w.in_flight = 2  # the trial: the one slot is taken, though in_flight is what it was
    assert r.candidates("m") == [] and r.trial_room(w) == 0


def test_a_new_trial_period_counts_from_what_runs_when_it_begins() -> None:
    r, w, clock = _half_open_with(in_flight=0, trials=1)
    w.in_flight = 1
    r.passive_failure("w0", "HTTP 502")  # the trial failed: out again, held twice as long
    assert w.health is Health.UNHEALTHY and r.candidates("m") == []
    clock.t = w.ejected_until
    w.in_flight = 1  # e.g. another request from before, still streaming
    r.probe_ok("w0", CARD, None)
    assert w.health is Health.HALF_OPEN and r.candidates("m") == [w]
    r.passive_success("w0")
    assert w.health is Health.HEALTHY and r.candidates("m") == [w] == r.serving("m")


def test_serving_leaves_out_draining_and_down_workers() -> None:
    r, w, _ = _half_open_with(in_flight=0)
    r.drain("w0")
    assert r.serving("m") == [] and r.candidates("m") == []
    r.drain("w0", False)
    assert r.serving("m") == [w] and r.serving("other") == []
