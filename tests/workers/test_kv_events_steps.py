"""One worker's KV-event stream must neither hold the event loop nor the gateway's memory for long
(`workers.kv_events`, `workers.kv_wire.decode_batch_steps`, `PreciseSink.apply_steps`): a batch is
decoded and applied in steps with the loop's turn in between, and what waits to be applied is
bounded in bytes, not only in messages."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import msgpack
import pytest
import zmq

import workers.kv_events as kv_events
import workers.kv_intake as kv_intake
import workers.kv_wire as kv_wire
from scoring.precise import PreciseIndex
from tests.workers import test_kv_events as _base
from tests.workers.test_kv_events import (
    Harness,
    RecordingSink,
    recorded_batches,
    until,
)
from tests.workers.test_kv_events_replay import FakeCtx, ReadyDealer
from workers.kv_events import KVEventSubscriber
from workers.kv_intake import PreciseSink
from workers.kv_wire import KVEventDecodeError, decode_batch

ctx, h = _base.ctx, _base.h  # the subscriber tests' fixtures, used here by name


class Ticks:
    """Another coroutine's turns, counted: it stands in for every request the gateway serves."""

    def __init__(self) -> None:
        self.n = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.n += 1
            await asyncio.sleep(0)

    def __enter__(self) -> Ticks:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


class TickingIndex(PreciseIndex):
    """Notes, at every store, how many turns the other coroutine has had so far."""

    def __init__(self, ticks: Ticks) -> None:
        super().__init__()
        self.ticks = ticks
        self.at: list[tuple[int, int]] = []  # (blocks in the call, ticks so far)

    def stored(self, worker: str, engine_hashes: Any, *args: Any, **kw: Any) -> int:
        self.at.append((len(engine_hashes), self.ticks.n))
        return super().stored(worker, engine_hashes, *args, **kw)


def _one_token_blocks(n: int, base: int = 1_000_000) -> bytes:
    ev = {
        "type": "BlockStored",
        "block_hashes": list(range(base, base + n)),
        "parent_block_hash": None,
        "token_ids": [7] * n,
        "block_size": 1,
        "extra_keys": None,
    }
    return msgpack.packb([1.0, [ev], 0])


# --------------------------------------------------------------------------- applying in steps


async def test_a_big_batch_is_applied_in_steps_with_the_loop_between(h: Harness) -> None:
    # A 4 MiB batch can name 650,000 one-token blocks: applied in one call it held the loop for
    # ~2 s, every client stream and routing decision of the gateway waiting behind it.
    ticks = Ticks()
    idx = TickingIndex(ticks)
    sink = PreciseSink(idx, lambda _w: "m", lambda _w: 16)
    pub = await h.pub()
    sub = await h.sub(pub, sink, replay=False)  # type: ignore[arg-type]
    await until(lambda: pub.subscriptions >= 1 and sub.stats.connected, "connected")
    n = 5 * 2048 + 17
    with ticks:
        await pub.publish_raw(_one_token_blocks(n))
        await until(lambda: sub.stats.last_seq == 0, "batch applied")
    sizes = [size for size, _ in idx.at]
    assert sum(sizes) == n and len(sizes) >= 5 and max(sizes) <= kv_intake.APPLY_STEP_BLOCKS
    seen = [t for _, t in idx.at]
    assert all(b > a for a, b in itertools.pairwise(seen)), seen
    assert idx.size("w0") == n and sub.stats.batches == 1 and sub.stats.events == 1


async def test_many_small_events_are_decoded_in_steps_with_the_loop_between(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 40,000 tiny events are 1.5 MiB: decoding them in one piece held the loop ~0.6 s (a 4 MiB
    # batch of a million tiny events, ~3 s).
    ticks = Ticks()
    at: dict[str, int] = {}

    class Sink(RecordingSink):
        def apply(self, worker: str, events: Any) -> None:
            at["applied"] = ticks.n
            super().apply(worker, events)

        def apply_steps(self, worker: str, events: Any) -> Any:
            self.apply(worker, events)
            yield

    sink = Sink()
    pub = await h.pub()
    sub = await h.sub(pub, sink, replay=False)
    await until(lambda: pub.subscriptions >= 1 and sub.stats.connected, "connected")
    on_message = sub._on_message

    async def noted(seq: int, payload: bytes) -> None:
        at["received"] = ticks.n
        await on_message(seq, payload)

    monkeypatch.setattr(sub, "_on_message", noted)
    steps = 20
    n = steps * 512
    events = [["BlockRemoved", [i], "GPU"] for i in range(n)]
    with ticks:
        await pub.publish_raw(msgpack.packb([1.0, events, 0]))
        await until(lambda: sub.stats.last_seq == 0, "batch applied")
    assert len(sink.log[-1][1]) == n
    # Between receiving the batch and applying it, only its decoding ran: one turn for the
    # other coroutine per step.
    assert at["applied"] - at["received"] >= steps // 2


def test_stepped_decoding_gives_exactly_what_decoding_in_one_piece_did() -> None:
    payloads = [p for _c, _s, p, _d in recorded_batches()]
    payloads += [
        _one_token_blocks(3 * kv_wire.DECODE_STEP_EVENTS),
        msgpack.packb([2.5, [["BlockRemoved", [i]] for i in range(5_000)]]),  # no rank
        msgpack.packb({"ts": 1.0, "events": [["AllBlocksCleared"]] * 2_000, "x": 1}),
        msgpack.packb([1.0, [["AllBlocksCleared"]], 0, "later", "fields"]),
        msgpack.packb([1.0, [{"type": f"New{i % 40}"} for i in range(3_000)], None]),
    ]
    for p in payloads:
        skipped: Counter[str] = Counter()
        steps = kv_wire.decode_batch_steps(p, skipped=skipped)
        pauses = 0
        while True:
            try:
                next(steps)
                pauses += 1
            except StopIteration as done:
                got = done.value
                break
        ref_skipped: Counter[str] = Counter()
        assert got == decode_batch(p, skipped=ref_skipped)
        assert skipped == ref_skipped
        assert pauses <= len(p) // kv_wire.DECODE_STEP_BYTES + len(got[1]) // 512 + 8


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgpack.packb([1.0]),
        msgpack.packb([1.0, {"a": 1}, 0]),
        msgpack.packb(["t", [], 0]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [], 0]) + b"\x00",  # trailing bytes
        msgpack.packb([1.0, [["AllBlocksCleared"]] * 3_000, 0])[:-200],  # cut short
        msgpack.packb([1.0, [{"type": "New"}] * 3_000 + [7], 0]),  # bad event, late
    ],
)
def test_a_malformed_batch_is_an_error_however_late_it_shows(payload: bytes) -> None:
    # All or nothing: the steps before the error never hand events out.
    skipped: Counter[str] = Counter()
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload, skipped=skipped)
    assert not skipped


