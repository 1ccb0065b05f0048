"""The wire form of shared dispatches (workers.learned_share): lossless, clock-shifted, and
skeptical of bytes it did not write."""

from __future__ import annotations

import msgpack
import pytest

from scoring.learned import Learned
from workers.learned_share import decode_batch, encode_batch, pack_chain, unpack_chain

KEY = (128, 16, 4096, 0.5)


def entries() -> list[Learned]:
    return [
        Learned("w0", (1, 2**64 - 1, 12345678901234567890), 2, (5,), "tenant-a:u1", 900, 100.0),
        Learned("w1", (), 0, (), None, 0, 100.25),
        Learned("w2", (7,), 1, (), None, 64, 100.3, (7, 8, 9)),  # KV-event mode: pending keys
        Learned("w2", (), 0, (), None, 0, 100.4, (7, 8, 9), True),  # ... and their prefill done
    ]


def test_round_trip_moves_times_onto_the_readers_clock() -> None:
    raw = encode_batch(KEY, entries(), sent=100.5)
    got = decode_batch(raw, now=7.0)  # the reader's clock when the batch was published
    assert got is not None
    key, out = got
    assert key == KEY
    assert [e._replace(at=0.0) for e in out] == [e._replace(at=0.0) for e in entries()]
    assert [e.at for e in out] == pytest.approx([6.5, 6.75, 6.8, 6.9])


def test_chains_pack_to_eight_bytes_a_block() -> None:
    chain = tuple(range(0, 2**64, 2**58))
    raw = pack_chain(chain)
    assert len(raw) == 8 * len(chain)
    assert unpack_chain(raw) == chain


def row(**kw: object) -> list[object]:
    r = {
        "w": "w",
        "c": b"",
        "d": 0,
        "tails": [],
        "s": None,
        "n": 0,
        "at": 0.0,
        "b": b"",
        "x": False,
    }
    r.update(kw)
    return list(r.values())


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"garbage",
        msgpack.packb({"v": 1, "k": [], "t": 0.0, "e": []}),  # an older version
        msgpack.packb({"v": 3, "k": [], "t": 0.0, "e": []}),  # a newer one
        msgpack.packb({"v": 2, "k": [], "t": "x", "e": []}),
        msgpack.packb({"v": 2, "k": ["a"], "t": 0.0, "e": []}),
        msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": [row(c=b"1234567")]}),
        msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": [row(b=b"123")]}),
        msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": [row(d=-1)]}),
        msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": [row(s=5)]}),
        msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": [row(x=1)]}),
        msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": [row()[:7]]}),
        msgpack.packb([1, 2, 3]),
    ],
)
def test_what_this_version_did_not_write_is_skipped(raw: bytes) -> None:
    assert decode_batch(raw, now=1.0) is None


def test_a_well_formed_row_decodes() -> None:
    """The counterpart of the cases above: they fail for their one defect only."""
    got = decode_batch(msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": [row()]}), now=1.0)
    assert got is not None and got[1][0].worker == "w"
