"""The subscriber's replays: cancellable on Python 3.11, bounded in time and size, and applied
without holding the event loop (workers/kv_events.py: _fetch, stop, the slices of every apply)."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from typing import Any

import pytest
import zmq
import zmq.asyncio

import workers.kv_events as kv_events
from tests.workers import test_kv_events as _base
from tests.workers.test_kv_events import Harness, RecordingSink, ready, stored, until
from workers.kv_events import KVEventSubscriber
from workers.kv_wire import encode_batch

ctx, h = _base.ctx, _base.h  # the subscriber tests' fixtures, used here by name

END = (-1).to_bytes(8, "big", signed=True)


class ReadyDealer:
    """A replay DEALER whose next reply is always there already: every recv is a future that is
    done when handed out, as zmq.asyncio hands them out while a replay's replies queue up. After
    ``end_after`` replies (if any) it sends the end marker."""

    def __init__(self, *, payload: Any = b"x", seqs: list[int] | None = None, end_after=None):
        self.payload = payload
        self.seqs = seqs
        self.end_after = end_after
        self.recvs = 0
        self.closed = False
        self.opts: dict[int, int] = {}

    def setsockopt(self, opt: int, value: int) -> None:
        self.opts[opt] = value

    def connect(self, _endpoint: str) -> None:
        pass

    def _done(self, value: Any) -> asyncio.Future[Any]:
        f = asyncio.get_running_loop().create_future()
        f.set_result(value)
        return f

    def send_multipart(self, _frames: list[bytes]) -> asyncio.Future[Any]:
        return self._done(None)

    def recv_multipart(self) -> asyncio.Future[Any]:
        i = self.recvs
        self.recvs += 1
        if self.seqs is not None:
            if i >= len(self.seqs):
                return self._done([b"", b"", END, b""])
            seq = self.seqs[i]
        elif self.end_after is not None and i >= self.end_after:
            return self._done([b"", b"", END, b""])
        else:
            seq = i
        payload = self.payload() if callable(self.payload) else self.payload
        return self._done([b"", b"kv", seq.to_bytes(8, "big"), payload])

    def close(self, linger: int | None = None) -> None:
        self.closed = True


class FakeCtx:
    def __init__(self, sock: ReadyDealer) -> None:
        self.sock = sock

    def socket(self, _kind: int) -> ReadyDealer:
        return self.sock


def _sub(sock: ReadyDealer, **kw: Any) -> KVEventSubscriber:
    return KVEventSubscriber(
        "w0",
        "tcp://127.0.0.1:1",
        RecordingSink(),
        replay_endpoint="tcp://127.0.0.1:2",
        ctx=FakeCtx(sock),  # type: ignore[arg-type]
        **kw,
    )


# --------------------------------------------------------------------------- finding 1: stop


async def test_a_replay_is_cancelled_even_when_its_replies_are_already_there() -> None:
    # 3.11's asyncio.wait_for returns the result and drops the cancel when the inner future is
    # done (gh-86296): a cancel mid-replay was lost, and stop() then waited for good.
    sock = ReadyDealer(end_after=300_000)
    sub = _sub(sock)
    task = asyncio.create_task(sub._fetch(0))
    await until(lambda: sock.recvs >= 200, "replies flowing")
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10)
    assert task in done and task.cancelled(), f"cancel lost; {sock.recvs} replies read"
    assert sock.closed


class SwallowingSubscriber(KVEventSubscriber):
    """Its start-up sync loses the cancel completely (caught, and the task's cancel count put
    back), the way a library that swallows cancellation would."""

    async def _full_sync(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            assert me is not None
            me.uncancel()


async def test_stop_returns_even_if_a_task_lost_its_cancel(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = SwallowingSubscriber(
        "w0", pub.endpoint, sink, replay_endpoint=pub.replay_endpoint, topic="kv"
    )
    await sub.start()
    await asyncio.sleep(0.05)  # in the start-up sync
    # Generous: stop() cancels again every second until its tasks are done.
    await asyncio.wait_for(asyncio.shield(sub.stop()), 15)
    assert not sub.running and sink.live is False


# --------------------------------------------------------------------------- finding 2: bounds


async def test_a_replay_that_never_ends_fails_by_its_deadline(
    h: Harness, ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_events, "_REPLAY_DEADLINE_MIN_S", 1.0)
    pub = await h.pub()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    asked: list[int] = []

    async def drip() -> None:  # a batch every 50 ms, well within replay_timeout_s; no end
        while True:
            ident, _d, start = await router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            for seq in range(10_000):
                payload = encode_batch(1.0, [stored(7)])
                await router.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big"), payload])
                await asyncio.sleep(0.05)

    task = asyncio.create_task(drip())
    sink = RecordingSink()
    sub = KVEventSubscriber(
        "w0",
        pub.endpoint,
        sink,
        replay_endpoint=f"tcp://127.0.0.1:{port}",
        topic="kv",
        replay_timeout_s=0.2,  # deadline max(1.0, 4 x 0.2) = 1 s
    )
    h.subs.append(sub)
    try:
        t0 = time.monotonic()
        await sub.start()
        await until(lambda: pub.subscriptions >= 1, "subscription")
        await pub.publish(42)
        await until(lambda: 42 in sink.stored(), "the stream's batch", timeout=15)
        assert time.monotonic() - t0 < 10  # generous: the replay gave up after ~1 s
        assert sub.stats.replay_failures == 1 and asked == [0]  # then a backoff: no retry
        assert 7 not in sink.stored()  # a failed replay applies nothing
    finally:
        task.cancel()
        await sub.stop()
        router.close(linger=0)


async def test_a_replay_answer_keeps_only_its_newest_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_events, "_REPLAY_MAX_BATCHES", 50)
    sub = _sub(ReadyDealer(end_after=500))
    out = await sub._fetch(0)
    assert out is not None and [s for s, _ in out] == list(range(450, 500))
    monkeypatch.setattr(kv_events, "_REPLAY_MAX_BYTES", 100)
    sub = _sub(ReadyDealer(payload=b"x" * 30, end_after=500))
    out = await sub._fetch(0)
    assert out is not None and [s for s, _ in out] == [497, 498, 499]  # 90 bytes


async def test_an_endless_flood_of_replies_is_held_within_the_caps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_events, "_REPLAY_DEADLINE_MIN_S", 0.5)
    monkeypatch.setattr(kv_events, "_REPLAY_MAX_BATCHES", 100)
    sock = ReadyDealer(payload=lambda: bytes(4096), end_after=200_000)  # ~800 MiB in all
    sub = _sub(sock, replay_timeout_s=0.1)
    tracemalloc.start()
    try:
        out = await asyncio.wait_for(sub._fetch(0), 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out is None and sub.stats.replay_failures == 1  # no end marker by the deadline
    assert peak < 16 << 20, f"{peak >> 20} MiB held after {sock.recvs} replies"


@pytest.mark.parametrize("seqs", [[0, 2, 1], [0, 1, 1], [3, 4]])
async def test_replies_out_of_order_or_before_the_start_fail_the_replay(seqs: list[int]) -> None:
    sub = _sub(ReadyDealer(seqs=seqs))
    assert await sub._fetch(0 if seqs[0] == 0 else 5) is None
    assert sub.stats.replay_failures == 1


async def test_no_replay_is_tried_during_the_backoff_after_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sock = ReadyDealer(seqs=[1, 0])
    sub = _sub(sock)
    assert await sub._fetch(0) is None
    assert await sub._fetch(0) is None  # backing off: not asked at all
    assert sub.stats.replays == 1 and sock.recvs == 2
    first = sub._replay_after - time.monotonic()
    assert 0 < first <= kv_events._REPLAY_BACKOFF_S
    sub._replay_after = 0.0  # the backoff has passed: asked again, and failing doubles it
    sock.recvs = 0
    assert await sub._fetch(0) is None and sub.stats.replays == 2
    assert sub._replay_after - time.monotonic() > kv_events._REPLAY_BACKOFF_S
    sub._replay_after = 0.0
    sock.seqs, sock.recvs = [0, 1], 0
    out = await sub._fetch(0)
    assert out is not None and [s for s, _ in out] == [0, 1]
    assert sub._replay_backoff == 0.0  # a success ends the backoff


# --------------------------------------------------------------------------- finding 3: slices


class TickingSink(RecordingSink):
    """Notes, with every batch applied, how many turns another coroutine has had so far."""

    def __init__(self, ticks: list[int]) -> None:
        super().__init__()
        self.ticks = ticks
        self.at: list[int] = []

    def apply(self, worker: str, events: Any) -> None:
        super().apply(worker, events)
        self.at.append(self.ticks[0])


async def _ticker(ticks: list[int]) -> None:  # stands in for every other coroutine
    while True:
        ticks[0] += 1
        await asyncio.sleep(0)


async def test_a_replayed_history_is_applied_in_slices_with_the_loop_between(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_events, "_SLICE_S", 0.0)  # a slice per batch: every pause shows
    pub = await h.pub()
    for x in range(100, 160):  # published before anyone subscribed: only the replay has them
        await pub.publish(x)
    ticks = [0]
    tick = asyncio.create_task(_ticker(ticks))
    try:
        sink = TickingSink(ticks)
        sub = await h.sub(pub, sink)
        await ready(pub, sub, sink)
        await until(lambda: sub.stats.last_seq == 59, "history")
        await pub.publish(12, send=False)  # lost: the gap is filled from the replay
        await pub.publish(13, send=False)
        await pub.publish(14)
        await until(lambda: sub.stats.last_seq == 62, "gap filled")
    finally:
        tick.cancel()
    assert sink.stored() == [*range(100, 160), 12, 13, 14]
    # The old code applied the whole history in one stretch: every batch at the same tick.
    assert all(a < b for a, b in zip(sink.at, sink.at[1:], strict=False)), sink.at


async def test_a_backlog_in_the_inbox_is_drained_in_slices(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_events, "_SLICE_S", 0.0)
    pub = await h.pub()
    ticks = [0]
    sink = TickingSink(ticks)
    sub = await h.sub(pub, sink, replay=False)
    await ready(pub, sub, sink, replay=False)
    tick = asyncio.create_task(_ticker(ticks))
    try:
        sub._inbox.extend((s, encode_batch(1.0, [stored(200 + s)])) for s in range(40))
        sub._wake_up()
        await until(lambda: sub.stats.last_seq == 39, "backlog applied")
    finally:
        tick.cancel()
    assert sink.stored() == [200 + s for s in range(40)]
    assert all(a < b for a, b in zip(sink.at, sink.at[1:], strict=False)), sink.at
