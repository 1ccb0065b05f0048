"""Trace schema, converters (on small excerpts of the real files and hand-made ones), sampling,
prompts and the infinite-cache bound."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from bench.traces import (
    AzurePrefixModel,
    SyntheticSpec,
    Trace,
    TraceRequest,
    cache_bound,
    cap_output,
    chain_keys,
    detect_format,
    from_azure,
    from_mooncake,
    from_weka,
    head,
    infinite_cache_hit_rate,
    load_mooncake,
    load_trace,
    prompt_text,
    prompt_token_ids,
    read_jsonl,
    retime_gamma,
    sample,
    scale_time,
    synthetic,
    tokens_for_blocks,
    window,
    write_jsonl,
)
from workers.sim.tokenizer import encode

# Hand-made files in the exact formats of the sample traces in bench/data/traces (small, and each
# test controls the case it needs): Mooncake JSONL with prefix-tree hash ids, the Azure CSV header
# and timestamp format, and a weka-agentic session file. The shipped samples themselves are
# checked in test_self_contained.py.


def _mooncake(dst: Path, lines: int) -> Path:
    rng = random.Random(11)
    rows, next_id = [], 0
    families: list[list[int]] = []
    for i in range(lines):
        base = rng.choice(families)[: rng.randint(1, 6)] if families and rng.random() < 0.6 else []
        extra = rng.randint(1, 5)
        ids = base + list(range(next_id, next_id + extra))
        next_id += extra
        families.append(ids)
        n = (len(ids) - 1) * 512 + rng.randint(1, 512)
        rows.append(
            {
                "timestamp": i * 137,
                "input_length": n,
                "output_length": rng.randint(1, 400),
                "hash_ids": ids,
            }
        )
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return dst


def _azure(dst: Path, rows: int) -> Path:
    rng = random.Random(5)
    out = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(rows):
        frac = f"{(i * 52_000) % 10_000_000:07d}"
        out.append(
            f"2023-11-16 18:17:{3 + i // 20:02d}.{frac},{rng.randint(10, 8000)},{rng.randint(1, 500)}"
        )
    dst.write_text("\n".join(out) + "\n", encoding="utf-8")
    return dst


def _weka(dst: Path) -> Path:
    reqs, ids, t = [], list(range(1, 40)), 0.0
    for k in range(7):
        ids = ids + list(range(ids[-1] + 1, ids[-1] + 1 + 3 + k))
        reqs.append(
            {
                "t": t,
                "type": "n",
                "model": "m",
                "in": len(ids) * 64 - 10,
                "out": 100 + k,
                "hash_ids": list(ids),
                "think_time": 1.0,
                "api_time": 2.0,
            }
        )
        t += 5.0
    doc = {
        "id": "trace_0022",
        "models": ["m"],
        "block_size": 64,
        "hash_id_scope": "local",
        "requests": reqs,
    }
    dst.write_text(json.dumps(doc), encoding="utf-8")
    return dst


def req(rid: str, ids: list, n: int, bs: int = 4, t: float = 0.0, **kw) -> TraceRequest:
    return TraceRequest(t, rid, n, 8, bs, list(ids), **kw)


# -- Mooncake --------------------------------------------------------------------------------------
def test_mooncake_excerpt_converts_exactly(tmp_path: Path) -> None:
    path = _mooncake(tmp_path / "m.jsonl", 25)
    assert detect_format(path) == "mooncake"
    trace = load_trace(path)
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(trace.requests) == 25
    assert trace.format == "mooncake" and trace.block_size == 512
    for r, row in zip(trace.requests, raw, strict=True):
        assert r.arrival_s == row["timestamp"] / 1000
        assert (r.input_length, r.output_length) == (row["input_length"], row["output_length"])
        assert r.block_ids == row["hash_ids"]  # global ids stay plain ints
        assert len(prompt_token_ids(r)) == r.input_length


def test_mooncake_prompts_and_bound_match_the_legacy_helpers(tmp_path: Path) -> None:
    path = _mooncake(tmp_path / "m.jsonl", 300)
    trace = from_mooncake(path)
    records = list(load_mooncake(path))
    r = trace.requests[3]
    assert prompt_token_ids(r) == tokens_for_blocks(r.block_ids, r.input_length, 512)
    assert cache_bound(trace.requests).token_hit_rate == pytest.approx(
        infinite_cache_hit_rate(records)
    )


# -- Azure -----------------------------------------------------------------------------------------
def test_azure_excerpt_synthesizes_seeded_tenant_prefixes(tmp_path: Path) -> None:
    path = _azure(tmp_path / "a.csv", 40)  # header + 40 rows
    assert detect_format(path) == "azure"
    rows = list(csv.reader(path.open()))[1:]
    m = AzurePrefixModel(tenants=4, block_size=64, seed=3)
    trace = from_azure(path, m)
    assert len(trace.requests) == 40
    assert trace.requests[0].arrival_s == 0.0
    assert m.describe() in trace.notes  # the synthesis is stated with the trace
    by_id = {r.request_id: r for r in trace.requests}
    for i, row in enumerate(rows):
        r = by_id[f"azure-{i}"]
        assert (r.input_length, r.output_length) == (int(row[1]), int(row[2]))
        assert len(r.block_ids) == -(-r.input_length // 64)
        assert len(prompt_token_ids(r)) == r.input_length
    # Same tenant -> same leading blocks (its system prompt); same seed -> same trace.
    groups: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        groups.setdefault(r.tenant, []).append(r)
    shared = [g for g in groups.values() if len(g) > 1 and all(x.full_blocks > 2 for x in g)]
    assert shared
    a, b = shared[0][:2]
    assert a.block_ids[0] == b.block_ids[0]
    assert [r.block_ids for r in from_azure(path, m).requests] == [
        r.block_ids for r in trace.requests
    ]
    other = from_azure(path, AzurePrefixModel(tenants=4, block_size=64, seed=4))
    assert [r.block_ids for r in other.requests] != [r.block_ids for r in trace.requests]


def test_azure_timestamps_with_seven_fractional_digits(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,100,5\n"
        "2023-11-16 18:17:05.0000000,70,3\n"
    )
    t = from_azure(p)
    assert [r.arrival_s for r in t.requests] == pytest.approx([0.0, 1.02004])


# -- weka-agentic ------------------------------------------------------------------------------------
def _session(path: Path, sid: str, reqs: list[dict]) -> Path:
    path.write_text(json.dumps({"id": sid, "block_size": 4, "requests": reqs}))
    return path


def test_weka_scopes_ids_per_file_and_splits_subagents(tmp_path: Path) -> None:
    d = tmp_path / "weka"
    d.mkdir()
    _session(
        d / "trace_a.json",
        "a",
        [
            {"t": 0.0, "type": "n", "in": 9, "out": 2, "hash_ids": [1, 2]},
            {
                "t": 5.0,
                "type": "subagent",
                "agent_id": "sub1",
                "requests": [{"t": 1.0, "type": "n", "in": 8, "out": 1, "hash_ids": [7, 8]}],
            },
            {"t": 10.0, "type": "n", "in": 13, "out": 2, "hash_ids": [1, 2, 3]},
        ],
    )
    _session(
        d / "trace_b.json", "b", [{"t": 0.0, "type": "n", "in": 8, "out": 4, "hash_ids": [1, 2]}]
    )
    assert detect_format(d) == "weka-agentic"
    trace = from_weka(d, stagger_s=100.0)
    assert len(trace.requests) == 4
    by = {r.request_id: r for r in trace.requests}
    assert by["a#0"].block_ids == ["a:1", "a:2"]
    assert by["b#0"].block_ids == ["b:1", "b:2"]  # same local ids, different sessions
    assert by["a/sub1#0"].session_id == "a/sub1" and by["a/sub1#0"].tenant == "a"
    assert by["a/sub1#0"].arrival_s == 6.0  # parent start + subagent t + request t
    assert by["b#0"].arrival_s == 100.0  # second file staggered
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    # 9 tokens = 2 full blocks of 4 + 1 unique tail token; prompts keep the shared prefix.
    p0, p2 = prompt_token_ids(by["a#0"]), prompt_token_ids(by["a#1"])
    assert len(p0) == 9 and len(p2) == 13 and p0[:8] == p2[:8] and p0[8] != p2[8]
    assert prompt_token_ids(by["b#0"])[:8] != p0[:8]
    # The bound sees the sharing inside session a only.
    b = cache_bound(trace.requests)
    assert b.hit_tokens == 8 and b.prompt_tokens == 9 + 8 + 13 + 8


def test_weka_session_file(tmp_path: Path) -> None:
    f = _weka(tmp_path / "trace_0022.json")
    raw = json.loads(f.read_text())
    assert detect_format(f) == "weka-agentic"
    trace = load_trace(f)
    assert len(trace.requests) == len(raw["requests"]) == 7
    assert all(r.session_id == raw["id"] and r.block_size == 64 for r in trace.requests)
    assert all(str(b).startswith(raw["id"] + ":") for r in trace.requests for b in r.block_ids)
    r = trace.requests[1]
    assert len(prompt_token_ids(r)) == r.input_length
    assert cache_bound(trace.requests).token_hit_rate > 0.5  # one growing conversation


# -- synthetic ---------------------------------------------------------------------------------------
def test_synthetic_shares_system_prompts_and_grows_conversations() -> None:
    spec = SyntheticSpec(
        groups=3, users=2, system_tokens=40, question_tokens=10, output_tokens=5,
        rate=100.0, num_requests=30, multi_turn=True, block_size=8, seed=1,
    )  # fmt: skip
    t = synthetic(spec)
    assert len(t.requests) == 30 and t.notes == [spec.describe()]
    by_group: dict[str, list[TraceRequest]] = {}
    for r in t.requests:
        by_group.setdefault(r.tenant, []).append(r)
    for rs in by_group.values():  # 40 system tokens = 5 full shared blocks
        assert len({tuple(r.block_ids[:5]) for r in rs}) == 1
    by_user: dict[str, list[TraceRequest]] = {}
    for r in t.requests:
        by_user.setdefault(r.session_id or "", []).append(r)
    rs = next(v for v in by_user.values() if len(v) >= 2)
    first, second = rs[0], rs[1]
    assert second.input_length == first.input_length + 10 + 5  # + its answer and a new question
    assert second.block_ids[: first.input_length // 8] == first.block_ids[: first.input_length // 8]
    assert synthetic(spec).requests[7].block_ids == t.requests[7].block_ids
    assert SyntheticSpec.parse("synthetic:groups=3,users=2,multi_turn=true").multi_turn
    with pytest.raises(ValueError):
        SyntheticSpec.parse("synthetic:grups=3")


# -- schema, sampling, time ---------------------------------------------------------------------------
def test_jsonl_round_trip_and_detection(tmp_path: Path) -> None:
    t = synthetic(
        SyntheticSpec(groups=2, users=2, num_requests=12, system_tokens=64, block_size=16)
    )
    t.requests[0].prompt = "explicit text"
    p = tmp_path / "t.jsonl"
    write_jsonl(p, t)
    assert detect_format(p) == "kvgate"
    back = read_jsonl(p)
    assert [r.to_json() for r in back.requests] == [r.to_json() for r in t.requests]
    assert back.notes == t.notes
    assert prompt_text(back.requests[0]) == "explicit text"


def test_invalid_records_are_rejected_with_their_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    good = req("a", [1, 2], 8).to_json()
    bad = req("b", [1], 12).to_json()  # 12 tokens need 3 blocks of 4
    p.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=":2:"):
        read_jsonl(p)


def test_sampling_scaling_and_windows() -> None:
    reqs = [req(f"r{i}", [i % 3, 100 + i], 8, t=float(i)) for i in range(30)]
    t = Trace(reqs, "hand", "kvgate")
    s = sample(t, 0.5, seed=2, by="request")
    assert len(s.requests) == 15 and s.notes == ["sample: 15 of 30 requests (seed 2)"]
    assert sample(t, 0.5, seed=2, by="request").requests == s.requests  # seeded
    fam = sample(t, 2, seed=0, by="prefix")  # two prefix families of 10 requests each
    assert len(fam.requests) == 20 and len({r.block_ids[0] for r in fam.requests}) == 2
    assert sample(t, 1, by="auto").notes[-1].endswith("prefix families (seed 0)")
    fast = scale_time(t, 0.5)
    assert fast.requests[-1].arrival_s == 14.5 and t.requests[-1].arrival_s == 29.0
    w = window(t, 10, 5)
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(head(t, 4).requests) == 4
    g = retime_gamma(Trace(reqs * 20, "x", "y"), rate=10.0, burstiness=1.0, seed=1)
    assert g.requests[-1].arrival_s == pytest.approx(599 / 10.0, rel=0.15)
    assert cap_output(t, 3).requests[0].output_length == 3 and t.requests[0].output_length == 8


def test_window_sampling_keeps_one_contiguous_slice_at_a_seeded_offset() -> None:
    reqs = [req(f"r{i}", [i], 4, t=float(i), session_id=f"s{i % 4}") for i in range(20)]
    t = Trace(reqs, "h", "k")
    w = sample(t, 0.25, seed=3, by="window")
    ids = [int(r.request_id[1:]) for r in w.requests]
    assert len(ids) == 5 and ids == list(range(ids[0], ids[0] + 5))  # contiguous, in order
    assert sample(t, 0.25, seed=3, by="window").requests == w.requests  # seeded
    offsets = {sample(t, 5, seed=k, by="window").requests[0].request_id for k in range(20)}
    assert len(offsets) > 1  # the offset varies with the seed
    assert w.notes[-1].startswith(f"sample: requests {ids[0]}-{ids[-1]} of 20, contiguous")
    whole = sample(t, 1.0, seed=9, by="window", keep_times=False)
    assert whole.requests[0].arrival_s == 0.0 and len(whole.requests) == 20
    with pytest.raises(ValueError, match="window"):
        sample(t, 0.5, by="nonsense")


def test_session_sampling_keeps_whole_sessions() -> None:
    reqs = [req(f"r{i}", [i], 4, t=float(i), session_id=f"s{i % 4}") for i in range(20)]
    s = sample(Trace(reqs, "h", "k"), 2, seed=5)
    assert len({r.session_id for r in s.requests}) == 2 and len(s.requests) == 10


# -- prompts ---------------------------------------------------------------------------------------
def test_prompts_are_deterministic_per_block_id() -> None:
    a = req("a", ["s:1", "s:2", "s:3"], 12)
    b = req("b", ["s:1", "s:2", "s:9"], 11)
    c = req("c", ["t:1", "t:2", "t:3"], 12)
    pa, pb, pc = prompt_token_ids(a), prompt_token_ids(b), prompt_token_ids(c)
    assert len(pa) == 12 and len(pb) == 11
    assert pa[:8] == pb[:8] and pa[8:11] != pb[8:11]
    assert pa[:4] != pc[:4]  # other scope, other content
    assert all(1000 <= x < 50000 for x in pa)
    assert prompt_token_ids(req("a2", ["s:1", "s:2", "s:3"], 12)) == pa
    text = prompt_text(a)
    assert len(encode(text)) == 12  # one word per token on the simulated tokenizer
    assert prompt_text(b).startswith(prompt_text(req("x", ["s:1", "s:2"], 8)))


def test_chain_keys_name_the_prefix() -> None:
    a = chain_keys(req("a", [1, 2, 3], 12))
    b = chain_keys(req("b", [9, 2, 3], 12))
    assert len(a) == 3 and a[1] != b[1]  # block 2 after another parent is another key
    assert chain_keys(req("c", [1, 2, 3], 11)) == a[:2]  # only full blocks
    assert chain_keys(req("d", ["1", 2, 3], 12))[0] != a[0]  # str and int ids differ


# -- the bound ---------------------------------------------------------------------------------------
def test_infinite_cache_bound_on_a_hand_built_trace() -> None:
    reqs = [
        req("a", [1, 2, 3], 12),  # nothing seen: 0
        req("b", [1, 2, 4], 12),  # 1,2 hit; capped at (12-1)//4 = 2 blocks: 8
        req("c", [1, 2, 3], 12),  # 1,2,3 seen but capped at 2 blocks: 8
        req("d", [9, 2, 3], 12),  # 2 after 9 is new: 0
        req("e", [1, 2, 3, 5], 14),  # 1,2,3 hit (cap 3): 12
        req("f", [1, 2], 7),  # only 1 full block; cap (7-1)//4 = 1: 4
    ]
    b = cache_bound(reqs)
    assert b.hit_tokens == 8 + 8 + 12 + 4
    assert b.prompt_tokens == 12 * 4 + 14 + 7
    assert b.hit_blocks == 2 + 2 + 3 + 1 and b.blocks == 3 + 3 + 3 + 3 + 3 + 1
    assert b.token_hit_rate == pytest.approx(32 / 69)
    assert cache_bound([]).token_hit_rate == 0.0


def test_capacity_bound_evicts_least_recently_used() -> None:
    reqs = [req("a", [1, 2], 9), req("b", [7, 8], 9), req("c", [1, 2], 9)]
    assert cache_bound(reqs).hit_tokens == 8
    assert cache_bound(reqs, capacity_tokens=8).hit_tokens == 0  # b evicted all of a
    # Room for 3 blocks: b evicts a's tail first (a prefix outlives its extensions).
    assert cache_bound(reqs, capacity_tokens=12).hit_tokens == 4
    assert cache_bound(reqs, capacity_tokens=16).hit_tokens == 8
