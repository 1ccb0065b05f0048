"""What one publisher can cost the gateway per batch: an oversized batch is not decoded, and
unknown event types are counted in a bounded table (workers/kv_events.py, workers/kv_wire.py)."""

from __future__ import annotations

from collections import Counter

import msgpack
import pytest
import zmq

import workers.kv_events as kv_events
from tests.workers import test_kv_events as _base
from tests.workers.test_kv_events import Harness, RecordingSink, ready, until
from tests.workers.test_kv_events_replay import FakeCtx, ReadyDealer
from workers.kv_events import KVEventSubscriber
from workers.kv_wire import SKIP_TAG_OTHER, SKIP_TAGS_MAX, count_skipped, decode_batch

ctx, h = _base.ctx, _base.h  # the subscriber tests' fixtures, used here by name

# --------------------------------------------------------------------------- finding 5: size


async def test_an_oversized_batch_is_not_decoded_and_its_sequence_is_kept(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_events, "_MAX_BATCH_BYTES", 64 << 10)
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink, replay=False)
    await ready(pub, sub, sink, replay=False)
    big = msgpack.packb(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": list(range(64)),
                    "parent_block_hash": None,
                    "token_ids": [5] * (128 << 10),
                    "block_size": 2048,
                }
            ],
            0,
        ]
    )
    await pub.publish(10)
    await pub.publish_raw(big)
    await pub.publish(12)
    await until(lambda: sub.stats.last_seq == 2, "seq 2")
    assert sink.timeline() == [10, 12]  # no gap, no reset: only that batch is lost
    assert sub.stats.decode_errors == 1 and sub.stats.batches == 2


async def test_both_sockets_refuse_messages_over_zmqs_limit(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink, replay=False)
    assert sub._sub is not None
    assert sub._sub.getsockopt(zmq.MAXMSGSIZE) == kv_events._MAX_MSG_BYTES
    sock = ReadyDealer(end_after=1)
    replayer = KVEventSubscriber(
        "w0", "tcp://127.0.0.1:1", sink, replay_endpoint="tcp://127.0.0.1:2", ctx=FakeCtx(sock)
    )
    assert await replayer._fetch(0) is not None
    assert sock.opts[zmq.MAXMSGSIZE] == kv_events._MAX_MSG_BYTES
    assert kv_events._MAX_BATCH_BYTES < kv_events._MAX_MSG_BYTES


# --------------------------------------------------------------------------- finding 7: tags


class NullSink:
    def apply(self, worker: str, events: object) -> None:
        pass

    def reset(self, worker: str, reason: str) -> None:
        pass

    def set_live(self, worker: str, live: bool) -> None:
        pass


def _payload(i: int) -> bytes:
    return msgpack.packb([1.0, [{"type": f"BlockPinned-{i:08d}", "block_hashes": [i]}] * 2, 0])


def test_unknown_types_named_apart_are_counted_in_a_bounded_table() -> None:
    sub = KVEventSubscriber("w0", "tcp://127.0.0.1:1", NullSink())
    n = 3_000
    for seq in range(n):
        p = _payload(seq)
        sub._apply(seq, p, hash(p))
    assert len(sub._skipped) == SKIP_TAGS_MAX + 1
    assert sub._skipped[SKIP_TAG_OTHER] == 2 * (n - SKIP_TAGS_MAX)
    assert sub.stats.skipped_events == 2 * n and sum(sub._skipped.values()) == 2 * n
    assert not sub._tally  # the per-batch tally is emptied after each batch
    assert sub.stats.batches == n and sub.stats.decode_errors == 0


def test_count_skipped_bounds_any_table_and_cuts_long_tags() -> None:
    table: Counter[str] = Counter()
    count_skipped(table, "x" * 10_000)
    assert list(table) == ["x" * 64]
    for i in range(100):
        count_skipped(table, f"t{i}", 2)
    count_skipped(table, "t0")  # known by name already: stays by name
    assert len(table) == SKIP_TAGS_MAX + 1 and table["t0"] == 3
    assert table[SKIP_TAG_OTHER] == 2 * (100 - (SKIP_TAGS_MAX - 1))
    # decode_batch counts into the caller's table the same way, whatever one batch holds
    many = msgpack.packb([1.0, [{"type": f"T{i}"} for i in range(500)], 0])
    skipped: Counter[str] = Counter()
    assert decode_batch(many, skipped=skipped)[1] == []
    assert len(skipped) == SKIP_TAGS_MAX + 1 and sum(skipped.values()) == 500