# --------------------------------------------------------------------------- memory


async def test_the_inbox_is_bounded_in_bytes(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    # 50,000 messages of up to 64 MiB each could wait in the inbox while the sink lagged; a
    # publisher whose batches cost more to apply than to send piled up 150 MiB in 30 s.
    monkeypatch.setattr(kv_events, "_INBOX_MAX_BYTES", 1 << 20, raising=False)
    sink = RecordingSink()
    pub = await h.pub()
    sub = await h.sub(pub, sink, replay=False)
    await until(lambda: pub.subscriptions >= 1 and sub.stats.connected, "connected")
    gate = asyncio.Event()
    on_message = sub._on_message

    async def stalled(seq: int, payload: bytes) -> None:
        await gate.wait()  # the sink lagging far behind
        await on_message(seq, payload)

    monkeypatch.setattr(sub, "_on_message", stalled)
    chunk = 100 << 10
    n = 40
    for i in range(n):
        await pub.publish_raw(_filler(i, chunk))
    assert sub._room is not None
    await until(lambda: not sub._room.is_set(), "the reader to stop for room")
    await asyncio.sleep(0.2)  # it stays stopped while the inbox is full
    held = sum(len(p) for _s, p in sub._inbox)
    assert held < (1 << 20) + chunk + 1024 and len(sub._inbox) < n - 1
    assert held == sub._inbox_bytes
    gate.set()  # the sink catches up: nothing was lost meanwhile (the publisher held the rest)
    await until(lambda: sub.stats.last_seq == n - 1, "all applied")
    assert sub.stats.resets == 0 and sub.stats.gaps == 0
    assert sub._inbox_bytes == 0 and not sub._inbox


def _filler(i: int, size: int) -> bytes:
    """A batch of about ``size`` bytes whose events are of an unknown type (counted, skipped)."""
    return msgpack.packb([1.0, [{"type": "Filler", "pad": b"x" * size, "i": i}], 0])


async def test_sockets_buffer_little_and_refuse_what_would_not_be_decoded(h: Harness) -> None:
    # 64 MiB messages, 100,000 of them queued in the SUB socket: 20 junk messages of 30 MiB,
    # never decodable, cost +615 MiB.
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink, replay=False)
    assert sub._sub is not None
    limit = sub._sub.getsockopt(zmq.MAXMSGSIZE)
    assert kv_events._MAX_BATCH_BYTES < limit <= kv_events._MAX_BATCH_BYTES + (1 << 20)
    assert sub._sub.getsockopt(zmq.RCVHWM) * limit <= 256 << 20
    sock = ReadyDealer(end_after=1)
    replayer = KVEventSubscriber(
        "w0", "tcp://127.0.0.1:1", sink, replay_endpoint="tcp://127.0.0.1:2", ctx=FakeCtx(sock)
    )
    assert await replayer._fetch(0) is not None
    assert sock.opts[zmq.MAXMSGSIZE] == limit
    assert sock.opts[zmq.RCVHWM] * limit <= 256 << 20


async def test_a_message_over_the_limit_is_dropped_before_it_is_buffered(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ZMQ drops a connection that sends more than MAXMSGSIZE and, that being a protocol error,
    # never redials it: the subscriber does, or the worker's events would stop for good.
    monkeypatch.setattr(kv_events, "_REDIAL_S", 0.5, raising=False)
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink, replay=False)
    await until(lambda: pub.subscriptions >= 1 and sub.stats.connected, "connected")
    await pub.publish(10)
    await until(lambda: sub.stats.last_seq == 0, "seq 0")
    await pub.publish_raw(b"\x00" * (kv_events._MAX_BATCH_BYTES + (2 << 20)))
    # The connection is dropped on it; the subscriber dials again and goes on.
    await until(lambda: pub.subscriptions >= 2 and sub.stats.connected, "reconnected")
    await pub.publish(12)
    await until(lambda: sub.stats.last_seq == 2, "seq 2")
    assert sub.stats.decode_errors == 0  # never received, so never held in memory
    assert sink.stored()[-1] == 12
