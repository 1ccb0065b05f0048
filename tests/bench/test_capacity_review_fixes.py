"""bench.capacity and the pacing it feeds: refused requests (a 400 at any rate) are left out of
the verdict, and the rate a search reports is the rate a replay paced by it runs at (review of the
simulator and bench tools, findings 5 and 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.capacity import (
    Objective,
    Search,
    _base_rate,
    answer_lines,
    capacity_of,
    main,
    passes,
)
from bench.simulate import FleetSpec, PolicySpec, RunContext
from bench.traces import Trace, TraceError, TraceRequest, mean_rate, rate_time_scale, write_jsonl

FLEET = FleetSpec(workers=1, num_blocks=1024, max_model_len=4096)
OBJ = [Objective("ttft", "p95", 2.0)]


def _r(t: float, rid: str, n: int) -> TraceRequest:
    r = TraceRequest(t, rid, n, 4, 16, [f"{rid}:{i}" for i in range(n // 16)])
    r.validate()
    return r


def _light_plus_huge() -> Trace:
    reqs = [_r(float(i), f"r{i}", 200) for i in range(10)] + [_r(10.5, "huge", 5000)]
    return Trace(reqs, "t", "kvgate")


def test_a_refused_request_does_not_zero_the_capacity() -> None:
    logs: list[str] = []
    rr = PolicySpec.parse("round_robin")
    cap = capacity_of(_light_plus_huge(), FLEET, rr, OBJ, iterations=1, max_log2=2, log=logs.append)
    assert cap is not None and cap.at_least and cap.rate_scale == 4.0
    without = Trace(_light_plus_huge().requests[:10], "t", "kvgate")
    same = capacity_of(without, FLEET, rr, OBJ, iterations=1, max_log2=2, log=lambda s: None)
    assert same is not None and same.rate_scale == cap.rate_scale


def test_passes_needs_every_served_request_finished() -> None:
    ok = {"ttft": {"p95": 0.1}}
    assert passes({"requests": 3, "completed": 2, "failed": 1, **ok}, OBJ)
    assert not passes({"requests": 3, "completed": 1, "failed": 1, **ok}, OBJ)
    assert not passes({"requests": 2, "completed": 0, "failed": 2, "ttft": {"p95": None}}, OBJ)


def test_an_all_refused_trace_has_no_capacity_and_no_traceback() -> None:
    trace = Trace([_r(0.0, "h0", 5000), _r(1.0, "h1", 5000)], "t", "kvgate")
    logs: list[str] = []
    rr = PolicySpec.parse("round_robin")
    assert capacity_of(trace, FLEET, rr, OBJ, iterations=1, max_log2=1, log=logs.append) is None
    assert any("refuses all 2 requests" in line for line in logs)


def test_the_cli_states_refusals_and_stops_on_an_all_refused_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(path, _light_plus_huge())
    argv = ["--trace", str(path), "--workers", "1", "--num-blocks", "1024"]
    argv += ["--max-model-len", "4096", "--policies", "round_robin", "--jobs", "1"]
    argv += ["--iterations", "1", "--max-scale", "2", "--png", str(tmp_path / "c.png")]
    assert main([*argv, "--json", str(tmp_path / "c.json")]) == 0
    out = json.loads((tmp_path / "c.json").read_text())
    assert out["refused_requests"] == 1
    assert out["answers"][0]["rate_scale"] == 2.0
    assert "1 requests refused at every rate" in out["lines"][-1]
    write_jsonl(path, Trace([_r(0.0, "h0", 5000), _r(1.0, "h1", 5000)], "t", "kvgate"))
    with pytest.raises(SystemExit) as e:
        main([*argv, "--json", str(tmp_path / "c.json")])
    assert e.value.code == 2
    assert "refuses all 2 requests" in capsys.readouterr().err


def test_answer_lines_state_refusals() -> None:
    s = Search(PolicySpec.parse("round_robin"))
    lines = answer_lines([s], OBJ, 2.0, 4, refused=3)
    assert lines[0].startswith("4 workers hold none of the probed rates")
    assert "3 requests refused" in lines[1]


def test_the_capacity_rate_replays_at_time_scale_one() -> None:
    reqs = [_r(float(i), f"r{i}", 64) for i in range(5)]
    trace = Trace(reqs, "t", "kvgate")
    base = _base_rate(RunContext(trace=trace, fleet=FleetSpec()))
    assert base == mean_rate(trace) == 1.0  # 4 gaps over 4 s
    assert rate_time_scale(trace, base) == 1.0
    assert rate_time_scale(trace, 2 * base) == 0.5  # --load 2: twice the rate


def test_a_trace_without_a_span_has_no_rate_to_set() -> None:
    one = Trace([_r(3.0, "a", 64)], "t", "kvgate")
    same_instant = Trace([_r(3.0, "a", 64), _r(3.0, "b", 64)], "t", "kvgate")
    for trace in (one, same_instant):
        assert mean_rate(trace) is None
        with pytest.raises(TraceError):
            rate_time_scale(trace, 5.0)
        with pytest.raises(TraceError):
            _base_rate(RunContext(trace=trace, fleet=FleetSpec()))
