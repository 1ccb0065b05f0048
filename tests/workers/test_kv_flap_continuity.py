"""A health flap that is not a restart (a TTFT-outlier or breaker ejection, one slow probe) must
not wipe a worker's precise state: vLLM announces a block once (incremental report mode), so a
cleared index never learns its hot prefixes back. The worker is not trusted while it is not
healthy, and on recovery its stream's continuity is checked as after a reconnect; only a gap, a
new publisher or a new process start resets it.

Real classes throughout: `KVEventFleet` and its `KVEventSubscriber`, a `PreciseSink` into a
`PreciseIndex`, and an in-test ZMQ publisher (XPUB + ROUTER replay) on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from scoring.precise import PreciseIndex
from scoring.prefix import block_keys
from tests.workers.test_kv_events import FakePublisher, until
from workers.kv_events import KVEventSubscriber
from workers.kv_intake import KVEndpoint, KVEventFleet, PreciseSink
from workers.kv_wire import BlockStored

BS = 4
HOT = block_keys(list(range(8)), BS, "m", "", 8)  # a hot system prompt: 2 blocks
HOT_PLUS = block_keys(list(range(12)), BS, "m", "", 8)  # ... and the next block after it


def st(hashes: list[int], parent: int | None, first_tok: int) -> BlockStored:
    n = len(hashes)
    return BlockStored(
        tuple(hashes),
        parent,
        tuple(range(first_tok, first_tok + n * BS)),
        BS,
        None,
        "GPU",
        None,
        0,
        "full_attention",
    )


class World:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.idx = PreciseIndex()
        self.sink = PreciseSink(self.idx, lambda _w: "m", lambda _w: BS)
        self.fleet = KVEventFleet(self.sink)
        self.pub: FakePublisher | None = None

    async def start(self, *, replay: bool, buffer: int = 3) -> FakePublisher:
        pub = self.pub = await FakePublisher(self.ctx, buffer=buffer).start()
        rep = pub.replay_endpoint if replay else None
        await self.fleet.sync({"w0": KVEndpoint(pub.endpoint, rep, "kv")})
        await until(lambda: pub.subscriptions >= 1 and self.trusted(), "subscribed and live")
        return pub

    @property
    def sub(self) -> KVEventSubscriber:
        return self.fleet._subs["w0"][1]

    def trusted(self) -> bool:
        return "w0" in self.idx.trusted(time.monotonic())

    def match(self, chain: list[int]) -> int:
        return self.idx.match(chain, time.monotonic()).get("w0", 0)

    async def warm(self) -> None:
        """The hot prefix stored once, then more traffic than the replay buffer holds."""
        assert self.pub is not None
        await self.pub.publish(st([101, 102], None, 0))
        for i in range(5):
            await self.pub.publish(st([1000 + i], None, 100 + 10 * i))
        await until(lambda: self.sub.stats.last_seq == 5, "seq 5")
        assert self.match(HOT) == 2

    async def close(self) -> None:
        await self.fleet.close()
        if self.pub is not None:
            await self.pub.close()


@pytest.fixture
async def world() -> AsyncIterator[World]:
    ctx = zmq.asyncio.Context()
    w = World(ctx)
    try:
        yield w
    finally:
        await w.close()
        ctx.destroy(linger=0)


async def test_a_flap_with_replay_keeps_the_hot_prefix(world: World) -> None:
    pub = await world.start(replay=True)
    await world.warm()
    asked = len(pub.replay_requests)
    world.fleet.note_probe("w0", True, 100.0)
    world.fleet.note_probe("w0", False, 100.0)  # ejected: same process, same stream
    assert not world.trusted()  # not trusted while it is not healthy
    assert world.sub.stats.resets == 0
    # Its events are still applied meanwhile.
    await pub.publish(st([2000], None, 500))
    await until(lambda: world.sub.stats.last_seq == 6, "seq 6 while held")
    assert not world.trusted()
    world.fleet.note_probe("w0", False, 100.0)  # still down: nothing new
    world.fleet.note_probe("w0", True, 100.0)  # back, same process
    # Continuity checked by the replay: our last batch is still there byte for byte.
    await until(lambda: len(pub.replay_requests) > asked and world.trusted(), "checked, live")
    assert world.sub.stats.resets == 0 and not world.sink.resets
    assert world.match(HOT) == 2
    # The next request extends the hot prefix: keyed from the block announced long ago.
    await pub.publish(st([103], 102, 8))
    await until(lambda: world.sub.stats.last_seq == 7, "seq 7")
    assert world.match(HOT_PLUS) == 3
    assert not world.idx.unkeyed.get("w0")


async def test_a_flap_without_replay_keeps_the_hot_prefix(world: World) -> None:
    pub = await world.start(replay=False)
    await world.warm()
    world.fleet.note_probe("w0", True, 100.0)
    world.fleet.note_probe("w0", False, 100.0)
    assert not world.trusted()
    world.fleet.note_probe("w0", True, 100.0)
    # No replay to check against: not trusted until the stream's next batch shows its sequence
    # went on (as after a reconnect), and nothing reset meanwhile.
    assert not world.trusted()
    await pub.publish(st([103], 102, 8))
    await until(lambda: world.sub.stats.last_seq == 6 and world.trusted(), "seq 6, live")
    assert world.sub.stats.resets == 0 and not world.sink.resets
    assert world.match(HOT) == 2 and world.match(HOT_PLUS) == 3


async def test_recovery_fills_in_what_the_stream_lost_from_the_replay(world: World) -> None:
    pub = await world.start(replay=True, buffer=10)
    await world.warm()
    world.fleet.note_probe("w0", True, 100.0)
    world.fleet.note_probe("w0", False, 100.0)
    await pub.publish(st([103], 102, 8), send=False)  # lost in transit, last before recovery
    world.fleet.note_probe("w0", True, 100.0)
    await until(lambda: world.sub.stats.last_seq == 6 and world.trusted(), "filled in, live")
    assert world.sub.stats.resets == 0
    assert world.match(HOT_PLUS) == 3


async def test_a_gap_found_after_recovery_still_resets(world: World) -> None:
    pub = await world.start(replay=False)
    await world.warm()
    world.fleet.note_probe("w0", True, 100.0)
    world.fleet.note_probe("w0", False, 100.0)
    await pub.publish(st([2000], None, 500), send=False)  # lost: no replay to fill it in
    world.fleet.note_probe("w0", True, 100.0)
    await pub.publish(st([2001], None, 600))
    await until(lambda: world.sub.stats.resets >= 1, "gap reset")
    assert world.sink.resets[("w0", "gap")] == 1
    await until(lambda: world.trusted(), "live again")
    assert world.match(HOT) == 0  # what may be stale went


async def test_a_new_process_start_still_resets(world: World) -> None:
    await world.start(replay=False)
    await world.warm()
    world.fleet.note_probe("w0", True, 100.0)
    world.fleet.note_probe("w0", False, 100.0)
    world.fleet.note_probe("w0", True, 250.0)  # back as a new process: its cache is empty
    await until(lambda: world.sub.stats.resets >= 1, "restart reset")
    assert world.sink.resets[("w0", "restart")] == 1
    await until(lambda: world.trusted(), "live again")
    assert world.match(HOT) == 0


async def test_a_restart_after_a_scrape_without_a_start_time_is_still_seen(world: World) -> None:
    await world.start(replay=False)
    await world.warm()
    world.fleet.note_probe("w0", True, 100.0)
    world.fleet.note_probe("w0", True, None)  # says nothing of the process
    world.fleet.note_probe("w0", True, 250.0)
    await until(lambda: world.sub.stats.resets >= 1, "restart reset")
    assert world.sink.resets[("w0", "restart")] == 1


def test_a_worker_first_seen_unhealthy_is_not_held() -> None:
    sink = PreciseSink(PreciseIndex(), lambda _w: "m")
    fleet = KVEventFleet(sink)
    fleet.note_probe("w0", False, 1.0)
    fleet.note_probe("w0", True, 1.0)
    assert not sink.held("w0")
    fleet.note_probe("w0", False, 1.0)  # not subscribed: nothing to hold
    assert not sink.held("w0")
