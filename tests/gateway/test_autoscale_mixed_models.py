"""Workers that have not answered a probe yet, in a fleet serving several models.

Before its first answer a worker's model list is unknown; what its config says of it is its
name, URL and labels. Workers configured with the same labels are taken as replicas of one
deployment: an unanswered one counts toward the desired-workers floor of the models that every
answering worker with its labels lists (gateway/autoscale.py, ``fleet_loads``). Without such a
peer, the fleet-wide rule holds: the models every answering worker lists, none in a fleet of
several models (test_autoscale_from_zero).
"""

from __future__ import annotations

from typing import Any

from gateway.autoscale import fleet_loads
from gateway.desired_workers import DesiredWorkers
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.gateway.test_autoscale_from_zero import NoAdmission
from tests.support.sim_workers import run_sim_workers
from workers.registry import Registry
from workers.worker import Health, WorkerSpec

LLAMA, QWEN = "llama", "qwen"


def labelled(**pools: str) -> Registry:
    """Workers named by the keyword, labelled ``pool = <value>`` ("" = no labels)."""
    return Registry(
        [WorkerSpec(n, f"http://{n}", labels={"pool": p} if p else {}) for n, p in pools.items()]
    )


def fleets(reg: Registry) -> dict[str, int]:
    return {m: load.fleet for m, load in fleet_loads(reg, NoAdmission()).items()}  # type: ignore[arg-type]


def test_unanswered_workers_count_for_the_models_of_workers_labelled_alike() -> None:
    """The start-up of a fleet of 3 llama and 2 qwen workers: one of each answered."""
    reg = labelled(l1="llama", l2="llama", l3="llama", q1="qwen", q2="qwen")
    reg.probe_ok("l1", [{"id": LLAMA}], None)
    reg.probe_ok("q1", [{"id": QWEN}], None)
    reg.workers["l3"].health = Health.UNHEALTHY  # its probes failed: no model list yet
    assert fleets(reg) == {LLAMA: 3, QWEN: 2}
    snapshot = fleet_loads(reg, NoAdmission())  # type: ignore[arg-type]
    sigs = {s.model: s for s in DesiredWorkers().evaluate(snapshot, 0.0)}
    assert (sigs[LLAMA].desired_workers, sigs[QWEN].desired_workers) == (3, 2)
    # Each answer replaces the assumption; a draining worker counts for nothing.
    reg.probe_ok("l2", [{"id": LLAMA}], None)
    reg.drain("q2")
    assert fleets(reg) == {LLAMA: 3, QWEN: 1}


def test_the_assumed_models_are_those_every_peer_lists() -> None:
    reg = labelled(a1="a", a2="a", a3="a", b1="b")
    reg.probe_ok("a1", [{"id": LLAMA}, {"id": "lora-1"}], None)
    reg.probe_ok("a2", [{"id": LLAMA}], None)
    reg.probe_ok("b1", [{"id": QWEN}], None)
    assert fleets(reg) == {LLAMA: 3, "lora-1": 1, QWEN: 1}
    # Peers that disagree entirely (the labels do not follow the model): it counts for none.
    reg.probe_ok("a2", [{"id": QWEN}], None)
    assert fleets(reg) == {LLAMA: 1, "lora-1": 1, QWEN: 2}
    # A draining peer says nothing of it.
    reg.drain("a2")
    assert fleets(reg) == {LLAMA: 2, "lora-1": 2, QWEN: 1}


def test_without_a_labelled_peer_the_fleet_wide_rule_holds() -> None:
    # Labelled, but no worker with its labels has answered: every answering worker's models.
    reg = labelled(a1="", b1="canary")
    reg.probe_ok("a1", [{"id": LLAMA}], None)
    assert fleets(reg) == {LLAMA: 2}
    # Several models and no labels to tell the workers apart: it counts for none, as before.
    reg = labelled(l1="", q1="", x="")
    reg.probe_ok("l1", [{"id": LLAMA}], None)
    reg.probe_ok("q1", [{"id": QWEN}], None)
    assert fleets(reg) == {LLAMA: 1, QWEN: 1}
    # Labels of its own, none shared: the same.
    reg = labelled(l1="llama", q1="qwen", x="new")
    reg.probe_ok("l1", [{"id": LLAMA}], None)
    reg.probe_ok("q1", [{"id": QWEN}], None)
    assert fleets(reg) == {LLAMA: 1, QWEN: 1}


async def test_a_gateway_started_while_a_worker_of_each_model_is_down() -> None:
    """Two models, two workers each, labelled by pool; one of each fails its probes from the
    start. The gauge asks for the 2 workers of each model, not for the 1 that answered."""
    down: dict[str, Any] = {"unhealthy": True}
    async with run_sim_workers(2) as a, run_sim_workers(2, model="model-b") as b:
        a.workers[1].faults.update(down)
        b.workers[1].faults.update(down)
        workers = [
            {"name": f"{p}{i}", "url": u, "labels": {"pool": p}}
            for p, fleet in (("a", a), ("b", b))
            for i, u in enumerate(fleet)
        ]
        async with run_gateway(settings_for([], workers=workers)) as g:
            reg = g.gw.registry
            await g.wait_healthy(2)
            await until(
                lambda: all(reg.workers[n].health is Health.UNHEALTHY for n in ("a1", "b1")),
                10,
                "a1 and b1 down",
            )
            m = await g.metrics()
    for model in (MODEL, "model-b"):
        label = f'{{model="{model}"}}'
        assert m[f"kvgate_autoscale_healthy_workers{label}"] == 1
        assert m[f"kvgate_autoscale_desired_workers{label}"] == 2, model
