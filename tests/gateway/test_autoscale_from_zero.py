"""The desired worker count when no worker serves the model: refused requests are demand, a fleet
that is down is not idle, and workers that have not answered yet still count.

With no worker serving a model the gateway answers 503 at once and queues nothing, so neither the
queue nor tokens in flight show that clients want it (review: with ``min_workers = 0`` a model
scaled to zero never scaled back up; 3 workers all down under steady refused traffic stepped
3 -> 1). And a gateway restarted while workers were still loading counted only those that had
answered (review: desired = 1 of 3). gateway/desired_workers.py and gateway/autoscale.py, module
docstrings. Every clock is explicit.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.autoscale import fleet_loads
from gateway.desired_workers import AutoscaleSettings, DesiredWorkers, ModelLoad, WorkerLoad
from workers.registry import Registry
from workers.vllm_metrics import WorkerMetrics
from workers.worker import Health, WorkerSpec

M = "m"


def loads(n: int, fleet: int = 0, kv: float = 0.0, queued: int = 0) -> dict[str, ModelLoad]:
    return {M: ModelLoad(tuple(WorkerLoad(kv) for _ in range(n)), queued, fleet)}


def est(**kw: Any) -> DesiredWorkers:
    return DesiredWorkers(AutoscaleSettings(**kw), clock=lambda: pytest.fail("clock read"))


def one(d: DesiredWorkers, snapshot: dict[str, ModelLoad], now: float) -> Any:
    (sig,) = d.evaluate(snapshot, now)
    return sig


class NoAdmission:
    def pools(self) -> list[str]:
        return []

    def depth_by_tier(self, pool: str | None = None) -> dict[int, int]:
        return {}


def scaled_to_zero() -> DesiredWorkers:
    """min_workers = 0: one idle worker, stepped in to 0 after the calm cooldown."""
    d = est(min_workers=0, scale_in_cooldown_s=1.0)
    one(d, loads(1, fleet=1), 0.0)
    sig = one(d, loads(1, fleet=1), 1.0)
    assert (sig.desired_workers, sig.decision) == (0, "scale_in")
    return d


# -- finding 1: refused requests are demand ------------------------------------------------------
def test_a_model_scaled_to_zero_scales_back_up_on_refused_requests() -> None:
    d = scaled_to_zero()
    # The autoscaler removed the worker: it is down, still known to serve the model.
    for t in (2.0, 3.0, 4.0):
        assert one(d, loads(0, fleet=1), t).desired_workers == 0  # no demand: stays at zero
    for i in range(150):  # every request refused 503 at once: nothing queued, nothing in flight
        d.note_unserved(M, now=5.0 + i * 0.02)
    sig = one(d, loads(0, fleet=1), 8.0)
    assert (sig.desired_workers, sig.decision) == (1, "scale_out")
    assert sig.queue_depth == 0 and sig.tokens_in_flight == 0
    assert d.scale_events(M) == (1, 1)
    # The worker starting: still 1 while refusals are recent, and then while it is down.
    assert one(d, loads(0, fleet=1), 30.0).desired_workers == 1
    assert one(d, loads(0, fleet=1), 500.0).desired_workers == 1
    # It serves: idle again, it steps in after a calm cooldown (no refusal within window_s).
    one(d, loads(1, fleet=1), 501.0)
    assert one(d, loads(1, fleet=1), 502.0).desired_workers == 0


def test_refusals_ask_for_min_workers_and_count_only_within_the_window() -> None:
    d = est(min_workers=0, scale_in_cooldown_s=1.0, window_s=60.0)
    d.note_unserved(M, now=0.0)
    assert one(d, loads(0), 10.0).desired_workers == 1
    # Out of order: an older refusal does not move the last one back.
    d.note_unserved(M, now=5.0)
    d.note_unserved(M, now=1.0)
    assert one(d, loads(0), 64.0).decision == "hold"  # 59 s after the last: not calm
    # No worker of the model left in the fleet, no refusal within window_s: it may go to zero.
    one(d, loads(0), 65.0)
    assert one(d, loads(0), 66.0).desired_workers == 0
    assert one(est(min_workers=3), loads(0, fleet=1), 0.0).desired_workers == 3
    d3 = est(min_workers=0)
    d3.note_unserved(M, now=0.0)
    assert one(d3, loads(0), 0.0).desired_workers == 1


def test_refusals_restart_the_cooldown_with_workers_back() -> None:
    """A worker came back while clients were still being refused: the model is not calm until
    window_s after the last refusal, then the whole cooldown runs."""
    d = est(scale_in_cooldown_s=10.0, window_s=60.0)
    one(d, loads(3, fleet=3), 0.0)
    d.note_unserved(M, now=1.0)
    for t in range(2, 61, 5):
        sig = one(d, loads(3, fleet=3), float(t))
        assert (sig.desired_workers, sig.decision) == (3, "hold")
    assert one(d, loads(3, fleet=3), 61.0).decision == "cooldown"  # calm from here
    assert one(d, loads(3, fleet=3), 70.0).desired_workers == 3
    assert one(d, loads(3, fleet=3), 71.0).desired_workers == 2


def test_refusals_raise_a_zero_count_while_a_worker_still_serves() -> None:
    """Stepped to zero, the worker not yet removed: requests refused meanwhile (it was drained,
    say) ask for one again."""
    d = scaled_to_zero()
    d.note_unserved(M, now=2.0)
    sig = one(d, loads(1, fleet=1), 2.5)
    assert (sig.desired_workers, sig.decision) == (1, "scale_out")


def test_all_workers_down_under_refused_traffic_do_not_step_in() -> None:
    """The review's case: 3 workers all down, clients refused steadily, min_workers = 1."""
    d = est(min_workers=1, scale_in_cooldown_s=0.5)
    assert one(d, loads(3, fleet=3), 0.0).desired_workers == 3
    for i in range(40):
        t = 0.1 + i * 0.1
        for _ in range(5):
            d.note_unserved(M, now=t)
        assert one(d, loads(0, fleet=3), t).desired_workers == 3
    assert d.scale_events(M) == (0, 0)


