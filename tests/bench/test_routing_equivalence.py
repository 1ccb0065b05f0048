"""The offline simulator routes as the gateway does: the same requests, keyed and decided by the
gateway's own routing (a `Gateway` built from a default config: its policy, options and token
keyers) and by `bench.simulate`'s router, give identical route keys and identical decisions.
Benchmark conclusions cannot drift silently from what the gateway does."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from bench.simulate import PolicyRouter, PolicySpec, _arrivals
from bench.traces import load_trace
from gateway.app import Gateway
from gateway.keying import route_key
from scoring.views import WorkerView
from tests.gateway.conftest import settings_for

TRACE = "conversation:sessions=12,session_rate=4,max_turns=5,think_s=0.5,seed=5"
WORKERS = 4
BLOCK = 16


def views(load: list[int]) -> list[WorkerView]:
    """The same fleet state for both sides: uneven load, token-mode block size."""
    return [
        WorkerView(
            name=f"w{i}",
            in_flight=n,
            running=n,
            waiting=max(0, n - 3),
            kv_usage=min(0.95, 0.1 * n),
            block_size=BLOCK,
            num_blocks=4096,
        )
        for i, n in enumerate(load)
    ]


@pytest.mark.parametrize("policy", ["kv_aware", "kv_aware_precise", "prefix"])
async def test_simulator_and_gateway_key_and_decide_alike(policy: str) -> None:
    trace = load_trace(TRACE)
    precise = policy == "kv_aware_precise"
    routing: dict[str, object] = {"policy": "kv_aware" if precise else policy}
    if precise:  # what kv_aware_precise stands for: token mode keys and a precise index
        routing["token_mode"] = {"models": {"sim-llama": "sim"}}
    gw = Gateway(
        settings_for([f"http://127.0.0.1:{9000 + i}" for i in range(WORKERS)], routing=routing)
    )
    sim = PolicyRouter(
        PolicySpec.parse(policy),
        {r.request_id: r for r in trace.requests},
        WORKERS,
        seed=0,
        keys="gateway",
        trace_block=BLOCK,
    )
    sim.attach((), BLOCK)
    assert sim.options == gw.routing_options
    # Ties are broken at random: the same draws on both sides.
    gw.policy._rng = random.Random(7)  # type: ignore[attr-defined]
    sim.policy._rng = random.Random(7)  # type: ignore[attr-defined]
    load = [0] * WORKERS
    reasons: Counter[str] = Counter()
    for arrival in _arrivals(trace.requests, None):
        req = sim.requests[arrival.request.request_id]
        body = {"model": "sim-llama", "prompt": arrival.request.prompt_token_ids}
        theirs = await route_key(
            policy=gw.policy,
            keyers=gw.token_keyers,
            views=views(load),
            options=gw.routing_options,
            token_mode=gw.settings.routing.token_mode,
            is_chat=False,
            data=body,
            raw_len=0,
            model="sim-llama",
            namespace="",
            headers={"x-session-id": req.session_id} if req.session_id else {},
            session_header="x-session-id",
            tenant_priority=0.5,
            request_id=req.request_id,
            precise=precise,
        )
        ours = sim.route_key(arrival)
        assert ours == theirs
        a = gw.policy.choose(views(load), theirs)
        b = sim.policy.choose(views(load), ours)
        assert (a.worker.name, a.reason) == (b.worker.name, b.reason)
        gw.policy.on_dispatch(a.worker.name, theirs)
        sim.policy.on_dispatch(b.worker.name, ours)
        load[int(a.worker.name[1:])] += 1
        if sum(reasons.values()) % 3 == 0:  # some requests finish
            load = [max(0, n - 1) for n in load]
        reasons[a.reason] += 1
    assert sum(reasons.values()) == len(trace.requests) > 20
    # Not a trivial agreement: the keys carried prefixes and the policy followed them.
    assert len(reasons) > 1, reasons
