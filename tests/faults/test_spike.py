"""The spike bench's machinery at toy scale (2 fast workers, a 3 s spike, admission on): only
properties that hold on any machine, never timings, so a loaded CI box makes it slower, not red.

Real processes on 127.0.0.1 (the simulated fleet and the gateway, each a child process), the
same code path as `python -m bench.spike`.
"""

from __future__ import annotations

import json

from bench.spike import FleetSpec, GatewaySpec, SpikeOptions, run_spike


def test_spike_with_admission_sheds_low_priority_and_leaks_nothing() -> None:
    opts = SpikeOptions(
        # 2 x 4 slots; fast steps x 10 (>= 10 ms each), 48 tokens: ~0.5 s per request.
        fleet=FleetSpec(workers=2, profile="fast", time_scale=10.0, max_num_seqs=4, num_blocks=512),
        # A short queue deadline so the drain after the spike is short too.
        gateway=GatewaySpec(priority_reserve=0.25, deadline_s=1.5, policy="least_loaded"),
        prompt_tokens=64,
        max_tokens=48,
        capacity_s=1.5,
        unloaded_s=1.0,
        spike_s=3.0,
        client_timeout_s=20.0,
        runs=("on",),
        pin=False,
        out=None,
        show_progress=False,
    )
    res = run_spike(opts)
    records = res.pop("_records")
    json.dumps(res)  # the result document is plain JSON

    run = res["runs"]["on"]
    high, low = run["tenants"]["high"], run["tenants"]["low"]
    spike = [r for r in records if r["phase"] == "spike-on"]
    assert len(spike) == high["offered"] + low["offered"] > 0

    # Overload is answered, not hung: every request got a whole response.
    assert all(r["error"] in (None, "http") for r in spike), outcome_counts(spike)
    # No 5xx except the queue's own 503s.
    assert {r["status"] for r in spike} <= {200, 429, 503}, outcome_counts(spike)

    refused = [r for r in spike if r["status"] in (429, 503)]
    low_refused = [r for r in refused if r["tenant"] == "low"]
    assert low_refused, f"no low-priority request was refused: {low}"
    for r in refused:
        assert r["retry_after"] and int(r["retry_after"]) >= 1, r
        assert r["openai_shaped"] is True, r
        assert r["admission"], r  # refused by the admission queue, not by a quota
        assert r["code"], r

    assert high["ok"] > 0
    assert high["ok_ratio"] > low["ok_ratio"], (high, low)

    # Zero lost reservations, and nothing else held once the last response is in.
    assert run["lost_reservations"] == 0, run["after"]
    assert run["after"]["held"] == {}, run["after"]
    assert run["after"]["open_reservations"] == 0
    assert all(v == 0 for v in run["after"]["worker_in_flight"].values())


def outcome_counts(records: list[dict[str, object]]) -> dict[str, int]:
    """(status, error) counts, for assertion messages."""
    out: dict[str, int] = {}
    for r in records:
        k = f"{r['status']}/{r['error']}"
        out[k] = out.get(k, 0) + 1
    return out
