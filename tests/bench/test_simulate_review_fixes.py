"""bench.simulate and bench.traces: rates over the replay's own span, text-prompt records,
bounds over the requests the fleet serves, medians over seeds, one-line CLI errors, and keys that
tell block sizes apart (review of the simulator and bench tools, findings 1-3, 6, 9, 10)."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest

from bench.simulate import FleetSpec, PolicySpec, main, over_seeds, simulate_policy
from bench.traces import (
    Trace,
    TraceError,
    TraceRequest,
    cache_bound,
    chain_keys,
    load_trace,
    prompt_token_ids,
    read_jsonl,
    sample,
    write_jsonl,
)
from workers.sim.tokenizer import encode


def _req(t: float, rid: str, n: int, ids: list, out: int = 4, bs: int = 16) -> TraceRequest:
    r = TraceRequest(t, rid, n, out, bs, ids)
    r.validate()
    return r


# -- finding 1: req/s over the replay's span, not from t=0 ------------------------------------


def test_throughput_is_over_the_span_from_the_first_arrival() -> None:
    reqs = [_req(float(i), f"r{i}", 64, [f"r{i}:{k}" for k in range(4)]) for i in range(10)]
    win = sample(Trace(reqs, "t", "kvgate"), 2, seed=0, by="window")  # keeps its arrival times
    assert [r.arrival_s for r in win.requests] == [6.0, 7.0]
    out = simulate_policy(win, PolicySpec.parse("round_robin"), FleetSpec(workers=1))
    assert out["completed"] == 2
    assert out["span_s"] == pytest.approx(out["duration_s"] - 6.0)
    assert out["throughput"]["requests_s"] == pytest.approx(2 / out["span_s"])
    assert out["goodput"]["requests_s"] == pytest.approx(2 / out["span_s"])
    # The same requests re-based at 0 report the same rates.
    rebased = sample(Trace(reqs, "t", "kvgate"), 2, seed=0, by="window", keep_times=False)
    again = simulate_policy(rebased, PolicySpec.parse("round_robin"), FleetSpec(workers=1))
    assert again["throughput"]["requests_s"] == pytest.approx(out["throughput"]["requests_s"])


# -- finding 2: text-prompt records -----------------------------------------------------------


def _text(rid: str, n: int, prompt: str) -> TraceRequest:
    r = TraceRequest(0.0, rid, n, 4, 16, [], prompt=prompt)
    r.validate()
    return r


@pytest.mark.parametrize("n", [1, 5_000, 300_000])
def test_a_text_prompt_record_materialises_input_length_tokens(n: int) -> None:
    assert len(prompt_token_ids(_text("r0", n, "word " * 10))) == n


def test_text_prompts_start_with_their_tokens_so_shared_text_is_shared_prefix() -> None:
    system = "You are a helpful assistant. " * 40
    a = prompt_token_ids(_text("a", 600, system + "first question"))
    b = prompt_token_ids(_text("b", 600, system + "another one"))
    shared = len(encode(system)) - 1  # the trailing space joins the next word
    assert a[:shared] == b[:shared] == encode(system)[:shared]
    assert a[shared + 5 :] != b[shared + 5 :]  # the rest is each request's own
    # A tokenization longer than input_length is cut to it.
    assert prompt_token_ids(_text("c", 7, system)) == encode(system)[:7]


def test_a_text_prompt_longer_than_the_context_is_refused_not_a_crash() -> None:
    trace = Trace([_text("r0", 300_000, "word " * 10)], "t", "kvgate")
    out = simulate_policy(trace, PolicySpec.parse("round_robin"), FleetSpec(workers=1))
    assert out["failed_by_reason"] == {"context_length": 1}


def test_block_id_prompts_are_unchanged_by_the_long_tail_fix() -> None:
    r = _req(0.0, "x", 100, [1, 2, 3, 4, 5, 6])
    assert prompt_token_ids(r)[:96] == prompt_token_ids(_req(0.0, "y", 96, [1, 2, 3, 4, 5, 6]))


# -- finding 3: bounds and floor over the requests the fleet serves ---------------------------


def test_the_bound_leaves_out_refused_requests_so_no_policy_beats_it() -> None:
    reqs = [
        _req(0.0, "big", 8000, [f"big:{i}" for i in range(500)]),  # > max_model_len: refused
        _req(1.0, "a", 160, [f"p:{i}" for i in range(10)]),
        _req(2.0, "b", 160, [f"p:{i}" for i in range(10)]),
    ]
    fleet = FleetSpec(workers=2, num_blocks=1024, max_model_len=4096)
    out = simulate_policy(Trace(reqs, "t", "kvgate"), PolicySpec.parse("prefix"), fleet)
    assert out["failed_by_reason"] == {"context_length": 1}
    assert out["bound_hit_rate"] == pytest.approx(144 / 320)
    assert out["hit_rate"] <= out["bound_hit_rate"] + 1e-12
    assert out["hit_vs_bound"] == pytest.approx(1.0)


def test_a_refused_request_seeds_neither_the_bound_nor_the_floor() -> None:
    a = _req(0.0, "a", 5000, [f"p:{i}" for i in range(313)])  # refused: 5000 >= 4096
    b = _req(1.0, "b", 3000, [f"p:{i}" for i in range(188)])  # a's first 3,000 tokens
    fleet = FleetSpec(workers=1, num_blocks=1024, max_model_len=4096)
    assert fleet.servable([a, b]) == [b]
    out = simulate_policy(Trace([a, b], "t", "kvgate"), PolicySpec.parse("round_robin"), fleet)
    assert out["hit_rate"] == 0.0 and out["bound_hit_rate"] == 0.0
    assert out["pooled_bound_hit_rate"] == 0.0
    # b's floor is its cold prefill, exactly what the run measured (alone on an idle worker).
    (floor,) = fleet.ttft_floor([a, b])
    assert floor == pytest.approx(out["ttft"]["p50"], rel=1e-9)


def test_the_report_bounds_count_only_served_requests(tmp_path: Path) -> None:
    reqs = [
        _req(0.0, "big", 8000, [f"big:{i}" for i in range(500)]),
        _req(1.0, "a", 160, [f"p:{i}" for i in range(10)]),
        _req(2.0, "b", 160, [f"p:{i}" for i in range(10)]),
    ]
    path = tmp_path / "t.jsonl"
    write_jsonl(path, Trace(reqs, "t", "kvgate"))
    out = tmp_path / "r.json"
    argv = ["--trace", str(path), "--workers", "2", "--num-blocks", "1024"]
    argv += ["--max-model-len", "4096", "--policies", "prefix", "--jobs", "1", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["trace"]["bound"]["requests"] == 2
    assert report["trace"]["bound"]["prompt_tokens"] == 320
    (p,) = report["policies"]
    assert p["hit_rate"] <= report["trace"]["bound"]["token_hit_rate"] + 1e-12


# -- finding 6: --seeds medians for every figure the table prints ------------------------------


def test_over_seeds_takes_the_median_of_every_printed_figure() -> None:
    reqs = [_req(i * 0.1, f"r{i}", 160, [f"p:{k}" for k in range(10)], out=8) for i in range(6)]
    base = simulate_policy(
        Trace(reqs, "t", "kvgate"), PolicySpec.parse("kv_aware"), FleetSpec(workers=2)
    )
    runs = []
    for k, (pre, rps, bal) in enumerate([(9, 1.0, 3.0), (1, 2.0, 1.0), (2, 3.0, 2.0)]):
        r = copy.deepcopy(base)
        r["preempted_requests"] = pre
        r["preemptions"] = pre * 2
        r["throughput"]["requests_s"] = rps
        r["throughput"]["output_tokens_s"] = rps * 10
        r["load"]["requests_max_over_mean"] = bal
        r["reasons"] = {"x": k}
        runs.append(r)
    out = over_seeds(runs, [0, 1, 2])
    assert out["throughput"]["requests_s"] == 2.0
    assert out["throughput"]["output_tokens_s"] == 20.0
    assert out["preempted_requests"] == 2 and out["preemptions"] == 4
    assert out["load"]["requests_max_over_mean"] == 2.0
    assert out["reasons"] == {"x": 1}
    assert [s["requests_s"] for s in out["per_seed"]] == [1.0, 2.0, 3.0]
    assert [s["preempted_requests"] for s in out["per_seed"]] == [9, 1, 2]
    assert runs[0]["throughput"]["requests_s"] == 1.0  # the runs themselves are untouched
    assert out["hit_rate"] == statistics.median(r["hit_rate"] for r in runs)


# -- finding 9: one-line errors instead of tracebacks ------------------------------------------

REC = {"arrival_s": 0, "request_id": "a", "input_length": 100, "output_length": 5,
       "block_size": 16, "block_ids": [1, 2, 3, 4, 5, 6]}  # fmt: skip


def _usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trace: str, policies: str = "round_robin"
) -> str:
    argv = ["--trace", trace, "--workers", "1", "--policies", policies, "--jobs", "1", "--quiet"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--json", str(tmp_path / "o.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_record_missing_a_field_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = dict(REC)
    del rec["output_length"]
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    assert "t.jsonl:1: missing field 'output_length'" in _usage_error(tmp_path, capsys, str(p))
    with pytest.raises(TraceError):  # and a ValueError still, for callers catching that
        read_jsonl(p)


def test_a_trace_without_requests_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"kvgate_trace": 1, "notes": []}) + "\n")
    assert "no request" in _usage_error(tmp_path, capsys, str(p))


@pytest.mark.parametrize("spec", ["conversation:sessions=0", "synthetic:rate=x"])
def test_a_bad_generator_spec_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str
) -> None:
    _usage_error(tmp_path, capsys, spec)
    with pytest.raises(TraceError):
        load_trace(spec)


@pytest.mark.parametrize("policies", ["roundrobin", "kv_aware[nope=1]", "kv_aware[queue=x]"])
def test_a_bad_policy_is_a_usage_error_before_the_trace_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policies: str
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(REC) + "\n")
    assert "--policies" in _usage_error(tmp_path, capsys, str(p), policies)


def test_every_known_policy_parses() -> None:
    for name in ("round_robin", "least_loaded", "prefix", "kv_aware", "kv_aware_precise"):
        assert PolicySpec.parse(name).check().name == name
    with pytest.raises(ValueError, match="unknown routing policy 'roundrobin'"):
        PolicySpec.parse("roundrobin").check()


# -- finding 10: equal ids at different block sizes are different blocks -----------------------


def test_the_bound_does_not_equate_ids_across_block_sizes() -> None:
    a = _req(0.0, "a", 100, [1, 2, 3, 4, 5, 6], bs=16)
    b = _req(1.0, "b", 100, [1, 2], bs=64)
    assert chain_keys(a)[0] != chain_keys(b)[0]
    assert cache_bound([a, b]).hit_tokens == 0
    # Same block size: still equal keys, still a hit.
    c = _req(2.0, "c", 100, [1, 2, 3, 4, 5, 6], bs=16)
    assert chain_keys(c) == chain_keys(a)
    assert cache_bound([a, c]).hit_tokens == 96


def test_the_pooled_lru_counts_tokens_across_block_sizes() -> None:
    a = _req(0.0, "a", 64, [f"a:{i}" for i in range(4)], bs=16)  # 64 tokens
    b = _req(1.0, "b", 128, ["b:0", "b:1"], bs=64)  # 128 tokens: evicts a from a 160-token LRU
    a2 = _req(2.0, "a2", 64, [f"a:{i}" for i in range(4)], bs=16)
    assert cache_bound([a, b, a2], capacity_tokens=192).hit_tokens == 48
    # 160 tokens: b evicts a's last two blocks (touched tail first: the prefix outlives them)
    assert cache_bound([a, b, a2], capacity_tokens=160).hit_tokens == 32
