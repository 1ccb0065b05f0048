"""A reader that has just started (a supervisor's restart of a SIGKILLed replica) and the dead
replica's snapshot it finds in the store. Before, it took that snapshot for a live peer's for a
full ``expiry_s`` of its own, and kept it after a sibling deleted the field: phantom load for up
to twice ``expiry_s``. Pure: injected clock, the store's clock passed in as ``redis_ms``."""

from __future__ import annotations

import orjson

from workers.load_view import LoadView, decode_snapshot, encode_snapshot

EXPIRY_S = 3.0
REDIS_MS = 1_700_000_000_000  # the store's clock at the reader's first read


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_peer_seen_once_undated_and_then_deleted_is_dropped_at_once() -> None:
    """The reproducer's restarted child: the dead peer's snapshot (undated: an older version, or
    its first write) is in its first read, and a sibling deletes the field before the next."""
    clock = Clock()
    view = LoadView("fresh", EXPIRY_S, clock=clock)
    view.observe({"dead": encode_snapshot(1, {"w0": (50, 0)}), "sib": encode_snapshot(7, {})})
    assert view.totals() == {"w0": (50, 0)}  # nothing yet tells it apart from a live peer
    clock.t += 0.05
    view.observe({"sib": encode_snapshot(8, {})})
    assert view.totals() == {}
    assert "dead" not in view.peers and view.live() == ["sib"]


def test_a_peer_seen_moving_is_still_kept_when_it_vanishes() -> None:
    """The keep-on-vanish rule stands for a peer known alive: a store that restarted empty."""
    clock = Clock()
    view = LoadView("me", EXPIRY_S, clock=clock)
    view.observe({"a": encode_snapshot(1, {"w0": (6, 0)})})
    clock.t += 0.05
    view.observe({"a": encode_snapshot(2, {"w0": (6, 0)})})
    clock.t += 0.05
    view.observe({})  # the store came back empty
    assert view.totals() == {"w0": (6, 0)}
    clock.t += EXPIRY_S
    assert view.totals() == {} and view.expired() == ["a"]


def test_a_long_unchanged_snapshot_is_old_on_first_sight() -> None:
    """Written 2.8 s before the reader's first read (store's clock): it lives 0.2 s more on the
    reader's clock, as it does for the siblings that saw it move, not a fresh expiry_s."""
    clock = Clock()
    view = LoadView("fresh", EXPIRY_S, clock=clock)
    blob = encode_snapshot(4, {("w0", "http://x:1"): (50, 900)}, at_ms=REDIS_MS - 2800)
    view.observe({"dead": blob}, redis_ms=REDIS_MS)
    assert view.site_totals() == {("w0", "http://x:1"): (50, 900)}
    clock.t += 0.15
    view.observe({"dead": blob}, redis_ms=REDIS_MS + 150)
    assert view.totals() == {"w0": (50, 900)}
    clock.t += 0.1  # 3.05 s after the write
    view.observe({"dead": blob}, redis_ms=REDIS_MS + 250)
    assert view.totals() == {} and view.site_totals() == {}
    assert view.expired() == ["dead"] and view.live() == []


def test_a_snapshot_older_than_expiry_counts_for_nothing_from_the_first_read() -> None:
    """Every replica died long ago and one starts: their fields are dead on sight, listed for the
    store to delete, and not forgotten (then taken for new) on the very next read."""
    clock = Clock()
    view = LoadView("fresh", EXPIRY_S, clock=clock)
    old = encode_snapshot(9, {"w0": (3, 0)}, at_ms=REDIS_MS - 3_600_000)  # an hour
    view.observe({"gone": old}, redis_ms=REDIS_MS)
    assert view.totals() == {} and view.expired() == ["gone"]
    clock.t += 0.05
    view.observe({"gone": old}, redis_ms=REDIS_MS + 50)
    assert view.totals() == {} and view.expired() == ["gone"]


def test_a_dated_peer_is_kept_when_it_vanishes_until_its_own_expiry() -> None:
    """Dated by the store's clock, a first sight is as good as seeing it move: a store that
    restarted empty right after the reader's first read does not zero a live peer."""
    clock = Clock()
    view = LoadView("fresh", EXPIRY_S, clock=clock)
    view.observe({"a": encode_snapshot(3, {"w0": (5, 0)}, at_ms=REDIS_MS - 40)}, redis_ms=REDIS_MS)
    clock.t += 0.05
    view.observe({}, redis_ms=None)  # the restarted store: nothing, not even the time known yet
    assert view.totals() == {"w0": (5, 0)}
    clock.t = 100.0 - 0.04 + EXPIRY_S - 0.01  # written at 99.96 on the reader's clock
    assert view.totals() == {"w0": (5, 0)}
    clock.t += 0.02
    assert view.totals() == {} and view.expired() == ["a"]


def test_a_stamp_from_the_future_dates_nothing() -> None:
    """The store's clock stepped back (or a publisher reckoned it ahead): counted from first
    sight, as an undated snapshot, and not kept when it vanishes unseen moving."""
    clock = Clock()
    view = LoadView("fresh", EXPIRY_S, clock=clock)
    view.observe(
        {"a": encode_snapshot(1, {"w0": (2, 0)}, at_ms=REDIS_MS + 10_000)}, redis_ms=REDIS_MS
    )
    clock.t += EXPIRY_S - 0.01
    assert view.totals() == {"w0": (2, 0)}
    view.observe({}, redis_ms=REDIS_MS + 3000)
    assert view.totals() == {}


def test_the_stamp_travels_beside_what_older_readers_read() -> None:
    blob = encode_snapshot(5, {("w0", "http://x"): (1, 2)}, at_ms=REDIS_MS)
    doc = orjson.loads(blob)
    assert doc["t"] == REDIS_MS and doc["w"] == {"w0": [1, 2]} and doc["v"] == 1
    snap = decode_snapshot(blob)
    assert snap is not None and snap.at_ms == REDIS_MS
    assert "t" not in orjson.loads(encode_snapshot(5, {}))  # unknown: left out
    for bad in (-1, True, "1700000000000", 1.5):
        doc["t"] = bad
        s = decode_snapshot(orjson.dumps(doc))
        assert s is not None and s.at_ms is None and s.loads == {"w0": (1, 2)}
