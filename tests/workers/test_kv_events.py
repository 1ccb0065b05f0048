"""KV events: the decoder against real vLLM 0.32 bytes and hand-built 0.11 batches, and the
subscriber against an in-test publisher (XPUB + ROUTER replay, like vLLM's) that can drop,
skip, restart and stall on purpose."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from workers.kv_events import KVEventSubscriber
from workers.kv_wire import (
    FULL_ATTENTION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32"
END = (-1).to_bytes(8, "big", signed=True)
BIG = 2**64 - 5  # unsigned 64-bit hashes above 2**63 are the norm in real traffic


# --------------------------------------------------------------------------- fixture data


def recorded() -> list[tuple[str, list[bytes], dict[str, Any]]]:
    """(channel, frames, decoded entry) for every recorded ZMQ message."""
    lines = [json.loads(x) for x in (FIXTURES / "kv_events.bin").read_text().splitlines() if x]
    decoded = json.loads((FIXTURES / "kv_events.decoded.json").read_text())
    assert len(lines) == len(decoded)
    return [
        (m["channel"], [base64.b64decode(f) for f in m["frames"]], d)
        for m, d in zip(lines, decoded, strict=True)
    ]


def recorded_batches() -> list[tuple[str, int, bytes, dict[str, Any]]]:
    """(channel, seq, payload, decoded entry) for every recorded batch (end markers left out)."""
    out = []
    for channel, frames, d in recorded():
        parts = frames[1:] if channel == "replay" else frames
        if parts[2]:
            out.append((channel, int.from_bytes(parts[1], "big", signed=True), parts[2], d))
    return out


# --------------------------------------------------------------------------- decoding


def test_decodes_every_recorded_032_batch() -> None:
    batches = recorded_batches()
    assert [(c, s) for c, s, _, _ in batches] == [
        *(("pub", s) for s in range(5)),
        *(("replay", s) for s in range(5)),
    ]
    salted = 0
    for _channel, seq, payload, d in batches:
        assert d["seq"] == seq
        ts, events, rank = decode_batch(payload)
        want_ts, want_events, want_rank = d["payload"]
        assert ts == want_ts and rank == want_rank == 0
        assert len(events) == len(want_events)
        for ev, want in zip(events, want_events, strict=True):
            assert isinstance(ev, BlockStored) and want["type"] == "BlockStored"
            assert list(ev.engine_hashes) == want["block_hashes"]
            assert ev.parent == want["parent_block_hash"]
            assert list(ev.token_ids) == want["token_ids"]
            assert ev.block_size == want["block_size"] == 32
            assert len(ev.token_ids) == len(ev.engine_hashes) * ev.block_size
            assert ev.medium == "GPU" and ev.lora_name is None and ev.lora_id is None
            assert ev.group_idx == 0 and ev.kv_cache_spec_kind == FULL_ATTENTION
            assert ev.is_full_attention
            if want["extra_keys"][0] == ["tenant-b"]:
                salted += 1
                assert ev.cache_salt == "tenant-b"
            else:
                assert ev.cache_salt is None
    assert salted == 2  # the salted request, once live and once replayed
    assert any(ev.parent is not None for _, _, p, _ in batches for ev in decode_batch(p)[1])
    assert any(h > 2**63 for _, _, p, _ in batches for h in decode_batch(p)[1][0].engine_hashes)


def test_recorded_replay_ends_with_the_seq_minus_one_marker() -> None:
    replay = [frames for channel, frames, _ in recorded() if channel == "replay"]
    assert replay[-1] == [b"", b"", END, b""]
    assert all(len(f) == 4 and f[0] == b"" and f[1] == b"kv" for f in replay[:-1])


def test_encoding_decoded_fixture_events_gives_the_recorded_bytes() -> None:
    for _channel, _seq, payload, d in recorded_batches():
        ts, events, rank = decode_batch(payload)
        out = encode_batch(ts, events, "0.32", rank=rank)
        _ts, maps, _rank = msgpack.unpackb(out)
        for m, want in zip(maps, d["payload"][1], strict=True):
            assert list(m) == list(want)  # same keys, same order
        assert out == payload  # and in fact the very same bytes


def stored(
    *hashes: int | bytes,
    parent: int | bytes | None = None,
    salt: str | None = None,
    lora: str | None = None,
    group: int = 0,
    kind: str | None = FULL_ATTENTION,
) -> BlockStored:
    return BlockStored(
        engine_hashes=tuple(hashes),
        parent=parent,
        token_ids=tuple(range(4 * len(hashes))),
        block_size=4,
        lora_name=lora,
        medium="GPU",
        cache_salt=salt,
        group_idx=group,
        kv_cache_spec_kind=kind,
    )


def test_round_trip_032() -> None:
    events: list[KVEvent] = [
        stored(BIG, 7, salt="tenant-a"),
        stored(9, parent=7, salt=None),
        stored(b"\x01" * 32, parent=b"\x02" * 32),
        stored(11, salt="s", lora="my-lora"),
        stored(12, lora="my-lora"),
        stored(13, group=1, kind="sliding_window"),
        BlockRemoved((BIG, 7), "GPU"),
        BlockRemoved((13,), "GPU", group_idx=1),
        AllBlocksCleared(),
    ]
    assert decode_batch(encode_batch(12.5, events, rank=3)) == (12.5, events, 3)


def test_round_trip_011() -> None:
    events: list[KVEvent] = [
        stored(BIG, 7, kind=None),
        stored(9, parent=7, kind=None),
        BlockRemoved((BIG,), "CPU"),
        AllBlocksCleared(),
    ]
    payload = encode_batch(1.0, events, "0.11")
    assert decode_batch(payload) == (1.0, events, 0)
    _ts, raw, _rank = msgpack.unpackb(payload)
    assert raw[0][0] == "BlockStored" and len(raw[0]) == 7
    assert raw[2] == ["BlockRemoved", [BIG], "CPU"] and raw[3] == ["AllBlocksCleared"]


def test_decodes_011_positional_arrays() -> None:
    payload = msgpack.packb(
        [
            3.5,
            [
                ["BlockStored", [BIG, 2], None, [1, 2, 3, 4], 2, None, "GPU"],
                ["BlockStored", [3], BIG, [5, 6], 2, 4, "CPU", "my-lora"],  # 0.11.x: + lora_name
                ["BlockStored", [4], 3, [7, 8], 2],  # oldest: no lora_id, no medium
                ["BlockRemoved", [BIG, 2], "GPU"],
                ["BlockRemoved", [3]],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    ts, events, rank = decode_batch(payload)
    assert (ts, rank) == (3.5, 0)
    assert events == [
        BlockStored((BIG, 2), None, (1, 2, 3, 4), 2, None, "GPU", None),
        BlockStored((3,), BIG, (5, 6), 2, "my-lora", "CPU", None, lora_id=4),
        BlockStored((4,), 3, (7, 8), 2, None, None, None),
        BlockRemoved((BIG, 2), "GPU"),
        BlockRemoved((3,), None),
        AllBlocksCleared(),
    ]
    # A batch whose rank was omitted (msgspec omit_defaults) has no rank.
    assert decode_batch(msgpack.packb([1.0, [["AllBlocksCleared"]]])) == (
        1.0,
        [AllBlocksCleared()],
        None,
    )


def test_bytes_hashes_are_kept_as_bytes() -> None:
    h1, h2 = b"\xaa" * 32, b"\xbb" * 32
    m = {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": b"\xcc" * 32}
    m |= {"token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU"}
    _ts, [ev, rm], _ = decode_batch(
        msgpack.packb([1.0, [m, {"type": "BlockRemoved", "block_hashes": [h1], "medium": None}]])
    )
    assert isinstance(ev, BlockStored) and isinstance(rm, BlockRemoved)
    assert ev.engine_hashes == (h1, h2) and ev.parent == b"\xcc" * 32
    assert rm.engine_hashes == (h1,)
    assert len({*ev.engine_hashes, ev.parent}) == 3  # hashable


def test_other_kv_groups_are_kept_and_flagged() -> None:
    base = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    base |= {"token_ids": [1, 2], "block_size": 2, "medium": "GPU"}
    events = [
        base | {"group_idx": 1, "kv_cache_spec_kind": "sliding_window"},
        base | {"group_idx": 0, "kv_cache_spec_kind": "mamba"},
        base | {"group_idx": 1, "kv_cache_spec_kind": FULL_ATTENTION},
        base | {"group_idx": 2},
        base,
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1},
    ]
    _ts, out, _ = decode_batch(msgpack.packb([1.0, events, 0]))
    assert len(out) == 6
    assert [getattr(e, "group_idx", None) for e in out] == [1, 0, 1, 2, 0, 1]
    assert [e.is_full_attention for e in out if isinstance(e, BlockStored)] == [
        False,
        False,
        True,
        False,
        True,
    ]


@pytest.mark.parametrize(
    ("extra_keys", "parent", "lora", "salt"),
    [
        ([["tenant-b"], None], None, None, "tenant-b"),
        ([["my-lora", "tenant-b"], ["my-lora"]], None, "my-lora", "tenant-b"),
        ([["my-lora"], ["my-lora"]], None, "my-lora", None),  # the LoRA name is not a salt
        ([["mm-hash", 3, "tenant-b"], None], None, None, "tenant-b"),
        ([["tenant-b"], None], 5, None, None),  # only a chain's first block carries the salt
        ([None, None], None, None, None),
        (None, None, None, None),
    ],
)
def test_cache_salt_comes_from_the_first_blocks_extra_keys(
    extra_keys: Any, parent: int | None, lora: str | None, salt: str | None
) -> None:
    m = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": parent}
    m |= {"token_ids": [1, 2, 3, 4], "block_size": 2, "lora_name": lora, "extra_keys": extra_keys}
    _ts, [ev], _ = decode_batch(msgpack.packb([1.0, [m], 0]))
    assert isinstance(ev, BlockStored) and ev.cache_salt == salt


def test_unknown_event_types_are_skipped_and_counted() -> None:
    payload = msgpack.packb(
        [
            1.0,
            [
                {"type": "BlockPinned", "block_hashes": [1]},
                ["BlockStored", [1], None, [1, 2], 2, None, "GPU"],
                ["SomethingNew", 1, 2],
                {"type": "BlockPinned"},
            ],
            0,
        ]
    )
    skipped: Counter[str] = Counter()
    _ts, events, _ = decode_batch(payload, skipped=skipped)
    assert [type(e) for e in events] == [BlockStored]
    assert skipped == Counter({"BlockPinned": 2, "SomethingNew": 1})
    assert decode_batch(payload)[1] == events  # counting is optional


GOOD = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        msgpack.packb([1.0, [GOOD], 0]) + b"\x00",  # trailing bytes
        msgpack.packb("a string"),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", []]),
        msgpack.packb([1.0, "not a list"]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [42]]),
        msgpack.packb([1.0, [[]]]),
        msgpack.packb([1.0, [{"no": "type"}]]),
        msgpack.packb([1.0, [[7, [1]]]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgpack.packb([1.0, [GOOD | {"block_hashes": ["str"]}]]),
        msgpack.packb([1.0, [GOOD | {"block_hashes": 5}]]),
        msgpack.packb([1.0, [GOOD | {"parent_block_hash": 1.5}]]),
        msgpack.packb([1.0, [GOOD | {"token_ids": ["a"]}]]),
        msgpack.packb([1.0, [GOOD | {"block_size": "32"}]]),
        msgpack.packb([1.0, [GOOD | {"group_idx": "1"}]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2]]]]),
        msgpack.packb([1.0, [["BlockRemoved"]]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "medium": "GPU"}]]),
    ],
)
def test_malformed_payload_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)
    assert issubclass(KVEventDecodeError, ValueError)


def test_encode_rejects_unknown_layout_and_non_events() -> None:
    with pytest.raises(ValueError):
        encode_batch(1.0, [], "0.9")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_batch(1.0, ["nope"])  # type: ignore[list-item]


# --------------------------------------------------------------------------- subscriber harness


class RecordingSink:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def apply(self, worker: str, events: Sequence[KVEvent]) -> None:
        assert worker == "w0"
        self.log.append(("apply", list(events)))

    def reset(self, worker: str, reason: str) -> None:
        assert worker == "w0"
        self.log.append(("reset", reason))

    def set_live(self, worker: str, live: bool) -> None:
        assert worker == "w0"
        self.log.append(("live", live))

    def stored(self) -> list[int | bytes]:
        """First engine hash of every stored event, in the order applied."""
        return [
            e.engine_hashes[0]
            for kind, events in self.log
            if kind == "apply"
            for e in events
            if isinstance(e, BlockStored)
        ]

    def timeline(self) -> list[Any]:
        """Stored hashes and resets interleaved, in order."""
        out: list[Any] = []
        for kind, arg in self.log:
            if kind == "apply":
                out += [e.engine_hashes[0] for e in arg if isinstance(e, BlockStored)]
            elif kind == "reset":
                out.append(f"reset:{arg}")
        return out

    def resets(self) -> list[str]:
        return [arg for kind, arg in self.log if kind == "reset"]

    @property
    def live(self) -> bool | None:
        states = [arg for kind, arg in self.log if kind == "live"]
        return states[-1] if states else None


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class FakePublisher:
    """vLLM's ZmqEventPublisher in miniature: PUB + ROUTER replay buffer, on 127.0.0.1.

    XPUB instead of PUB so a test can wait until the subscription has arrived (a PUB drops
    whatever it sends before that). ``send=False`` buffers a batch without sending it (lost in
    transit); ``replay_delay`` stalls replies (answering from the buffer as it was when asked);
    ``old_frames`` answers replays as [b"", seq, payload] like vLLM releases before 0.32.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        buffer: int = 1000,
        ports: tuple[int, int] | None = None,
        old_frames: bool = False,
    ) -> None:
        self.topic = b"kv"
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.ports = ports
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self.old_frames = old_frames
        self.replay_delay = 0.0
        self.replay_requests: list[int] = []
        self.subscriptions = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> FakePublisher:
        if self.ports is None:
            self.ports = (
                self.pub.bind_to_random_port("tcp://127.0.0.1"),
                self.router.bind_to_random_port("tcp://127.0.0.1"),
            )
        else:  # same ports as a closed predecessor: the kernel may need a moment
            for sock, port in zip((self.pub, self.router), self.ports, strict=True):
                deadline = time.monotonic() + 5
                while True:
                    try:
                        sock.bind(f"tcp://127.0.0.1:{port}")
                        break
                    except zmq.ZMQError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.05)
        self._tasks = [
            asyncio.create_task(self._serve_replay()),
            asyncio.create_task(self._watch_subscriptions()),
        ]
        return self

    @property
    def endpoint(self) -> str:
        assert self.ports is not None
        return f"tcp://127.0.0.1:{self.ports[0]}"

    @property
    def replay_endpoint(self) -> str:
        assert self.ports is not None
        return f"tcp://127.0.0.1:{self.ports[1]}"

    async def publish(self, *events: KVEvent | int, send: bool = True) -> int:
        """One batch; an int stands for a BlockStored of that single hash."""
        evs = [stored(e) if isinstance(e, int) else e for e in events]
        return await self.publish_raw(encode_batch(time.time(), evs), send=send)

    async def publish_raw(self, payload: bytes, *, send: bool = True) -> int:
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart_sequence(self) -> None:
        """What a server restarted behind the same sockets looks like on the wire."""
        self.seq = 0
        self.buffer.clear()

    async def _watch_subscriptions(self) -> None:
        while True:
            msg = await self.pub.recv()
            if msg[:1] == b"\x01":
                self.subscriptions += 1

    async def _serve_replay(self) -> None:
        while True:
            ident, _delim, start_b = await self.router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.replay_requests.append(start)
            snapshot = [(s, p) for s, p in self.buffer if s >= start]
            if self.replay_delay:
                await asyncio.sleep(self.replay_delay)
            for seq, payload in snapshot:
                head = [ident, b""] if self.old_frames else [ident, b"", self.topic]
                await self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [ident, b"", END, b""] if self.old_frames else [ident, b"", b"", END, b""]
            await self.router.send_multipart(end)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


