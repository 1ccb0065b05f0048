"""What one KV-event batch may cost the gateway, whatever its publisher sends within the byte limit:
decoding and applying it pause at bounded steps in every accepted shape (a map-encoded batch, many
trailing fields, one huge removal), an engine hash is a digest and not a blob, and decoding does
not turn one-byte containers into tens of bytes each. Structure is asserted, not wall-clock time."""

from __future__ import annotations

import tracemalloc
from collections import Counter
from collections.abc import Generator, Sequence
from typing import Any

import msgpack
import pytest

import workers.kv_intake as kv_intake
import workers.kv_wire as kv_wire
from scoring.precise import PreciseIndex
from tests.workers.test_kv_events import recorded_batches
from workers.kv_intake import KVEndpoint, KVEventFleet, PreciseSink
from workers.kv_wire import BlockRemoved, BlockStored, KVEventDecodeError, decode_batch

U64 = 0x9E3779B97F4A7C15  # a multiplier that spreads i over 64 bits, as vLLM's hashes are


def _h(i: int) -> int:
    return (i * U64) & (2**64 - 1) | 2**63


def _run(steps: Generator[None, None, Any]) -> tuple[int, Any]:
    """(pauses, result) of a stepped decode."""
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return pauses, done.value
        pauses += 1


def _pauses_before_error(payload: bytes) -> int:
    steps = kv_wire.decode_batch_steps(payload)
    pauses = 0
    with pytest.raises(KVEventDecodeError):
        while True:
            next(steps)
            pauses += 1
    return pauses


def _removal(n: int, base: int = 0) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [_h(base + i) for i in range(n)]}


# --------------------------------------------------------------------------- a map-encoded batch


def test_a_map_encoded_batch_is_read_an_event_at_a_time() -> None:
    # It was unpacked whole before its first event was looked at: 1.35 million tiny events held
    # the loop for 0.8 s where the array layout paused every 512. A fault at its end now shows
    # only after pauses, as in the array layout; unpacked whole, it showed before any.
    events = [["AllBlocksCleared"]] * (4 * kv_wire.DECODE_STEP_EVENTS)
    for batch in ([1.0, events, 0], {"ts": 1.0, "events": events, "data_parallel_rank": 0}):
        cut = msgpack.packb(batch)[:-10]
        assert _pauses_before_error(cut) >= 3, type(batch).__name__


def test_a_map_encoded_batch_pauses_every_so_many_bytes_too() -> None:
    # Few events, each big: the events count alone would never pause.
    events = [_removal(3_000, base=i * 3_000) for i in range(40)]  # ~27 KiB each
    as_map = msgpack.packb({"events": events, "data_parallel_rank": 0, "ts": 2.0})
    as_array = msgpack.packb([2.0, events, 0])
    pauses, got = _run(kv_wire.decode_batch_steps(as_map))
    assert got == decode_batch(as_array)
    assert len(got[1]) == 40
    # A pause every 64 KiB, between events: every third one here (it was none at all).
    assert len(as_map) > 16 * kv_wire.DECODE_STEP_BYTES and pauses >= 10


def test_a_map_encoded_batch_decodes_as_before() -> None:
    events = [_removal(2), ["AllBlocksCleared"], {"type": "Newer"}]
    want = decode_batch(msgpack.packb([3.0, events, 1]))
    skipped: Counter[str] = Counter()
    for batch in (
        {"ts": 3.0, "events": events, "data_parallel_rank": 1},
        {"data_parallel_rank": 1, "x": [1, {"y": 2}], "events": events, 7: None, "ts": 3.0},
    ):
        assert decode_batch(msgpack.packb(batch), skipped=skipped) == want
    assert skipped == Counter({"Newer": 2})
    assert decode_batch(msgpack.packb({"ts": 1, "events": []})) == (1.0, [], None)


@pytest.mark.parametrize(
    "batch",
    [
        {"events": []},  # no ts
        {"ts": 1.0},  # no events
        {"ts": 1.0, "events": {}},
        {"ts": "x", "events": []},
        {"ts": 1.0, "events": [], "data_parallel_rank": "0"},
        {"ts": 1.0, "events": [7]},
    ],
)
def test_a_malformed_map_encoded_batch_is_an_error(batch: dict[str, Any]) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(msgpack.packb(batch))


