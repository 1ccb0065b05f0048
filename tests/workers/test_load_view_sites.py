"""Snapshots name a worker by name and URL: a reader counts a peer's load only into its own worker
of the same name at the same URL (a rollout that points a name at a new server has replicas on
both for a while), and keeps reading an older version's snapshots, which name workers alone, by
name. An older reader keeps reading this version's per-name sums."""

from __future__ import annotations

import orjson

from workers.load_view import (
    MAX_IN_FLIGHT,
    MAX_PREFILL_TOKENS,
    LoadView,
    decode_snapshot,
    encode_snapshot,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_loads_round_trip_per_name_and_url() -> None:
    raw = encode_snapshot(
        4,
        {
            ("w0", "http://old:8000"): (3, 300),
            ("w0", "http://new:8000"): (1, 50),
            ("w1", "http://w1:8000"): (0, 0),
        },
    )
    snap = decode_snapshot(raw)
    assert snap is not None and snap.seq == 4
    assert snap.sites == {("w0", "http://old:8000"): (3, 300), ("w0", "http://new:8000"): (1, 50)}
    assert snap.loads == {"w0": (4, 350)}


def test_an_older_reader_reads_the_per_name_sums() -> None:
    """What the previous version reads: version 1, ``seq``, and ``w`` as name -> [in flight,
    queued prefill] (it drops an entry of another shape, and ignores fields it does not know)."""
    raw = encode_snapshot(9, {("w0", "http://old"): (3, 300), ("w0", "http://new"): (1, 50)})
    doc = orjson.loads(raw)
    assert doc["v"] == 1 and doc["seq"] == 9 and doc["w"] == {"w0": [4, 350]}


def test_an_older_peers_snapshot_counts_by_name() -> None:
    old = orjson.dumps({"v": 1, "seq": 2, "w": {"w0": [2, 20]}})  # the previous version's bytes
    snap = decode_snapshot(old)
    assert snap is not None and snap.sites == {("w0", None): (2, 20)}
    view = LoadView("me", 3.0, clock=Clock())
    view.observe(
        {"old": old, "new": encode_snapshot(1, {("w0", "http://a"): (1, 10)})},
    )
    assert view.site_totals() == {("w0", None): (2, 20), ("w0", "http://a"): (1, 10)}
    assert view.totals() == {"w0": (3, 30)}


def test_site_totals_sum_live_peers_per_name_and_url_and_drop_expired_ones() -> None:
    clock = Clock()
    view = LoadView("me", 3.0, clock=clock)
    view.observe(
        {
            "me": encode_snapshot(1, {("w0", "http://a"): (50, 0)}),  # our own: never counted
            "p": encode_snapshot(1, {("w0", "http://a"): (2, 0), ("w0", "http://b"): (5, 0)}),
            "q": encode_snapshot(1, {("w0", "http://a"): (1, 7)}),
        }
    )
    assert view.site_totals() == {("w0", "http://a"): (3, 7), ("w0", "http://b"): (5, 0)}
    clock.t += 2.0
    view.observe({"p": encode_snapshot(2, {("w0", "http://b"): (5, 0)})})  # q stops
    clock.t += 2.0
    assert view.site_totals() == {("w0", "http://b"): (5, 0)}


def test_bad_url_entries_are_dropped_and_the_rest_stands() -> None:
    raw = orjson.dumps(
        {
            "v": 1,
            "seq": 3,
            "w": {"w0": [3, 0]},
            "u": [
                ["w0", "http://a", 2, 0],
                ["w0", 5, 1, 0],  # URL not a string
                ["w0", "http://b", -1, 0],  # a negative count
                ["w0", "http://c", True, 0],  # a bool is not a count
                ["w0", "http://d", 1],  # short
                "junk",
            ],
        }
    )
    snap = decode_snapshot(raw)
    assert snap is not None and snap.sites == {("w0", "http://a"): (2, 0)}
    # ``u`` of another shape (a later version's): the per-name sums count, by name.
    other = decode_snapshot(orjson.dumps({"v": 1, "seq": 3, "w": {"w0": [3, 0]}, "u": {}}))
    assert other is not None and other.sites == {("w0", None): (3, 0)}
    # A buggy peer's huge count is bounded as the per-name one is.
    big = decode_snapshot(
        orjson.dumps({"v": 1, "seq": 1, "w": {}, "u": [["w0", "http://a", 2**62, 2**62]]})
    )
    assert big is not None and big.sites[("w0", "http://a")] == (MAX_IN_FLIGHT, MAX_PREFILL_TOKENS)