class Harness:
    """Builds publishers and subscribers and tears all of them down, whatever the test did."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.pubs: list[FakePublisher] = []
        self.subs: list[KVEventSubscriber] = []

    async def pub(self, **kw: Any) -> FakePublisher:
        pub = await FakePublisher(self.ctx, **kw).start()
        self.pubs.append(pub)
        return pub

    async def sub(
        self, pub: FakePublisher, sink: RecordingSink, *, replay: bool = True, **kw: Any
    ) -> KVEventSubscriber:
        sub = KVEventSubscriber(
            "w0",
            pub.endpoint,
            sink,
            replay_endpoint=pub.replay_endpoint if replay else None,
            topic="kv",
            **kw,
        )
        self.subs.append(sub)
        await sub.start()
        return sub

    async def close(self) -> None:
        for sub in self.subs:
            await sub.stop()
        for pub in self.pubs:
            await pub.close()


@pytest.fixture
async def h(ctx: zmq.asyncio.Context) -> AsyncIterator[Harness]:
    harness = Harness(ctx)
    yield harness
    await harness.close()


async def ready(
    pub: FakePublisher, sub: KVEventSubscriber, sink: RecordingSink, *, replay: bool = True
) -> None:
    """Subscription arrived at the publisher and the start-up replay is done."""
    await until(lambda: pub.subscriptions >= 1, "subscription")
    await until(lambda: sink.live is True, "live")
    if replay:
        await until(lambda: sub.stats.replays >= 1, "start-up replay")


# --------------------------------------------------------------------------- subscriber tests


async def test_events_reach_the_sink_in_order(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    for x in range(10, 15):
        await pub.publish(x)
    await pub.publish(BlockRemoved((10,), "GPU"), AllBlocksCleared())
    await until(lambda: sub.stats.last_seq == 5, "seq 5")
    assert sink.stored() == [10, 11, 12, 13, 14]
    assert sink.log[-1] == ("apply", [BlockRemoved((10,), "GPU"), AllBlocksCleared()])
    assert sink.resets() == []
    st = sub.stats
    assert (st.batches, st.events, st.gaps, st.resets, st.decode_errors) == (6, 7, 0, 0, 0)
    assert st.replays == 1 and st.replay_failures == 0  # only the start-up one
    assert st.connected and st.last_event_monotonic is not None
    assert pub.replay_requests == [0]


async def test_a_gap_is_filled_from_the_replay_buffer(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    await pub.publish(10)
    await pub.publish(11)
    await until(lambda: sub.stats.last_seq == 1, "seq 1")
    await pub.publish(12, send=False)  # lost in transit: still in the replay buffer
    await pub.publish(13, send=False)
    await pub.publish(14)
    await until(lambda: sub.stats.last_seq == 4, "seq 4")
    assert sink.stored() == [10, 11, 12, 13, 14]
    assert sink.resets() == []
    assert pub.replay_requests == [0, 2]  # from last + 1
    assert sub.stats.gaps == 1 and sub.stats.replays == 2 and sub.stats.duplicates == 1
    await pub.publish(15)
    await until(lambda: sub.stats.last_seq == 5, "seq 5")
    assert sink.stored()[-1] == 15 and sink.live is True


async def test_a_gap_beyond_the_replay_buffer_resets(h: Harness) -> None:
    pub = await h.pub(buffer=3)
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    await pub.publish(10)
    await pub.publish(11)
    await until(lambda: sub.stats.last_seq == 1, "seq 1")
    for x in (12, 13, 14):
        await pub.publish(x, send=False)
    await pub.publish(15)  # the buffer now holds seqs 3..5: seq 2 is gone for good
    await until(lambda: sub.stats.last_seq == 5, "seq 5")
    assert sink.timeline() == [10, 11, "reset:gap", 13, 14, 15]
    assert pub.replay_requests == [0, 2]
    assert sub.stats.gaps == 1 and sub.stats.resets == 1


async def test_a_gap_without_a_replay_endpoint_resets(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink, replay=False)
    await ready(pub, sub, sink, replay=False)
    await pub.publish(10)
    await until(lambda: sub.stats.last_seq == 0, "seq 0")
    await pub.publish(11, send=False)
    await pub.publish(12)
    await until(lambda: sub.stats.last_seq == 2, "seq 2")
    assert sink.timeline() == [10, "reset:gap", 12]
    assert sub.stats.replays == 0 and pub.replay_requests == []


async def test_failed_replay_resets_and_continues(h: Harness, ctx: zmq.asyncio.Context) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    mute = ctx.socket(zmq.ROUTER)  # accepts replay requests, never answers
    mute_port = mute.bind_to_random_port("tcp://127.0.0.1")
    sub = KVEventSubscriber(
        "w0",
        pub.endpoint,
        sink,
        replay_endpoint=f"tcp://127.0.0.1:{mute_port}",
        replay_timeout_s=0.2,
    )
    try:
        await sub.start()
        await until(lambda: sub.stats.replay_failures == 1, "start-up replay failure")
        await until(lambda: pub.subscriptions >= 1 and sink.live is True, "live")
        await pub.publish(10)
        await until(lambda: sub.stats.last_seq == 0, "seq 0")
        await pub.publish(11, send=False)
        await pub.publish(12)
        await until(lambda: sub.stats.last_seq == 2, "seq 2")
        assert sink.timeline() == [10, "reset:gap", 12]
        # Only the start-up replay is tried: after a failure none is for a backoff (the connect
        # and the gap would each have held the intake for replay_timeout_s, and failed again).
        assert sub.stats.replays == sub.stats.replay_failures == 1 and sub.stats.gaps == 1
    finally:
        await sub.stop()
        mute.close(linger=0)


async def test_publisher_restart_seq_back_to_zero_resets(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    for x in (10, 11, 12):
        await pub.publish(x)
    await until(lambda: sub.stats.last_seq == 2, "seq 2")
    pub.restart_sequence()
    await pub.publish(20)
    await until(lambda: 20 in sink.stored(), "the new publisher's first batch")
    await pub.publish(21)
    await until(lambda: sink.stored()[-1] == 21, "seq 1 of the new publisher")
    assert sink.timeline() == [10, 11, 12, "reset:restart", 20, 21]
    assert pub.replay_requests == [0, 0]  # the new publisher's history, from its start
    assert sub.stats.last_seq == 1 and sink.live is True


async def test_start_replays_the_history_first(h: Harness) -> None:
    pub = await h.pub()
    for x in (10, 11, 12):  # published before anyone subscribed: only the buffer has them
        await pub.publish(x)
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    await until(lambda: sub.stats.last_seq == 2, "history")
    await pub.publish(13)
    await until(lambda: sub.stats.last_seq == 3, "seq 3")
    assert sink.stored() == [10, 11, 12, 13]
    assert sink.resets() == []
    assert sink.log[0] == ("live", False)  # not trusted until the history is in


async def test_stream_is_buffered_while_a_replay_runs(h: Harness) -> None:
    pub = await h.pub()
    for x in (10, 11):
        await pub.publish(x)
    pub.replay_delay = 0.5
    sink = RecordingSink()
    # A replay timeout well above the delay: a loaded host's slower reply must not fail it.
    sub = await h.sub(pub, sink, replay_timeout_s=10.0)
    await until(lambda: pub.subscriptions >= 1 and pub.replay_requests == [0], "replay asked")
    await pub.publish(12)  # after the replay snapshot: only the stream has these
    await pub.publish(13)
    await until(lambda: sub.stats.last_seq == 3, "seq 3")
    assert sink.stored() == [10, 11, 12, 13]
    assert sink.resets() == [] and sub.stats.gaps == 0


async def test_old_three_frame_replay_replies(h: Harness) -> None:
    pub = await h.pub(old_frames=True)
    for x in (10, 11):
        await pub.publish(x)
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    await until(lambda: sub.stats.last_seq == 1, "history")
    await pub.publish(12, send=False)
    await pub.publish(13)
    await until(lambda: sub.stats.last_seq == 3, "seq 3")
    assert sink.stored() == [10, 11, 12, 13] and sink.resets() == []
    assert sub.stats.replay_failures == 0


async def test_resync_resets_and_replays_from_zero(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    for x in (10, 11):
        await pub.publish(x)
    await until(lambda: sub.stats.last_seq == 1, "seq 1")
    sub.resync("health")
    await until(lambda: pub.replay_requests == [0, 0], "replay from 0")
    await until(lambda: sink.stored() == [10, 11, 10, 11], "history again")
    await pub.publish(12)
    await until(lambda: sub.stats.last_seq == 2, "seq 2")
    assert sink.timeline() == [10, 11, "reset:health", 10, 11, 12]
    assert sink.live is True


async def test_undecodable_batch_is_counted_and_skipped(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    await pub.publish(10)
    await pub.publish_raw(b"\xc1garbage")
    await pub.publish_raw(encode_batch(1.0, []) + b"")  # an empty batch is fine
    await pub.publish(13)
    await until(lambda: sub.stats.last_seq == 3, "seq 3")
    assert sink.timeline() == [10, 13]
    assert sub.stats.decode_errors == 1 and sub.stats.batches == 3


async def test_real_publisher_restart_on_the_same_ports(h: Harness) -> None:
    old = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(old, sink)
    await ready(old, sub, sink)
    for x in (10, 11, 12):
        await old.publish(x)
    await until(lambda: sub.stats.last_seq == 2, "seq 2")
    ports = old.ports
    await old.close()
    await until(lambda: not sub.stats.connected, "disconnect noticed")
    await until(lambda: sink.live is False, "not live while disconnected")
    new = await h.pub(ports=ports)
    await until(lambda: new.subscriptions >= 1, "resubscribed")
    await new.publish(20)
    await until(lambda: 20 in sink.stored(), "the new publisher's batch")
    await until(lambda: sink.live is True, "live again")
    assert sink.timeline() == [10, 11, 12, "reset:restart", 20]
    assert sub.stats.connected


async def test_restarted_publisher_that_got_further_than_us_is_not_a_gap(h: Harness) -> None:
    old = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(old, sink)
    await ready(old, sub, sink)
    for x in (10, 11):
        await old.publish(x)
    await until(lambda: sub.stats.last_seq == 1, "seq 1")
    ports = old.ports
    await old.close()
    await until(lambda: sink.live is False, "not live while disconnected")
    new = await h.pub(ports=ports)
    for x in (20, 21, 22):  # seqs 0..2: past ours, so seq 3 alone would look like a gap
        await new.publish(x, send=False)
    await until(lambda: new.subscriptions >= 1, "resubscribed")
    await new.publish(23)
    await until(lambda: 23 in sink.stored(), "the new publisher's seq 3")
    assert sink.timeline() == [10, 11, "reset:restart", 20, 21, 22, 23]
    assert sub.stats.last_seq == 3


async def test_restarted_subscriber_catches_up_without_reset(h: Harness) -> None:
    pub = await h.pub()
    sink = RecordingSink()
    sub = await h.sub(pub, sink)
    await ready(pub, sub, sink)
    for x in (10, 11):
        await pub.publish(x)
    await until(lambda: sub.stats.last_seq == 1, "seq 1")
    await sub.stop()
    assert sink.live is False
    for x in (12, 13):  # missed: nobody subscribed
        await pub.publish(x)
    await sub.start()  # same publisher: the replay still has seq 1 byte for byte
    await until(lambda: sub.stats.last_seq == 3, "caught up")
    await until(lambda: sink.live is True, "live")
    assert sink.timeline() == [10, 11, 12, 13]
    assert pub.replay_requests == [0, 0]


async def test_stop_is_prompt_even_mid_replay(ctx: zmq.asyncio.Context) -> None:
    mute = ctx.socket(zmq.ROUTER)  # never answers: the replay waits its whole timeout
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    sink = RecordingSink()
    sub = KVEventSubscriber(
        "w0",
        f"tcp://127.0.0.1:{port + 1}",  # nothing publishes here; SUB keeps retrying
        sink,
        replay_endpoint=f"tcp://127.0.0.1:{port}",
        replay_timeout_s=60.0,
    )
    try:
        await sub.start()
        await until(lambda: sub.stats.replays == 1, "replay started")
        await asyncio.sleep(0.05)
        sock = sub._sub
        assert sock is not None
        # Prompt: far below the replay's 60 s, generously above the moment it takes.
        t0 = time.monotonic()
        await asyncio.wait_for(sub.stop(), 20)
        assert time.monotonic() - t0 < 10
        assert sock.closed and not sub.running
        assert sink.live is False and sink.resets() == []
        await sub.stop()  # idempotent
        sub.resync("health")  # stopped: resets directly, no task needed
        assert sink.resets() == ["health"]
    finally:
        with contextlib.suppress(Exception):
            await sub.stop()
        mute.close(linger=0)


async def test_bad_endpoint_leaves_an_inert_subscriber() -> None:
    sink = RecordingSink()
    sub = KVEventSubscriber("w0", "tcp://*:5557", sink)  # vLLM's bind address, not ours
    await sub.start()
    assert not sub.running and sink.live is False
    await sub.stop()


def test_a_new_process_voids_what_the_events_said_and_a_health_flap_does_not() -> None:
    """The fleet resyncs a worker's subscriber when a probe finds it running a new process (its
    cache is empty); a first probe, a steady one or a health flap of the same process not (the
    flap holds its events untrusted until the stream is shown to have gone on:
    tests/workers/test_kv_flap_continuity.py)."""
    from scoring.precise import PreciseIndex
    from workers.kv_intake import KVEventFleet, PreciseSink

    fleet = KVEventFleet(PreciseSink(PreciseIndex(), lambda _w: "m"))
    calls: list[tuple[str, str]] = []
    fleet.resync = lambda w, why: calls.append((w, why))  # type: ignore[method-assign]
    fleet.note_probe("w0", True, 100.0)  # first sight: nothing to compare with
    fleet.note_probe("w0", True, 100.0)
    assert calls == []
    fleet.note_probe("w0", False, 100.0)
    fleet.note_probe("w0", False, 100.0)  # still down: once
    fleet.note_probe("w0", True, 250.0)  # back, restarted
    fleet.note_probe("w0", True, None)  # a scrape without the start time says nothing
    assert calls == [("w0", "restart")]


def test_mla_and_sink_attention_blocks_hold_a_reusable_prefix_and_windows_do_not() -> None:
    # DeepSeek's MLA workers label every store mla_attention: taken for another kind, their
    # events were all skipped and the precise index never learned what they hold.
    for kind in ("full_attention", "mla_attention", "sink_full_attention"):
        assert stored(1, kind=kind).is_full_attention, kind
    for kind in ("sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba"):
        assert not stored(1, kind=kind).is_full_attention, kind