def test_a_map_encoded_batch_naming_a_field_twice_is_an_error() -> None:
    # msgpack can say it (dicts cannot): the events field twice would be decoded twice.
    body = msgpack.packb("ts") + msgpack.packb(1.0)
    body += (msgpack.packb("events") + msgpack.packb([["AllBlocksCleared"]])) * 2
    with pytest.raises(KVEventDecodeError):
        decode_batch(b"\x83" + body)


# --------------------------------------------------------------------------- trailing fields


def test_a_few_trailing_fields_are_skipped_and_many_refused() -> None:
    # Each is skipped by a call of its own, with no pause: 4 million one-byte ones held the loop
    # for 0.9 s, in a batch that was then accepted.
    most = kv_wire.MAX_BATCH_EXTRA_FIELDS
    ok = msgpack.packb([1.0, [["AllBlocksCleared"]], 0, *["later"] * most])
    assert len(decode_batch(ok)[1]) == 1
    with pytest.raises(KVEventDecodeError, match="fields"):
        decode_batch(msgpack.packb([1.0, [], 0, *[0] * (most + 1)]))
    n = 4_000_000  # the reviewed payload: an array 32 header, then one-byte fields
    huge = b"\xdd" + (n + 3).to_bytes(4, "big") + msgpack.packb(0.0) + b"\x90\x00" + b"\x00" * n
    assert _pauses_before_error(huge) == 0  # refused at the header, before reading any

    as_map = {"ts": 1.0, "events": [], "data_parallel_rank": 2, **{f"k{i}": i for i in range(most)}}
    assert decode_batch(msgpack.packb(as_map)) == (1.0, [], 2)
    as_map["one-more"] = 0
    with pytest.raises(KVEventDecodeError, match="fields"):
        decode_batch(msgpack.packb(as_map))


# --------------------------------------------------------------------------- removals in slices


class CallsIndex(PreciseIndex):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def removed(self, worker: str, engine_hashes: Sequence[Any], *args: Any, **kw: Any) -> int:
        self.calls.append(("removed", len(engine_hashes)))
        return super().removed(worker, engine_hashes, *args, **kw)


def test_one_huge_removal_is_applied_in_slices_with_pauses_between() -> None:
    # Stores were applied APPLY_STEP_BLOCKS at a time, removals in one call: one BlockRemoved of
    # 4 million hashes held the loop for ~0.2 s.
    step = kv_intake.APPLY_STEP_BLOCKS
    idx = CallsIndex()
    sink = PreciseSink(idx, lambda _w: "m", lambda _w: 1)
    n = 5 * step + 17
    hashes = tuple(_h(i) for i in range(n))
    sink.apply("w", [BlockStored(hashes, None, tuple(range(n)), 1, None, "GPU", None)])
    assert idx.size("w") == n
    idx.calls.clear()
    steps = sink.apply_steps("w", [BlockRemoved(hashes, "GPU")])
    pauses = 0
    for _ in steps:
        pauses += 1
        assert idx.calls[-1][1] <= step  # a slice at most before each pause
    assert [size for _, size in idx.calls] == [step] * 5 + [17]
    assert pauses >= 5
    assert idx.size("w") == 0

    # An empty removal still touches the worker, as it did; a removal in a group the worker
    # does not index, nothing.
    idx.calls.clear()
    sink.apply("w", [BlockRemoved((), "GPU"), BlockRemoved(hashes, "GPU", group_idx=3)])
    assert idx.calls == [("removed", 0)]


# --------------------------------------------------------------------------- engine hash length


def _stored_map(hashes: list[Any], parent: Any = None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(len(hashes))),
        "block_size": 1,
        "extra_keys": None,
    }


