"""The shared load view's pure core: snapshot encoding, liveness on the reader's clock, sums."""

from __future__ import annotations

import orjson

from scoring.signals import queued_requests
from workers.load_view import LoadView, decode_snapshot, encode_snapshot
from workers.registry import Registry
from workers.vllm_metrics import WorkerMetrics
from workers.worker import WorkerSpec


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_snapshot_round_trip_leaves_idle_workers_out() -> None:
    raw = encode_snapshot(7, {"w0": (3, 1200), "w1": (0, 0), "w2": (0, 50)})
    snap = decode_snapshot(raw)
    assert snap is not None
    assert snap.seq == 7
    assert snap.loads == {"w0": (3, 1200), "w2": (0, 50)}


def test_undecodable_snapshots_are_skipped_not_trusted() -> None:
    assert decode_snapshot(b"not json") is None
    assert decode_snapshot(orjson.dumps({"v": 2, "seq": 1, "w": {}})) is None  # newer version
    assert decode_snapshot(orjson.dumps({"v": 1, "w": {}})) is None
    # A bad entry is dropped, the rest of the snapshot stands.
    snap = decode_snapshot(orjson.dumps({"v": 1, "seq": 3, "w": {"a": [1, 2], "b": [-1, 0]}}))
    assert snap is not None and snap.loads == {"a": (1, 2)}
    view = LoadView("me", 3.0, clock=Clock())
    view.observe({"peer": b"\xff garbage"})
    assert view.malformed == 1 and view.totals() == {}


def test_sums_over_peers_and_excludes_self() -> None:
    clock = Clock()
    view = LoadView("me", 3.0, clock=clock)
    view.observe(
        {
            "me": encode_snapshot(1, {"w0": (100, 100)}),  # our own field: never counted
            "a": encode_snapshot(1, {"w0": (2, 300), "w1": (1, 10)}),
            "b": encode_snapshot(5, {"w0": (3, 700)}),
        }
    )
    assert view.totals() == {"w0": (5, 1000), "w1": (1, 10)}
    assert view.live() == ["a", "b"]


def test_a_peer_whose_heartbeat_stops_expires_on_the_readers_clock() -> None:
    clock = Clock()
    view = LoadView("me", 3.0, clock=clock)
    for step in range(5):  # a moves every tick, b froze at seq 1 (killed)
        view.observe(
            {
                "a": encode_snapshot(step + 1, {"w0": (1, 0)}),
                "b": encode_snapshot(1, {"w0": (4, 0)}),
            }
        )
        clock.t += 1.0
    # b last moved at t=100, now t=105: past expiry; a moved at t=104.
    assert view.totals() == {"w0": (1, 0)}
    assert view.live() == ["a"] and view.expired() == ["b"]
    # b comes back (a new write): counted again at once.
    view.observe({"a": encode_snapshot(9, {}), "b": encode_snapshot(2, {"w0": (4, 0)})})
    assert view.totals() == {"w0": (4, 0)}


def test_without_fresh_reads_everything_lapses_after_expiry() -> None:
    """The store down: no reads at all. Remote load is trusted for expiry_s, then dropped, so a
    replica never routes on counts that only grow staler."""
    clock = Clock()
    view = LoadView("me", 3.0, clock=clock)
    view.observe({"a": encode_snapshot(1, {"w0": (6, 600)})})
    clock.t += 2.9
    assert view.totals() == {"w0": (6, 600)}
    clock.t += 0.2
    assert view.totals() == {}


def test_a_peer_missing_from_a_read_is_kept_until_it_expires() -> None:
    """A Redis that restarted empty has every live replica's field back within an interval; until
    then the fleet-wide limits must not read 'nobody else is busy'. (A peer seen alive: moving
    here; one seen once and undated is not kept, test_load_view_new_reader.py.)"""
    clock = Clock()
    view = LoadView("me", 3.0, clock=clock)
    view.observe({"a": encode_snapshot(1, {"w0": (6, 0)})})
    clock.t += 0.05
    view.observe({"a": encode_snapshot(2, {"w0": (6, 0)})})
    clock.t += 0.05
    view.observe({})
    assert view.totals() == {"w0": (6, 0)}


def test_long_dead_peers_are_forgotten() -> None:
    clock = Clock()
    view = LoadView("me", 1.0, clock=clock)
    view.observe({"a": encode_snapshot(1, {"w0": (1, 0)})})
    clock.t += 11.0
    view.observe({})
    assert view.peers == {} and view.expired() == []


def test_worker_view_counts_remote_load_and_in_flight_stays_local() -> None:
    reg = Registry([WorkerSpec("w0", "http://x")])
    w = reg.workers["w0"]
    w.in_flight, w.prefill_tokens = 2, 100
    v1 = w.view()
    assert (v1.in_flight, v1.prefill_tokens) == (2, 100)
    w.remote_in_flight, w.remote_prefill_tokens = 5, 900
    v2 = w.view()
    assert v2 is not v1  # the memoised view notices remote changes
    assert (v2.in_flight, v2.prefill_tokens) == (7, 1000)
    assert w.in_flight == 2  # what this replica must release
    # A scrape records the whole gateway's in-flight, so the queue estimate counts only what
    # was dispatched since (here: nothing), on top of what the worker reported waiting.
    reg.probe_ok("w0", None, WorkerMetrics(running=4, waiting=3))
    v3 = w.view()
    assert v3.in_flight_at_scrape == 7
    assert queued_requests(v3) == 3
    w.remote_in_flight += 2  # two more dispatched by peers since the scrape
    assert queued_requests(w.view()) == 5
