"""HTTP replay against simulated workers on 127.0.0.1: complete records, counted statuses, the
`vllm bench serve`-style result, and the prompt-length check."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from itertools import pairwise

import pytest

from bench.compare import kvgate_config, markdown
from bench.metrics import SLO
from bench.replay import (
    ReplayOptions,
    build_body,
    parse_goodput,
    replay,
    split_urls,
    spread,
    summarize,
)
from bench.simulate import PolicySpec
from bench.traces import SyntheticSpec, Trace, TraceRequest, synthetic
from tests.support.sim_workers import run_sim_workers

SPEC = SyntheticSpec(
    groups=2, users=2, system_tokens=256, question_tokens=32, output_tokens=4,
    rate=200.0, num_requests=12, block_size=16, seed=1,
)  # fmt: skip


def _trace_with_one_too_long() -> Trace:
    t = synthetic(SPEC)
    long = TraceRequest(t.requests[-1].arrival_s + 0.001, "too-long", 3000, 4, 16, list(range(188)))
    return t.replace([*t.requests, long])


async def test_replay_records_every_request_and_counts_statuses() -> None:
    trace = _trace_with_one_too_long()
    async with run_sim_workers(
        2, profile="fast", num_blocks=512, block_size=16, max_model_len=2048
    ) as fleet:
        opts = ReplayOptions(url=fleet[0], max_concurrency=8, request_timeout_s=30)
        records = await replay(trace, opts)
    assert len(records) == 13 and all(r.sent_s is not None for r in records)
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    assert len(ok) == 12 and [r.request_id for r in bad] == ["too-long"]
    assert bad[0].status == 400 and "maximum context length" in (bad[0].error or "")
    for r in ok:
        assert r.status == 200 and r.prompt_tokens == r.input_length  # token ids: exact
        assert r.output_tokens == r.expected_output == 4
        assert r.ttft is not None and r.e2e is not None and r.e2e >= r.ttft
        assert len(r.itl) == 3  # one SSE chunk per token, as vLLM streams
    assert sum(r.cached_tokens or 0 for r in ok) > 0  # system prompts were shared

    res = summarize(records, opts, SLO(ttft=10.0, tpot=1.0))
    assert res["completed"] == 12 and res["failed"] == 1 and res["not_sent"] == 0
    assert res["status_counts"] == {"200": 12, "400": 1}
    assert res["total_output_tokens"] == 48
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert res[f"{stat}_{name}_ms"] is not None
    assert res["p99_ttft_ms"] >= res["median_ttft_ms"]
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["prompt_length_check"]["mismatched"] == 0
    assert 0 < res["hit_rate"] < 1 and len(res["records"]) == 13
    json.dumps(res)  # the result file is plain JSON


async def test_text_and_chat_prompts_stay_within_the_stated_tolerance() -> None:
    trace = synthetic(SPEC)
    async with run_sim_workers(1, profile="fast", num_blocks=512, block_size=16) as fleet:
        for endpoint in ("text", "chat"):
            opts = ReplayOptions(url=fleet[0], endpoint=endpoint, request_timeout_s=30)
            res = summarize(await replay(trace, opts), opts, SLO())
            assert res["completed"] == 12, res["errors"]
            check = res["prompt_length_check"]
            assert check["mismatched"] == 0 and check["tolerance"] == "2% + 32 tokens"
            if endpoint == "text":  # one word per token on the simulated tokenizer
                assert check["max_abs_diff"] == 0
            else:  # the chat template's own tokens
                assert 0 < check["max_abs_diff"] <= 32


async def test_duration_bounds_what_is_sent() -> None:
    reqs = [TraceRequest(i * 0.2, f"r{i}", 16, 2, 16, [i]) for i in range(10)]
    async with run_sim_workers(1, profile="fast") as fleet:
        opts = ReplayOptions(url=fleet[0], duration_s=0.5, request_timeout_s=30)
        records = await replay(Trace(reqs, "h", "k"), opts)
    res = summarize(records, opts, SLO())
    assert res["completed"] == 3 and res["not_sent"] == 7


async def test_duration_also_bounds_requests_held_back_by_the_concurrency_bound() -> None:
    reqs = [TraceRequest(0.0, f"r{i}", 16, 2, 16, [i]) for i in range(5)]  # all due at once
    async with run_sim_workers(1, profile="fast") as fleet:
        late = ReplayOptions(url=fleet[0], max_concurrency=1, duration_s=1e-9)
        held = await replay(Trace(reqs, "h", "k"), late)
        free = await replay(Trace(reqs, "h", "k"), replace(late, duration_s=None))
    assert all(r.sent_s is None and r.error == "not sent (past --duration)" for r in held)
    assert all(r.ok for r in free)


def test_body_and_goodput_flags() -> None:
    r = synthetic(SPEC).requests[0]
    body = build_body(r, ReplayOptions(url="x"))
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and len(body["prompt"]) == 288
    chat = build_body(r, ReplayOptions(url="x", endpoint="chat"))
    assert chat["messages"][0]["role"] == "user" and "prompt" not in chat
    slo = parse_goodput(["ttft:2000", "tpot:100"])
    assert (slo.ttft, slo.tpot, slo.e2e) == (2.0, 0.1, None)
    with pytest.raises(ValueError):
        parse_goodput(["foo:1"])


def test_generated_kvgate_config_is_valid() -> None:
    import tomllib

    from gateway.config import Settings

    spec = PolicySpec.parse("kv_aware[queue=0.3;affinity_slack=10]")
    text = kvgate_config(spec, 8123, ["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    s = Settings(**tomllib.loads(text))
    assert s.routing.policy == "kv_aware" and s.routing.weights.queue == 0.3
    assert s.routing.options == {"affinity_slack": 10.0}
    assert [w.url for w in s.workers] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert s.server.host == "127.0.0.1" and not s.tenants


def test_compare_markdown_states_the_setup() -> None:
    res = {
        "completed": 10, "failed": 0, "not_sent": 0, "hit_rate": 0.5,
        "median_ttft_ms": 100.0, "p90_ttft_ms": 200.0, "p99_ttft_ms": 300.0,
        "median_tpot_ms": 10.0, "p99_tpot_ms": 20.0, "p99_e2el_ms": 900.0,
        "request_throughput": 2.0, "request_goodput": 1.5, "worker_balance": 1.2,
    }  # fmt: skip
    report = {
        "trace": {
            "describe": "t (mooncake, 10 requests); sample: x",
            "bound": {"token_hit_rate": 0.6, "block_hit_rate": 0.6},
            "pooled_bound": {"token_hit_rate": 0.55},
            "ttft_floor": {"p50": 0.05, "p99": 0.12},
        },
        "fleet_describe": "8 simulated workers",
        "replay": {"endpoint": "text", "max_concurrency": 8},
        "slo_describe": "TTFT <= 2 s",
        "seed": 3,
        "machine": {"cpu": "cpu", "cores": 2, "python": "3.11"},
        "wall_s": 12.0,
        "targets": [
            {"name": "kvgate:kv_aware", "status": "ok", "result": res, "predicted": None},
            {"name": "smg", "status": "skipped", "reason": "pip failed", "result": {}},
        ],
    }
    md = markdown(report)
    assert "| kvgate:kv_aware | 10/0 | 50.0% | 0.83 | 0.100 | 0.200 | 0.300 | 2.50 |" in md
    assert "- TTFT floor (each request alone" in md and "p50 0.050, p99 0.120" in md
    del report["trace"]["ttft_floor"]  # a report from before the floor: no ratio, no failure
    assert "| 0.300 | - |" in markdown(report)
    assert "- smg: skipped: pip failed" in md and "seed 3" in md and "sample: x" in md


def test_spread_is_uniform_seeded_and_takes_comma_lists() -> None:
    urls = split_urls(" http://127.0.0.1:1/, http://127.0.0.1:2 ,,http://127.0.0.1:3")
    assert urls == ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    a = spread(3000, urls, seed=4)
    assert a == spread(3000, urls, seed=4) and a != spread(3000, urls, seed=5)
    counts = Counter(a)
    assert set(counts) == set(urls) and all(900 < c < 1100 for c in counts.values())
    # at random, not in turn: some request goes to the same URL as the one before it
    assert any(x == y for x, y in pairwise(a))
    assert spread(5, urls[:1], seed=4) == [urls[0]] * 5
    assert ReplayOptions(url="http://127.0.0.1:9/").urls == ["http://127.0.0.1:9"]
    with pytest.raises(ValueError):
        spread(1, [], seed=0)


async def test_replay_spreads_requests_over_several_urls() -> None:
    trace = synthetic(SPEC)
    async with run_sim_workers(2, profile="fast", num_blocks=512, block_size=16) as fleet:
        opts = ReplayOptions(url=",".join(fleet), request_timeout_s=30, spread_seed=2)
        records = await replay(trace, opts)
    res = summarize(records, opts, SLO())
    assert res["completed"] == 12 and res["base_urls"] == list(fleet)
    want = Counter(spread(12, list(fleet), seed=2))
    assert len(want) == 2  # both URLs drawn, with this seed
    assert res["per_url"] == {
        u: {"requests": want[u], "sent": want[u], "ok": want[u]} for u in fleet
    }
    assert [r.url for r in records] == spread(12, list(fleet), seed=2)