def test_a_fleet_that_is_down_is_not_idle() -> None:
    """No traffic at all (clients gave up): workers that serve the model exist and none is
    healthy, so no step in; once one is back and the model is calm, the cooldown starts."""
    d = est(min_workers=1, scale_in_cooldown_s=0.5)
    one(d, loads(3, fleet=3), 0.0)
    for t in range(1, 200):
        sig = one(d, loads(0, fleet=3), float(t))
        assert (sig.desired_workers, sig.decision) == (3, "hold")
    assert one(d, loads(1, fleet=3), 200.0).decision == "cooldown"
    assert one(d, loads(1, fleet=3), 201.0).desired_workers == 2


# -- finding 2: workers that have not answered yet ------------------------------------------------
def registry(*names: str) -> Registry:
    return Registry([WorkerSpec(n, f"http://{n}") for n in names])


def test_a_restart_with_workers_still_loading_keeps_the_fleet() -> None:
    """3 configured, 1 answered: the 2 still loading (first probe out, or failed with no model
    list) count for the one model the fleet serves."""
    reg = registry("a", "b", "c")
    reg.probe_ok("a", [{"id": M}], WorkerMetrics(kv_usage=0.1))
    reg.workers["b"].health = Health.UNHEALTHY  # its probes failed: no model list yet
    snapshot = fleet_loads(reg, NoAdmission())  # type: ignore[arg-type]
    assert len(snapshot[M].workers) == 1 and snapshot[M].fleet == 3
    d = est()
    assert one(d, snapshot, 0.0).desired_workers == 3
    # Draining ones do not count, answered or not.
    reg.drain("c")
    assert fleet_loads(reg, NoAdmission())[M].fleet == 2  # type: ignore[arg-type]


def test_unanswered_workers_count_only_for_models_every_answered_worker_lists() -> None:
    reg = registry("a", "b", "c", "d")
    reg.probe_ok("a", [{"id": M}, {"id": "lora-1"}], None)
    reg.probe_ok("b", [{"id": M}], None)
    snapshot = fleet_loads(reg, NoAdmission())  # type: ignore[arg-type]
    assert snapshot[M].fleet == 4  # a, b, and c and d (not answered yet)
    assert snapshot["lora-1"].fleet == 1  # only "a" lists it
    # Once "c" answers with another model, the fleet serves two: "d" counts for neither.
    reg.probe_ok("c", [{"id": "other"}], None)
    snapshot = fleet_loads(reg, NoAdmission())  # type: ignore[arg-type]
    assert (snapshot[M].fleet, snapshot["other"].fleet) == (2, 1)
    # Nobody answered yet: no model known, nothing to report.
    assert fleet_loads(registry("x", "y"), NoAdmission()) == {}  # type: ignore[arg-type]


async def test_a_gateway_restarted_while_two_of_three_workers_are_down() -> None:
    """The review's reproducer: the gauge asks for the 3 workers, not for the 1 that answered."""
    from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
    from tests.support.sim_workers import run_sim_workers

    async with run_sim_workers(3) as fleet:
        for w in fleet.workers[1:]:
            w.faults.update({"unhealthy": True})
        async with run_gateway(settings_for(list(fleet))) as g:
            await g.wait_healthy(1)
            workers = g.gw.registry.workers
            await until(
                lambda: all(workers[n].health is Health.UNHEALTHY for n in ("w1", "w2")),
                10,
                "w1 and w2 down",
            )
            m = await g.metrics()
    label = f'{{model="{MODEL}"}}'
    assert m[f"kvgate_autoscale_healthy_workers{label}"] == 1
    assert m[f"kvgate_autoscale_desired_workers{label}"] == 3


async def test_refused_requests_scale_a_model_back_up_from_zero() -> None:
    import httpx

    from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
    from tests.support.sim_workers import run_sim_workers

    label = f'{{model="{MODEL}"}}'
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auto = {"min_workers": 0, "scale_in_cooldown_s": 0}
    async with (
        run_sim_workers(1) as fleet,
        run_gateway(settings_for(list(fleet), autoscale=auto)) as g,
        httpx.AsyncClient(timeout=10) as c,
    ):
        await g.wait_healthy(1)
        for _ in range(3):
            m = await g.metrics()
        assert m[f"kvgate_autoscale_desired_workers{label}"] == 0
        fleet.workers[0].faults.update({"unhealthy": True})
        await until(lambda: not g.gw.registry.healthy(), 10, "worker down")
        assert (await g.metrics())[f"kvgate_autoscale_desired_workers{label}"] == 0
        for _ in range(5):
            assert (await c.post(g.url + "/v1/chat/completions", json=body)).status_code == 503
        m = await g.metrics()
    assert m[f"kvgate_autoscale_desired_workers{label}"] == 1
