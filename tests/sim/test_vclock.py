"""The engine's two clocks: the discrete-event fleet runner and the asyncio real-time loop."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from workers.sim.engine import Engine, generated_token_ids
from workers.sim.engine_types import EngineConfig, SimRequest
from workers.sim.profiles import get_profile
from workers.sim.realtime import EngineLoop
from workers.sim.vclock import Arrival, FleetSnapshot, VirtualFleet, percentile, round_robin

FAST = get_profile("fast")
GPU = get_profile("default")


def prompt(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def fleet(n: int, profile=GPU, **config: int) -> list[Engine]:
    cfg = EngineConfig(**{"num_blocks": 1024, "block_size": 16, **config})
    return [Engine(cfg, profile) for _ in range(n)]


# ---- virtual clock -------------------------------------------------------------------------------


def test_results_carry_latencies_and_token_counts() -> None:
    arrivals = [Arrival(0.1 * i, SimRequest(f"r{i}", prompt(300, 1000 * i), 12)) for i in range(6)]
    result = VirtualFleet(fleet(3), round_robin()).run(arrivals)
    assert [r.worker for r in result.results] == [0, 1, 2, 0, 1, 2]
    for r in result.results:
        assert r.output_tokens == 12 and r.finish_reason == "length"
        assert len(r.itl) == 11 and all(gap > 0 for gap in r.itl)
        assert r.ttft is not None and r.ttft > 0
        assert r.completion_time == pytest.approx(r.first_token_time + sum(r.itl))
        assert r.prompt_tokens == 300
    assert result.duration == max(r.completion_time for r in result.results)
    assert result.num_steps >= 6 * 12 // 2  # at most two requests share a worker


def test_router_sees_its_own_in_flight_counts_and_tags() -> None:
    seen: list[tuple[str | None, tuple[int, ...], tuple[int, ...]]] = []

    def route(a: Arrival, snap: FleetSnapshot) -> int:
        seen.append(
            (a.tag, tuple(e.in_flight for e in snap.engines), tuple(e.sent for e in snap.engines))
        )
        assert snap.now == a.time
        assert all(e.block_size == 16 and e.num_blocks == 1024 for e in snap.engines)
        return 0

    arrivals = [
        Arrival(0.0, SimRequest("a", prompt(50), 400), tag="t1"),
        Arrival(0.001, SimRequest("b", prompt(50, 5000), 400), tag="t2"),
        Arrival(60.0, SimRequest("c", prompt(50, 9000), 4)),  # long after a and b finished
    ]
    result = VirtualFleet(fleet(2), route).run(arrivals)
    assert seen == [("t1", (0, 0), (0, 0)), ("t2", (1, 0), (1, 0)), (None, (0, 0), (2, 0))]
    assert [r.tag for r in result.results] == ["t1", "t2", None]


def test_snapshot_reflects_engine_state_at_arrival_time() -> None:
    states: list[tuple[int, int, float]] = []

    def route(a: Arrival, snap: FleetSnapshot) -> int:
        e = snap.engines[0]
        states.append((e.running, e.waiting, e.kv_usage))
        return 0

    engines = fleet(1, max_num_seqs=1)
    arrivals = [
        Arrival(0.0, SimRequest("a", prompt(160), 500)),
        Arrival(0.5, SimRequest("b", prompt(16), 4)),
    ]
    VirtualFleet(engines, route).run(arrivals)
    assert states[0] == (0, 0, 0.0)
    running, waiting, usage = states[1]
    assert (running, waiting) == (1, 0) and usage > 0


def test_simultaneous_arrivals_share_the_first_step() -> None:
    arrivals = [Arrival(1.0, SimRequest(f"r{i}", prompt(100, 1000 * i), 3)) for i in range(4)]
    result = VirtualFleet(fleet(1), lambda a, f: 0).run(arrivals)
    assert len({r.first_token_time for r in result.results}) == 1
    assert result.num_steps == 3


def test_arrival_at_a_step_boundary_joins_the_next_step() -> None:
    engines = fleet(1, profile=FAST)
    probe = Engine(EngineConfig(num_blocks=1024, block_size=16), FAST)
    probe.add_request(SimRequest("a", prompt(100), 5), 0.0)
    boundary = probe.step(0.0).duration  # when the first step of "a" ends
    arrivals = [
        Arrival(0.0, SimRequest("a", prompt(100), 5)),
        Arrival(boundary, SimRequest("b", prompt(100, 5000), 5)),
    ]
    a, b = VirtualFleet(engines, lambda x, f: 0).run(arrivals).results
    # b is prefilled in the step that starts exactly when it arrives, alongside a's first decode.
    assert a.first_token_time is not None
    assert b.first_token_time == pytest.approx(a.first_token_time + a.itl[0])


def test_arrivals_are_consumed_lazily_and_must_be_ordered() -> None:
    produced: list[str] = []
    routed: list[str] = []

    def gen() -> Iterator[Arrival]:
        for i in range(3):
            produced.append(f"r{i}")
            assert len(routed) == i  # the previous arrival was routed before this one was built
            yield Arrival(float(i), SimRequest(f"r{i}", prompt(20), 2))

    def route(a: Arrival, snap: FleetSnapshot) -> int:
        routed.append(a.request.request_id)
        return 0

    VirtualFleet(fleet(1), route).run(gen())
    assert produced == routed == ["r0", "r1", "r2"]

    backwards = [
        Arrival(1.0, SimRequest("x", prompt(20), 2)),
        Arrival(0.5, SimRequest("y", prompt(20), 2)),
    ]
    with pytest.raises(ValueError, match="non-decreasing"):
        VirtualFleet(fleet(1), lambda a, f: 0).run(backwards)
    with pytest.raises(ValueError, match="router chose"):
        VirtualFleet(fleet(2), lambda a, f: 2).run(backwards[:1])


def test_prefix_affinity_routing_beats_round_robin_on_hit_rate_and_ttft() -> None:
    """The fleet runner is a policy testbed: sticky routing of shared prefixes must show up."""

    def workload() -> list[Arrival]:
        # 8 groups of 128 blocks each; a worker caches ~3 groups, so spreading every group over
        # every worker (round robin) thrashes its LRU while pinning 2 groups per worker does not.
        groups = [prompt(2048, base=1000 + 3000 * g) for g in range(8)]
        picks = random.Random(5).choices(range(8), k=96)
        return [
            Arrival(
                0.05 * i,
                SimRequest(f"q{i}", groups[g] + prompt(64, 30000 + 100 * i), 8),
                tag=str(g),
            )
            for i, g in enumerate(picks)
        ]

    rr = VirtualFleet(fleet(4, num_blocks=400), round_robin()).run(workload())
    sticky = VirtualFleet(fleet(4, num_blocks=400), lambda a, f: int(a.tag or 0) % 4).run(
        workload()
    )
    assert sticky.hit_rate > 0.8
    assert sticky.hit_rate > rr.hit_rate + 0.3
    ttft = lambda res: percentile([r.ttft or 0 for r in res.results], 50)  # noqa: E731
    assert ttft(sticky) < ttft(rr)


def test_percentile_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) != percentile([], 50)  # NaN


# ---- real-time clock -----------------------------------------------------------------------------


async def collect(handle) -> tuple[list[int], list]:
    tokens: list[int] = []
    outs = []
    async for out in handle:
        tokens += out.new_token_ids
        outs.append(out)
    return tokens, outs


async def test_engine_loop_streams_every_token_of_concurrent_requests() -> None:
    engine = Engine(EngineConfig(num_blocks=512, block_size=16), FAST)
    loop = EngineLoop(engine)
    await loop.start()
    try:
        handles = [loop.submit(SimRequest(f"r{i}", prompt(100, 1000 * i), 20)) for i in range(8)]
        streams = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 10)
        for i, (tokens, outs) in enumerate(streams):
            assert tokens == generated_token_ids(f"r{i}", 20)
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert not any(o.finished for o in outs[:-1])
        assert engine.stats().generation_tokens == 160
        assert engine.kv_usage == 0 and loop.num_in_flight == 0
        # The loop went idle and wakes up again for a new request (with a prefix hit this time).
        tokens, outs = await asyncio.wait_for(
            collect(loop.submit(SimRequest("again", prompt(100), 3))), 10
        )
        assert len(tokens) == 3 and outs[0].num_cached_tokens == 96
    finally:
        await loop.stop()


async def test_engine_loop_paces_steps_by_their_modelled_duration() -> None:
    slow = get_profile("fast").with_overrides(decode_c=20.0, prefill_c=20.0, floor_ms=20.0)
    loop = EngineLoop(Engine(EngineConfig(num_blocks=64, block_size=16), slow))
    await loop.start()
    try:
        clock = asyncio.get_running_loop()
        t0 = clock.time()
        await asyncio.wait_for(collect(loop.submit(SimRequest("r", prompt(10), 5))), 10)
        # Five steps of >= 20 ms each cannot be delivered sooner than 100 ms.
        assert clock.time() - t0 >= 0.095
    finally:
        await loop.stop()


async def test_abort_mid_stream_ends_the_iterator_and_frees_blocks() -> None:
    engine = Engine(EngineConfig(num_blocks=512, block_size=16), FAST)
    loop = EngineLoop(engine)
    await loop.start()
    try:
        other = loop.submit(SimRequest("other", prompt(50, 7000), 30))
        handle = loop.submit(SimRequest("victim", prompt(300), 1000))
        assert handle.request_id == "victim"
        received = 0
        async for out in handle:
            received += len(out.new_token_ids)
            if received == 5:
                handle.abort()
                handle.abort()  # idempotent
        assert received == 5
        assert handle.finished
        tokens, _ = await asyncio.wait_for(collect(other), 10)
        assert len(tokens) == 30  # the neighbour is unaffected
        assert engine.kv_usage == 0 and not engine.has_work()
        assert engine.stats().request_success == {"abort": 1, "length": 1}
    finally:
        await loop.stop()


async def test_abort_from_another_task_wakes_a_waiting_consumer() -> None:
    slow = get_profile("fast").with_overrides(prefill_c=5000.0)  # the first step takes 5 s
    loop = EngineLoop(Engine(EngineConfig(num_blocks=64, block_size=16), slow))
    await loop.start()
    try:
        handle = loop.submit(SimRequest("r", prompt(10), 5))
        consumer = asyncio.create_task(collect(handle))
        await asyncio.sleep(0.01)
        handle.abort()
        # Well under the 5 s step the consumer would otherwise wait out, and generous.
        tokens, _ = await asyncio.wait_for(consumer, 3)
        assert tokens == []
        assert loop.engine.kv_usage == 0
    finally:
        await loop.stop()


async def test_stop_ends_open_streams_and_rejects_invalid_requests() -> None:
    loop = EngineLoop(Engine(EngineConfig(num_blocks=64, block_size=16, max_model_len=128), FAST))
    await loop.start()
    with pytest.raises(ValueError):
        loop.submit(SimRequest("too-long", prompt(128), 20))
    handle = loop.submit(SimRequest("r", prompt(10), 100))
    # The stream is open and under way (its first output in; waited for, not a fixed pause a
    # loaded host may spend before the first step) ...
    first = await asyncio.wait_for(anext(handle), 5)
    consumer = asyncio.create_task(collect(handle))
    await loop.stop()
    # ... and stopping ends it early (a bound only against hanging).
    rest, _ = await asyncio.wait_for(consumer, 5)
    tokens = first.new_token_ids + rest
    assert 0 < len(tokens) < 100
    assert not loop.engine.has_work()


async def test_a_crashing_engine_ends_streams_instead_of_hanging_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine(EngineConfig(num_blocks=64, block_size=16), FAST)
    loop = EngineLoop(engine)
    await loop.start()
    try:
        handle = loop.submit(SimRequest("r", prompt(10), 50))
        first = await asyncio.wait_for(anext(handle), 5)
        assert first.new_token_ids

        def boom(now: float) -> None:
            raise RuntimeError("engine bug")

        monkeypatch.setattr(engine, "step", boom)
        tokens, _ = await asyncio.wait_for(collect(handle), 5)
        assert len(tokens) < 49
        assert not loop.alive and isinstance(loop.error, RuntimeError)
        with pytest.raises(RuntimeError, match="not running"):
            loop.submit(SimRequest("later", prompt(10), 5))
    finally:
        await loop.stop()
