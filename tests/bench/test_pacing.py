"""bench.compare's pacing: `--load F` replays the sample at F x round-robin's capacity on the
fleet it runs (an offline search), the default when no rate is given, so a comparison runs near
saturation on any trace instead of at a rate guessed for another one."""

from __future__ import annotations

import argparse

import pytest

from bench.capacity import Objective, passes
from bench.compare import DEFAULT_LOAD, SimFleet, build_parser, pace
from bench.simulate import PolicySpec, simulate_policy
from bench.traces import load_trace, scale_time

TRACE = "conversation:sessions=16,session_rate=2,max_turns=4,seed=3"
FLEET = SimFleet(workers=2, num_blocks=4096, profile="default", gpu_slowdown=1.0)


def args(**kw: float | None) -> argparse.Namespace:
    return argparse.Namespace(**{"rate": None, "time_scale": None, "load": None, "seed": 0, **kw})


def mean_rate(trace: object) -> float:
    return (len(trace.requests) - 1) / trace.duration_s  # type: ignore[attr-defined]


def test_load_replays_at_a_fraction_of_a_capacity_round_robin_really_has() -> None:
    trace = load_trace(TRACE)
    paced, info = pace(trace, args(load=0.5), FLEET, lambda s: None)
    assert info["by"] == "load" and info["load"] == 0.5
    cap = info["capacity_req_s"]
    assert mean_rate(paced) == pytest.approx(0.5 * cap, rel=1e-3)
    # The capacity is the search's: round-robin holds the objective there and not at 4x. The
    # objective is the trace's own: at least 2 s, 2x its unloaded TTFT p95.
    assert info["objective_ttft_p95_s"] >= 2.0
    rr = PolicySpec.parse("round_robin")
    objective = [Objective("ttft", "p95", info["objective_ttft_p95_s"])]
    base = mean_rate(trace)
    at = simulate_policy(scale_time(trace, base / cap), rr, FLEET.spec())
    assert passes(at, objective)
    if not info["capacity_at_least"]:
        over = simulate_policy(scale_time(trace, base / (4 * cap)), rr, FLEET.spec())
        assert not passes(over, objective)


def test_the_default_is_load_and_an_explicit_clock_is_kept() -> None:
    trace = load_trace(TRACE)
    _, info = pace(trace, args(), FLEET, lambda s: None)
    assert info["by"] == "load" and info["load"] == DEFAULT_LOAD
    paced, info = pace(trace, args(rate=3.0), FLEET, lambda s: None)
    assert info["by"] == "rate" and mean_rate(paced) == pytest.approx(3.0, rel=1e-3)
    paced, info = pace(trace, args(time_scale=0.5), FLEET, lambda s: None)
    assert info == {"by": "time_scale", "time_scale": 0.5}
    assert paced.duration_s == pytest.approx(trace.duration_s * 0.5, rel=1e-6)


def test_long_prompts_are_paced_against_their_own_unloaded_ttft() -> None:
    # Prompts that take longer than 2 s to prefill on an idle worker (4k-token turns on a
    # slowed-down fleet): a fixed 2 s objective would find no rate at all.
    slow = SimFleet(workers=2, num_blocks=4096, profile="default", gpu_slowdown=40.0)
    trace = load_trace(TRACE.replace("sessions=16", "sessions=8") + ",system_tokens=4000")
    paced, info = pace(trace, args(load=0.9), slow, lambda s: None)
    assert info["objective_ttft_p95_s"] > 2.0  # 2x an unloaded p95 above 1 s
    assert mean_rate(paced) == pytest.approx(0.9 * info["capacity_req_s"], rel=1e-3)


def test_one_clock_at_a_time() -> None:
    from bench.compare import main

    with pytest.raises(SystemExit):
        main(["--rate", "2", "--load", "0.5"])
    assert build_parser().parse_args([]).load is None
