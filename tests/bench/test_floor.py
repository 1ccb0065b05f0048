"""The TTFT floor: exactly what the simulated engine takes for a request alone, never above what a
run on the same fleet measures, and without the requests the fleet refuses."""

from __future__ import annotations

import pytest

from bench.floor import alone_ttft, ttft_floor
from bench.metrics import dist
from bench.simulate import FleetSpec, ObservedFleet, PolicyRouter, PolicySpec, _arrivals
from bench.traces import SyntheticSpec, Trace, TraceRequest, synthetic
from workers.sim.engine import Engine
from workers.sim.engine_types import EngineConfig, SimRequest
from workers.sim.profiles import get_profile

PROFILE = get_profile("default")


def _engine_ttft(engine: Engine, req: SimRequest, now: float = 0.0) -> tuple[float, float]:
    """Step an engine holding only `req` until its first token: (TTFT, clock when it finished)."""
    engine.add_request(req, now)
    t = now
    first = None
    while engine.has_work():
        out = engine.step(t)
        t += out.duration
        if first is None and any(o.new_token_ids for o in out.outputs):
            first = t - now
    assert first is not None
    return first, t


def test_alone_ttft_is_what_the_engine_takes_cold_and_after_a_cached_prefix() -> None:
    config = EngineConfig(num_blocks=4096, block_size=16, max_model_len=65536)
    engine = Engine(config, PROFILE)
    a = list(range(10_000))  # 625 full blocks: all of it cached once it has run
    cold, t = _engine_ttft(engine, SimRequest("a", a, 1))
    assert cold == pytest.approx(alone_ttft(10_000, 0, PROFILE, 8192), rel=1e-12)
    # Two chunks (8,192 + 1,808): the second pays the context term for the first.
    one_step = alone_ttft(10_000, 0, PROFILE, 10**9)
    assert cold != pytest.approx(one_step)
    warm, _ = _engine_ttft(engine, SimRequest("b", a + list(range(50_000, 55_000)), 1), t)
    assert warm == pytest.approx(alone_ttft(5_000, 10_000, PROFILE, 8192), rel=1e-12)
    # Context makes the same 5,000 tokens dearer than on an empty cache.
    assert warm > alone_ttft(5_000, 0, PROFILE, 8192)


def _spaced(trace: Trace, gap_s: float) -> Trace:
    """The same requests, far enough apart that each runs alone."""
    for i, r in enumerate(trace.requests):
        r.arrival_s = i * gap_s
    return trace


SPEC = SyntheticSpec(
    groups=3, users=2, system_tokens=512, question_tokens=64, output_tokens=4,
    rate=40.0, num_requests=40, block_size=16, seed=5,
)  # fmt: skip


def _run(trace: Trace, fleet: FleetSpec, policy: str) -> dict[str, float]:
    """Each request's simulated TTFT by request id."""
    router = PolicyRouter(
        PolicySpec.parse(policy),
        {r.request_id: r for r in trace.requests},
        fleet.workers,
        seed=0,
        keys="trace",
        trace_block=trace.block_size,
    )
    engines = fleet.engines()
    router.attach(engines, fleet.block_size)
    result = ObservedFleet(engines, router).run(_arrivals(trace.requests, None))
    return {
        r.request_id: r.first_token_time - r.arrival
        for r in result.results
        if r.first_token_time is not None
    }


def test_one_worker_with_room_for_everything_runs_every_request_on_its_floor() -> None:
    # One worker, a cache larger than the trace, requests that never overlap: the engine holds
    # exactly what the infinite-cache bound holds, so each request's TTFT is its floor.
    trace = _spaced(synthetic(SPEC), 5.0)
    fleet = FleetSpec(workers=1, num_blocks=20_000, block_size=16, max_model_len=8192)
    measured = _run(trace, fleet, "round_robin")
    floor = fleet.ttft_floor(trace.requests)
    assert len(floor) == len(measured) == 40
    got = [measured[r.request_id] for r in trace.requests]
    assert got == pytest.approx(floor, rel=1e-9)
    assert max(floor) > 1.2 * min(floor)  # each group's first request is cold, the rest warm


@pytest.mark.parametrize("policy", ["round_robin", "kv_aware"])
def test_a_loaded_fleet_never_beats_the_floor(policy: str) -> None:
    trace = synthetic(SPEC)  # 40 req/s onto 3 small workers: queues and evictions
    fleet = FleetSpec(workers=3, num_blocks=200, block_size=16, max_model_len=4096)
    measured = _run(trace, fleet, policy)
    floor = dict(
        zip([r.request_id for r in trace.requests], fleet.ttft_floor(trace.requests), strict=True)
    )
    assert len(measured) == 40
    assert all(measured[rid] >= floor[rid] * (1 - 1e-9) for rid in measured)
    assert dist(list(measured.values()))["p99"] > dist(list(floor.values()))["p99"]


def test_requests_the_fleet_refuses_have_no_floor() -> None:
    def req(i: int, n: int) -> TraceRequest:
        return TraceRequest(i * 1.0, f"r{i}", n, 10, 16, list(range(i * 1000, i * 1000 + n // 16)))

    reqs = [req(0, 320), req(1, 5_000), req(2, 320)]  # 5,000 + 10 tokens > 4,096 of context
    floor = ttft_floor(
        reqs, PROFILE, max_num_batched_tokens=8192, kv_tokens=200 * 16, max_model_len=4096
    )
    assert floor == [alone_ttft(320, 0, PROFILE, 8192)] * 2
    small_cache = ttft_floor(
        reqs[:1], PROFILE, max_num_batched_tokens=8192, kv_tokens=320, max_model_len=4096
    )
    assert small_cache == []  # 330 tokens need 21 blocks of 16: more than 320 tokens of KV
