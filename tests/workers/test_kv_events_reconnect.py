"""A reconnect the subscriber cannot verify by a replay (none configured, or it fails): what the
sink holds of the worker is not trusted until the stream's next batch shows, by its sequence
number, whether it went on (kept), restarted or has a hole (reset).

Not a reset on every such reconnect: vLLM announces a block once, when it is computed, so a
cleared index would under-claim a still-cached hot prefix for as long as it stays hot, after a
mere network blip."""

from __future__ import annotations

import asyncio

from tests.workers import test_kv_events as _base
from tests.workers.test_kv_events import FakePublisher, Harness, RecordingSink, until
from workers.kv_events import KVEventSubscriber

ctx, h = _base.ctx, _base.h  # the subscriber tests' fixtures, used here by name


async def _reconnected(
    h: Harness, *, replay: bool, continue_seq: bool, **kw: object
) -> tuple[KVEventSubscriber, RecordingSink, FakePublisher]:
    """Two batches (10, 11) from a publisher, then it goes away and one is back on the same
    ports: the same server carrying on (``continue_seq``) or a restarted one. Returns once the
    subscriber has handled the reconnect."""
    old = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(old, sink, replay=replay, **kw)
    await until(lambda: old.subscriptions >= 1 and sink.live is True, "live")
    await old.publish(10)
    await old.publish(11)
    await until(lambda: sub.stats.last_seq == 1, "seq 1")
    ports = old.ports
    await old.close()
    await until(lambda: sink.live is False, "disconnect noticed")
    new = await h.pub(ports=ports)
    if continue_seq:
        new.seq = old.seq
    if replay:
        new.router.close(linger=0)  # its replay socket does not answer
    await until(lambda: new.subscriptions >= 1, "resubscribed")
    await until(lambda: sub.stats.connected and not sub._control, "reconnect handled", 15)
    if replay:
        await until(lambda: sub.stats.replay_failures >= 1, "reconnect replay failed")
    await asyncio.sleep(0.2)
    return sub, sink, new


async def test_a_restarted_publisher_without_replay_is_not_trusted_then_reset(h: Harness) -> None:
    _sub, sink, new = await _reconnected(h, replay=False, continue_seq=False)
    assert sink.live is False and sink.resets() == []  # the old blocks: held, not trusted
    await new.publish(20)  # seq 0: a new process
    await until(lambda: 20 in sink.stored(), "the new publisher's batch")
    await until(lambda: sink.live is True, "live")
    assert sink.timeline() == [10, 11, "reset:restart", 20]


async def test_the_same_publisher_carrying_on_keeps_what_it_said(h: Harness) -> None:
    sub, sink, new = await _reconnected(h, replay=False, continue_seq=True)
    assert sink.live is False
    await new.publish(12)  # seq 2: nothing was missed
    await until(lambda: sink.live is True, "live")
    assert sink.timeline() == [10, 11, 12] and sub.stats.resets == 0


async def test_batches_missed_while_away_reset_on_the_next_one(h: Harness) -> None:
    _sub, sink, new = await _reconnected(h, replay=False, continue_seq=True)
    await new.publish(12, send=False)  # went out while nobody listened
    await new.publish(13)
    await until(lambda: sink.live is True, "live")
    assert sink.timeline() == [10, 11, "reset:gap", 13]


async def test_a_failed_reconnect_replay_is_not_trusted_until_the_stream_tells(
    h: Harness,
) -> None:
    _sub, sink, new = await _reconnected(h, replay=True, continue_seq=False, replay_timeout_s=0.3)
    assert sink.live is False and sink.resets() == []
    await new.publish(20)
    await until(lambda: sink.live is True, "live")
    assert sink.timeline() == [10, 11, "reset:restart", 20]


async def test_nothing_held_needs_no_verifying(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink, replay=False)
    await until(lambda: pub.subscriptions >= 1 and sink.live is True, "live")
    await sub.stop()
    await sub.start()  # nothing applied: live at once on the reconnect
    await until(lambda: sink.live is True, "live again")
    assert sink.resets() == []
