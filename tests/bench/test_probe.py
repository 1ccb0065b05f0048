"""`bench replay --load`: the live capacity probe and the pacing it sets."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest
from rich.console import Console

from bench.probe import probe_capacity, probe_requests
from bench.replay import ReplayOptions, add_replay_args, pace_to_capacity, replay
from bench.traces import SyntheticSpec, synthetic
from tests.support.sim_workers import run_sim_workers

SPEC = SyntheticSpec(
    groups=1, users=4, system_tokens=256, question_tokens=32, output_tokens=8,
    rate=20.0, num_requests=24, block_size=16, seed=3,
)  # fmt: skip


def test_probe_requests_are_rescoped_copies_at_time_zero() -> None:
    t = synthetic(SPEC)
    p = probe_requests(t, 30, start=20, tag="probe4").requests
    assert len(p) == 30 and all(r.arrival_s == 0.0 for r in p)
    src = [t.requests[(20 + i) % 24] for i in range(30)]  # wraps around the trace
    assert [r.input_length for r in p] == [r.input_length for r in src]
    assert [len(r.block_ids) for r in p] == [len(r.block_ids) for r in src]
    assert not {b for r in p for b in r.block_ids} & {b for r in t.requests for b in r.block_ids}
    # the sharing among them stays: copies of requests with one system prompt share its blocks
    assert p[0].block_ids[0] == p[1].block_ids[0] == f"probe4:{src[0].block_ids[0]}"


async def test_probe_finds_a_saturating_rate_without_warming_the_replays_cache() -> None:
    trace = synthetic(SPEC)
    async with run_sim_workers(1, profile="fast", max_num_seqs=2, num_blocks=2048) as fleet:
        opts = ReplayOptions(url=fleet[0], max_concurrency=16, request_timeout_s=30)
        probe = await probe_capacity(trace, opts, max_concurrency=16)
        first = (await replay(trace.replace(trace.requests[:1]), opts))[0]
    assert probe.req_s > 0 and probe.rescoped
    ks = [lv.concurrency for lv in probe.levels]
    assert ks[:2] == [1, 2] and all(b == 2 * a for a, b in itertools.pairwise(ks))
    assert all(lv.ok == lv.requests for lv in probe.levels)
    assert probe.req_s == max(lv.req_s for lv in probe.levels)
    # it stops at the bound or once doubling adds < 10%; either way it says which
    last = probe.levels[-1]
    assert probe.at_least == (last.concurrency == 16 and last.req_s >= 1.1 * probe.levels[-2].req_s)
    # the probe sent the same shared system prompt 20+ times, re-scoped: the replay's first
    # request still finds nothing of it cached
    assert first.ok and first.cached_tokens == 0
    doc = json.loads(json.dumps(probe.to_json()))  # what replay writes under "pacing"
    assert doc["capacity_req_s"] == pytest.approx(probe.req_s, abs=1e-4)
    assert [lv["concurrency"] for lv in doc["levels"]] == ks


def test_load_paces_the_trace_at_that_fraction_of_the_capacity() -> None:
    trace = synthetic(SPEC)
    paced, info = pace_to_capacity(
        trace, ReplayOptions(url="http://127.0.0.1:9"), 0.5, 40.0, Console(quiet=True)
    )
    n, span = len(paced.requests), paced.duration_s
    assert (n - 1) / span == pytest.approx(20.0, rel=1e-6)
    assert info == {
        "by": "load",
        "load": 0.5,
        "capacity_req_s": 40.0,
        "rate": 20.0,
        "time_scale": pytest.approx(info["time_scale"]),
    }
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace.requests)]
    new = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(paced.requests)]
    assert new == pytest.approx([g * info["time_scale"] for g in gaps])  # the same pattern


def test_replay_takes_one_of_rate_time_scale_and_load() -> None:
    from bench.replay import main

    for flags in (["--rate", "2", "--load", "0.9"], ["--time-scale", "1", "--load", "1"]):
        with pytest.raises(SystemExit) as e:
            main(["--url", "http://127.0.0.1:9", "--trace", "synthetic:", *flags])
        assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:9", "--trace", "synthetic:", "--capacity", "3"])
    p = argparse.ArgumentParser()
    add_replay_args(p)
    a = p.parse_args(["--trace", "x", "--load", "0.9"])
    assert a.load == 0.9 and a.time_scale is None and a.capacity is None