def test_a_bytes_engine_hash_is_a_digest_not_a_blob() -> None:
    # Bytes hashes were kept whatever their length, and the index bounds a worker by entries:
    # 64 KiB "hashes" held 75 MiB in 1,200 entries (9.8 GiB at one worker's cap).
    most = kv_wire.MAX_HASH_BYTES
    assert most >= 32  # vLLM's sha256 / sha256_cbor digests, as 0.32 sends them in bytes mode
    fine = [b"\x01" * 32, b"\x02" * 16, b"\x03" * 8, b"\x04" * most, 7]
    for event in (
        _stored_map(fine, parent=b"\x05" * most),
        _removal(0) | {"block_hashes": fine},
        ["BlockStored", fine, b"\x06" * 32, [1] * len(fine), 1, None, "GPU"],
        ["BlockRemoved", fine, "GPU"],
    ):
        (ev,) = decode_batch(msgpack.packb([1.0, [event], 0], use_bin_type=True))[1]
        assert list(ev.engine_hashes) == fine

    long = b"\x07" * (most + 1)
    for event in (
        _stored_map([long]),
        _stored_map([b"\x01" * 32, long]),
        _stored_map([5, long]),  # among ints
        _stored_map([b"\x01" * 32], parent=long),
        _removal(0) | {"block_hashes": [long]},
        ["BlockStored", [1], long, [1], 1, None, "GPU"],
        ["BlockRemoved", [b"\x01" * 32, long], "GPU"],
        _stored_map([b"\x00" * (64 << 10)]),  # the reviewed one
    ):
        with pytest.raises(KVEventDecodeError, match="hash"):
            decode_batch(msgpack.packb([1.0, [event], 0], use_bin_type=True))


# --------------------------------------------------------------------------- decoding memory


def _peak(payload: bytes) -> tuple[int, bool]:
    """(peak bytes traced while decoding ``payload``, whether it decoded)."""
    tracemalloc.start()
    try:
        decode_batch(payload)
        ok = True
    except KVEventDecodeError:
        ok = False
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, ok


@pytest.mark.parametrize("junk", [b"\x90", b"\x80", b"\x91\x00"], ids=["[]", "{}", "[0]"])
def test_a_batch_of_tiny_containers_is_refused_before_it_costs_tens_of_times_its_size(
    junk: bytes,
) -> None:
    # Each is a byte or two on the wire and ~70 as a Python list or dict: 4 million empty
    # arrays in a skipped event took 249 MiB to decode (65x the batch).
    n = (1 << 20) // len(junk)
    event = msgpack.packb({"type": "X", "j": None})[:-1]  # its "j": an array 32 of n
    event += b"\xdd" + n.to_bytes(4, "big") + junk * n
    payload = b"\x93" + msgpack.packb(0.0) + b"\x91" + event + b"\x00"
    peak, ok = _peak(payload)
    assert not ok
    assert peak < 20 * len(payload)  # it was 36-73x


def test_every_legitimate_shape_fits_the_container_bound() -> None:
    # The densest containers vLLM sends: a LoRA named on every block of one-token blocks (a list
    # per block), short 0.11 removals without a medium, ends of caches.
    n = 50_000
    lora = {
        "type": "BlockStored",
        "block_hashes": [_h(i) for i in range(n)],
        "parent_block_hash": None,
        "token_ids": [1] * n,
        "block_size": 1,
        "lora_name": "a",
        "extra_keys": [["a"]] * n,
    }
    short = [["BlockRemoved", [_h(i)]] for i in range(n)]
    cleared = [["AllBlocksCleared"]] * n
    for events in ([lora], short, cleared):
        payload = msgpack.packb([1.0, events, 0])
        assert len(decode_batch(payload)[1]) == len(events)
    for _c, _s, payload, _d in recorded_batches():
        decode_batch(payload)


# --------------------------------------------------------------------------- probe memory


class StubSubscriber:
    def __init__(self, *_a: Any, **_kw: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def resync(self, _reason: str) -> None:
        pass


async def test_probe_memory_goes_with_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 scale-up/down cycles of 50 pods left 1,000 entries behind.
    monkeypatch.setattr(kv_intake, "KVEventSubscriber", StubSubscriber)
    fleet = KVEventFleet(PreciseSink(PreciseIndex(), lambda _w: "m"))
    for gen in range(3):
        names = [f"pod-{gen}-{i}" for i in range(5)]
        await fleet.sync({n: KVEndpoint("tcp://127.0.0.1:1") for n in names})
        for n in [*names, f"unsubscribed-{gen}"]:  # probed before its models are known
            fleet.note_probe(n, True, 1000.0 + gen)
        assert len(fleet._seen) == 6
        await fleet.sync({names[0]: KVEndpoint("tcp://127.0.0.1:1")})
        assert set(fleet._seen) == {names[0]}  # a worker kept keeps its probe memory
        await fleet.sync({})
        assert not fleet._seen
    fleet.note_probe("last", True, 1.0)
    await fleet.close()
    assert not fleet._seen
