"""Snapshot fields the load view cannot use: a field that does not decode is counted once and
expires like a silent peer (the store then forgets it), unless its bytes keep moving (a live
replica of another version); a peer's absurd counts are clamped."""

from __future__ import annotations

import orjson

from workers.load_view import LoadView, decode_snapshot, encode_snapshot


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def newer(seq: int) -> bytes:
    return orjson.dumps({"v": 2, "seq": seq, "w": {}})


def test_an_undecodable_field_counts_once_and_expires_when_it_stops_moving() -> None:
    clock = Clock()
    view = LoadView("me", 3.0, clock=clock)
    for step in range(10):  # "dead" froze (a SIGKILLed replica of another version)
        view.observe({"dead": newer(5), "other": newer(step), "a": encode_snapshot(step, {})})
        clock.t += 1.0
    assert view.malformed == 2  # once per field, not once per read
    assert view.expired() == ["dead"]  # "other" rewrites its field: alive, kept in the store
    assert view.live() == ["a"]
    # Forgotten from the store (the cluster sync deletes it), then from memory.
    clock.t += 40.0
    view.observe({"a": encode_snapshot(99, {})})
    assert view.undecodable == {} and view.expired() == []


def test_a_field_that_decodes_again_is_a_peer_again() -> None:
    clock = Clock()
    view = LoadView("me", 3.0, clock=clock)
    view.observe({"p": b"\xff garbage"})
    clock.t += 10.0
    view.observe({"p": encode_snapshot(1, {"w0": (2, 5)})})
    assert view.expired() == [] and view.totals() == {"w0": (2, 5)} and view.malformed == 1


def test_a_peers_absurd_counts_are_clamped() -> None:
    snap = decode_snapshot(encode_snapshot(3, {"w0": (2**62, 2**62), "w1": (4, 100)}))
    assert snap is not None
    in_flight, tokens = snap.loads["w0"]
    assert 1 << 10 <= in_flight <= 1 << 20 and 1 << 30 <= tokens <= 1 << 40
    assert snap.loads["w1"] == (4, 100)
