"""Offline simulation: real policies on the virtual clock, deterministic, and the report schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.capacity import Objective, Search, passes
from bench.replicas import ShareModel
from bench.simulate import (
    FleetSpec,
    ObservedFleet,
    PolicyRouter,
    PolicySpec,
    _arrivals,
    main,
    simulate_policy,
    split_policies,
)
from bench.traces import SyntheticSpec, Trace, TraceRequest, chain_keys, sort_requests, synthetic

SPEC = SyntheticSpec(
    groups=4, users=2, system_tokens=512, question_tokens=64, output_tokens=8,
    rate=40.0, num_requests=80, block_size=16, seed=3,
)  # fmt: skip
FLEET = FleetSpec(workers=3, num_blocks=200, block_size=16, max_model_len=4096)
SYNTH = "synthetic:groups=4,users=2,system_tokens=512,question_tokens=64,output_tokens=8,rate=40,num_requests=60,block_size=16"


def _strip(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("wall_s", "cpu_s")}


def test_same_seed_same_numbers() -> None:
    trace = synthetic(SPEC)
    for name in ("least_loaded", "kv_aware"):
        a = simulate_policy(trace, PolicySpec.parse(name), FLEET, seed=7)
        b = simulate_policy(trace, PolicySpec.parse(name), FLEET, seed=7)
        assert _strip(a) == _strip(b)
        assert a["completed"] == a["requests"] == 80


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes() -> None:
    trace = synthetic(SPEC)
    rr = simulate_policy(trace, PolicySpec.parse("round_robin"), FLEET)
    kv = simulate_policy(trace, PolicySpec.parse("kv_aware"), FLEET)
    assert rr["load"]["requests_per_worker"] == [27, 27, 26]
    assert rr["load"]["requests_max_over_mean"] == pytest.approx(27 / (80 / 3))
    assert kv["hit_rate"] > rr["hit_rate"]
    assert kv["hit_rate"] <= kv["bound_hit_rate"] + 0.05  # engine blocks may beat trace blocks
    assert kv["hit_vs_bound"] == pytest.approx(kv["hit_rate"] / kv["bound_hit_rate"])
    assert sum(kv["reasons"].values()) == 80 and kv["reasons"].get("affinity", 0) > 0
    for metric in ("ttft", "tpot", "itl", "e2e"):
        d = kv[metric]
        assert d["p50"] <= d["p90"] <= d["p95"] <= d["p99"] <= d["max"]


def kv_aware_router(trace: Trace, **replicas: Any) -> PolicyRouter:
    """kv_aware over FLEET on trace block keys (what the bookkeeping tests drive by hand)."""
    return PolicyRouter(
        PolicySpec.parse("kv_aware"),
        {r.request_id: r for r in trace.requests},
        FLEET.workers,
        seed=0,
        keys="trace",
        trace_block=16,
        **replicas,
    )


def test_prefill_bookkeeping_returns_to_zero() -> None:
    trace = synthetic(SPEC)
    router = kv_aware_router(trace)
    seen: list[int] = []
    inner = router.__call__

    def spy(arrival, fleet):  # type: ignore[no-untyped-def]
        seen.append(sum(router.prefill))
        return inner(arrival, fleet)

    sim = ObservedFleet(FLEET.engines(), router)
    sim.route = spy  # the fleet calls the router through this attribute
    result = sim.run(_arrivals(trace.requests, None))
    assert len(result.results) == 80
    assert max(seen) > 0  # requests were waiting for their first token at some arrivals
    assert router.pending == {} and router.prefill == [0, 0, 0] and router.awaiting == [0, 0, 0]


@pytest.mark.parametrize("share", ["none", "all"])
def test_every_replica_s_counts_return_to_zero(share: str) -> None:
    # Each replica counts its own requests (and, shared, the others' once delivered): after the
    # last completion has reached everyone, nobody counts anything anywhere.
    trace = synthetic(SPEC)
    router = kv_aware_router(trace, replicas=3, share=ShareModel.parse(share, 0.1))
    peak: list[int] = []
    inner = router.__call__

    def spy(arrival, fleet):  # type: ignore[no-untyped-def]
        peak.append(max(x.in_flight for row in router.sync.seen for x in row))
        return inner(arrival, fleet)

    sim = ObservedFleet(FLEET.engines(), router)
    sim.route = spy
    assert len(sim.run(_arrivals(trace.requests, None)).results) == 80
    assert max(peak) > 0 and router.running == {} and router.pending == {}
    router.sync.deliver(float("inf"))
    sync = router.sync
    for table in (sync.seen, sync.own):
        assert [[(x.in_flight, x.prefill_tokens) for x in row] for row in table] == [
            [(0, 0)] * 3
        ] * 3
    assert (sync.delivered > 0) == (share != "none")


def test_gateway_keys_route_like_the_gateway() -> None:
    trace = synthetic(SPEC)
    out = simulate_policy(trace, PolicySpec.parse("kv_aware"), FLEET, keys="gateway")
    rr = simulate_policy(trace, PolicySpec.parse("round_robin"), FLEET, keys="gateway")
    assert out["hit_rate"] > rr["hit_rate"]


def test_policy_variants_parse() -> None:
    assert split_policies("a,kv_aware[queue=0.4;affinity_slack=3],b") == [
        "a",
        "kv_aware[queue=0.4;affinity_slack=3]",
        "b",
    ]
    s = PolicySpec.parse("kv_aware[queue=0.4;affinity_slack=3]", options={"sample_size": 4})
    assert s.name == "kv_aware" and dict(s.weights) == {"queue": 0.4}
    assert dict(s.options) == {"affinity_slack": 3.0, "sample_size": 4}
    o = s.routing_options(512, "trace")
    assert o.text_block_tokens == 512 and o.sample_size == 4 and isinstance(o.sample_size, int)
    with pytest.raises(ValueError, match="neither"):
        PolicySpec.parse("kv_aware[nope=1]")


def test_cli_report_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = ["--trace", SYNTH, "--workers", "2", "--num-blocks", "200", "--max-model-len", "4096"]
    argv += ["--policies", "round_robin,kv_aware", "--json", str(out), "--quiet", "--jobs", "1"]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert [p["policy"] for p in r["policies"]] == ["round_robin", "kv_aware"]
    for p in r["policies"]:
        for k in ("hit_rate", "bound_hit_rate", "hit_vs_bound", "goodput", "throughput", "load"):
            assert k in p
        assert set(p["ttft"]) >= {"mean", "p50", "p90", "p95", "p99"}
        assert p["ttft"]["p99"] >= p["ttft"]["p50"] > 0
        assert 0 <= p["hit_rate"] <= 1 and p["preempted_requests"] >= 0
    assert r["seed"] == 0 and r["fleet"]["workers"] == 2 and r["units"] == "seconds"
    assert r["trace"]["requests"] == 60 and "bound" in r["trace"] and "cores" in r["machine"]
    assert "virtual-clock simulation" in capsys.readouterr().out


def test_forked_jobs_give_the_same_numbers(tmp_path: Path) -> None:
    base = ["--trace", SYNTH, "--workers", "2", "--num-blocks", "200", "--max-model-len", "4096"]
    base += ["--policies", "least_loaded,kv_aware", "--quiet"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    main([*base, "--jobs", "1", "--json", str(a)])
    main([*base, "--jobs", "2", "--json", str(b)])
    pa = [_strip(p) for p in json.loads(a.read_text())["policies"]]
    pb = [_strip(p) for p in json.loads(b.read_text())["policies"]]
    assert pa == pb


# -- capacity search -------------------------------------------------------------------------------
def _fake(limit: float, rate_scale: float) -> dict:
    v = 0.5 if rate_scale <= limit else 5.0
    return {"requests": 1, "completed": 1, "ttft": {"p95": v}}


def test_capacity_search_brackets_then_bisects() -> None:
    obj = [Objective("ttft", "p95", 2.0)]
    for limit in (0.3, 1.0, 5.5, 40.0):
        s = Search(PolicySpec.parse("x"))
        while (r := s.next_scale(iterations=6, max_log2=6)) is not None:
            s.record(r, _fake(limit, r), passes(_fake(limit, r), obj))
        assert s.answer_scale is not None
        assert s.answer_scale <= limit < s.answer_scale * 2 ** (1 / 32)
        assert len(s.probes) <= 7 + 6  # bracket within 2**6, then 6 bisections


def test_capacity_search_never_passes_and_unfinished_fails() -> None:
    obj = [Objective("ttft", "p95", 2.0)]
    s = Search(PolicySpec.parse("x"))
    while (r := s.next_scale(iterations=3, max_log2=3)) is not None:
        s.record(r, _fake(0.01, r), passes(_fake(0.01, r), obj))
    assert s.answer_scale is None and len(s.probes) == 4  # 1, 1/2, 1/4, 1/8
    assert not passes({"requests": 2, "completed": 1, "ttft": {"p95": 0.1}}, obj)


def test_replicas_split_what_the_approximate_index_learns_but_not_the_kv_events() -> None:
    # 8 system prompts x 4 users on 4 workers. One gateway sees every dispatch; four replicas
    # each see a quarter, so the approximate index scatters prefixes, while every replica reads
    # the same KV events and keeps them together.
    spec = SyntheticSpec(
        groups=8, users=4, system_tokens=1024, question_tokens=64, output_tokens=8,
        rate=20.0, num_requests=240, block_size=16, seed=3,
    )  # fmt: skip
    fleet = FleetSpec(workers=4, num_blocks=400, block_size=16, max_model_len=4096)
    trace = synthetic(spec)

    def run(name: str, replicas: int, share: ShareModel | None = None) -> dict:
        out = simulate_policy(
            trace, PolicySpec.parse(name), fleet, keys="gateway", replicas=replicas, share=share
        )
        assert out["replicas"] == replicas and out["requests"] == 240
        return out

    def hit(name: str, replicas: int, share: ShareModel | None = None) -> float:
        return float(run(name, replicas, share)["hit_rate"])

    one = hit("kv_aware", 1)
    independent = run("kv_aware", 4)
    assert independent["share"]["model"] == "independent"
    assert independent["hit_rate"] < one - 0.03
    assert hit("kv_aware_precise", 4) >= one - 0.01
    # Sharing what each replica learns, as [cluster] does, gives the hits back: all of them when
    # the others learn at once, most of them a sync (0.1 s) or even a second late.
    instant = run("kv_aware", 4, ShareModel.parse("all", 0.0))
    assert instant["share"] == {
        "model": "shared", "parts": ["load", "index", "sessions", "pending"], "delay_s": 0.0,
        "label": "shared all, 0 s late",
    }  # fmt: skip
    assert instant["hit_rate"] == pytest.approx(one, abs=0.005)
    late = hit("kv_aware", 4, ShareModel.parse("all", 1.0))
    assert independent["hit_rate"] + 0.05 < late <= one + 0.005
    # Load alone does not: the prefixes still scatter.
    assert hit("kv_aware", 4, ShareModel.parse("load")) < one - 0.03
    with pytest.raises(ValueError):
        hit("kv_aware", 0)


def test_cli_replica_model_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    base = ["--trace", SYNTH, "--workers", "2", "--num-blocks", "200", "--max-model-len", "4096"]
    base += ["--policies", "kv_aware", "--json", str(out), "--quiet", "--jobs", "1"]
    assert (
        main([*base, "--replicas", "3", "--share", "index,sessions", "--share-delay-s", "0.2"]) == 0
    )
    r = json.loads(out.read_text())
    assert r["replicas"] == 3 and r["policies"][0]["replicas"] == 3
    want = {"model": "shared", "parts": ["index", "sessions"], "delay_s": 0.2}
    assert (
        {k: r["share"][k] for k in want} == want == {k: r["policies"][0]["share"][k] for k in want}
    )
    printed = " ".join(capsys.readouterr().out.split())
    assert "3 gateway replicas: shared index+sessions, 0.2 s late" in printed
    assert main([*base, "--replicas", "2"]) == 0
    assert json.loads(out.read_text())["share"]["model"] == "independent"
    for bad in (
        ["--replicas", "2", "--share-delay-s", "0.2"],  # a delay with nothing shared
        ["--replicas", "2", "--share", "everything"],
        ["--replicas", "2", "--share", "all", "--share-delay-s", "-1"],
        ["--replicas", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            main([*base, *bad])
        assert e.value.code == 2


def _with_refused() -> tuple[Trace, list[TraceRequest]]:
    """SPEC's trace plus four requests longer than the worker's whole KV cache (200 x 16 tokens)
    or than max_model_len (4096), which vLLM answers with a 400."""
    base = synthetic(SPEC).requests
    too_big = []
    for tokens, tag in ((3400, "kv"), (5000, "ctx")):
        spec = SyntheticSpec(
            groups=1, users=1, system_tokens=tokens, question_tokens=16, output_tokens=8,
            rate=40.0, num_requests=2, block_size=16, seed=9,
        )  # fmt: skip
        for r in synthetic(spec).requests:
            r.request_id = f"{tag}-{r.request_id}"
            too_big.append(r)
    return Trace(sort_requests(base + too_big), "test", "synthetic"), too_big


def test_requests_that_cannot_fit_are_refused_like_vllm_and_the_run_goes_on() -> None:
    """The replay counts refusals per reason and the other requests run as usual."""
    trace, _ = _with_refused()
    for share in (None, ShareModel.parse("all", 0.1)):
        out = simulate_policy(
            trace,
            PolicySpec.parse("kv_aware"),
            FLEET,
            replicas=1 if share is None else 2,
            share=share,
        )
        assert out["requests"] == 84 and out["completed"] == 80
        assert out["failed"] == 4
        assert out["failed_by_reason"] == {"context_length": 2, "exceeds_kv_cache": 2}
        assert out["goodput"]["fraction"] <= 80 / 84


def test_the_policy_forgets_the_requests_the_engine_refused() -> None:
    trace, too_big = _with_refused()
    router = kv_aware_router(trace)
    result = ObservedFleet(FLEET.engines(), router).run(_arrivals(trace.requests, None))
    assert sum(r.rejected is not None for r in result.results) == 4
    index = router.policies[0].state.index
    assert all(index.match(chain_keys(r)) == {} for r in too_big)
    assert any(index.match(chain_keys(r)) for r in trace.requests if r not in too_big)
    assert router.learned == {} and router.pending == {}


def test_several_seeds_report_medians_and_the_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import statistics

    out = tmp_path / "r.json"
    argv = ["--trace", SYNTH, "--workers", "3", "--num-blocks", "200", "--max-model-len", "4096"]
    argv += ["--policies", "kv_aware", "--json", str(out), "--quiet", "--jobs", "1"]
    assert main([*argv, "--seeds", "3", "--seed", "4"]) == 0
    r = json.loads(out.read_text())
    assert r["seeds"] == [4, 5, 6]
    (p,) = r["policies"]
    per = p["per_seed"]
    assert [x["seed"] for x in per] == [4, 5, 6] and p["seeds"] == 3
    p99s = [x["ttft_p99"] for x in per]
    assert p["ttft"]["p99"] == statistics.median(p99s)
    assert p["spread"]["ttft_p99"] == [min(p99s), max(p99s)]
    assert p["hit_rate"] == statistics.median(x["hit_rate"] for x in per)
    assert "over 3 seeds" in capsys.readouterr().out
    # Each seed alone gives that seed's row.
    assert main([*argv, "--seed", "5"]) == 0
    one = json.loads(out.read_text())["policies"][0]
    assert one["ttft"]["p99"] == per[1]["ttft_p99"] and "spread" not in one
