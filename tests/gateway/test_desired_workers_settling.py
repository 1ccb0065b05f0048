"""The desired worker count after a (re)start: never below the fleet seen before the first scale-in.

A gateway keeps no memory of its last `desired` across a restart, and its first evaluations may
see only part of the fleet (first probes still out, a worker restarting or down). An autoscaler
that sets `replicas = desired` would then remove workers at once, with no cooldown. Until the
model's first scale-in step, `desired` follows the largest fleet seen (healthy `N`, or
`ModelLoad.fleet`: workers known to serve the model in any health state); only a scale-in step
after its calm cooldown may go below it (gateway/desired_workers.py, module docstring).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.redis_server import free_port
from gateway.autoscale import fleet_loads
from gateway.desired_workers import AutoscaleSettings, DesiredWorkers, ModelLoad, WorkerLoad
from tests.gateway.conftest import MODEL, flat_metrics, run_gateway, settings_for, start_sims
from workers.registry import Registry
from workers.vllm_metrics import WorkerMetrics
from workers.worker import Health, WorkerSpec

REPO = Path(__file__).resolve().parents[2]
M = "m"


def loads(n: int, kv: float = 0.1, queued: int = 0, fleet: int = 0) -> dict[str, ModelLoad]:
    workers = tuple(WorkerLoad(kv) for _ in range(n))
    # `fleet` only where a test sets it: the tests without it hold for a ModelLoad without one.
    return {M: ModelLoad(workers, queued, fleet) if fleet else ModelLoad(workers, queued)}


def est(**kw: Any) -> DesiredWorkers:
    return DesiredWorkers(AutoscaleSettings(**kw), clock=lambda: pytest.fail("clock read"))


def one(d: DesiredWorkers, snapshot: dict[str, ModelLoad], now: float) -> Any:
    (sig,) = d.evaluate(snapshot, now)
    return sig


def test_workers_probed_after_the_first_evaluation_raise_desired() -> None:
    """1 of 4 workers probed at the first scrape: desired follows the fleet as it is seen, with
    no scale event, and the first step in still waits for the whole calm cooldown."""
    d = est(scale_in_cooldown_s=300)
    assert one(d, loads(1), 0.0).desired_workers == 1
    sig = one(d, loads(4), 10.0)
    assert (sig.desired_workers, sig.decision) == (4, "cooldown")
    assert d.scale_events(M) == (0, 0)  # catching up with the fleet is no scale decision
    assert one(d, loads(3), 20.0).desired_workers == 4  # a worker going down lowers nothing
    assert one(d, loads(4), 290.0).desired_workers == 4
    sig = one(d, loads(4), 300.0)  # calm since the first evaluation
    assert (sig.desired_workers, sig.decision) == (3, "scale_in")
    # From the first step in, the count is the autoscaler's: the worker it asked to remove is
    # still healthy until the autoscaler removes it, and must not undo the step.
    assert one(d, loads(4), 310.0).desired_workers == 3
    assert one(d, loads(5), 320.0).desired_workers == 3
    assert d.scale_events(M) == (0, 1)


def test_known_workers_that_are_down_count_before_the_first_scale_in() -> None:
    """A worker that reported the model but is down (or on a half-open trial) when the gateway
    first evaluates is part of the fleet: the restart does not ask to remove it."""
    d = est()
    sig = one(d, loads(1, fleet=2), 0.0)
    assert (sig.healthy_workers, sig.desired_workers) == (1, 2)
    assert one(d, loads(1, fleet=2), 10.0).desired_workers == 2
    assert one(d, loads(2, fleet=2), 20.0).desired_workers == 2
    assert d.scale_events(M) == (0, 0)
    # Bounds still hold.
    assert one(est(max_workers=3), loads(1, fleet=5), 0.0).desired_workers == 3


def test_a_scale_out_on_a_partial_view_does_not_end_the_floor() -> None:
    """A scale-out computed while only part of the fleet was probed is relative to that part;
    once the rest is seen, desired does not stay below it."""
    d = est()
    sig = one(d, loads(1, queued=12), 0.0)  # r_queue = 3 with N = 1: capped at 2
    assert (sig.desired_workers, sig.decision) == (2, "scale_out")
    sig = one(d, loads(4), 5.0)
    assert (sig.healthy_workers, sig.desired_workers) == (4, 4)


def test_fleet_loads_counts_known_workers_in_any_health_but_not_draining() -> None:
    names = ("a", "b", "c", "d", "e")
    reg = Registry([WorkerSpec(n, f"http://{n}") for n in names])
    for name in ("a", "b", "c", "d"):
        reg.probe_ok(name, [{"id": M}], WorkerMetrics(kv_usage=0.1))
    reg.workers["b"].health = Health.UNHEALTHY
    reg.workers["c"].health = Health.HALF_OPEN
    reg.workers["c"].in_flight = 1  # its trial is out: no candidate now, still in the fleet
    reg.drain("d")
    # "e" never answered: it counts for M, the one model every answering worker lists (it may
    # be loading: a gateway restarted then must not ask to remove it).

    class Admission:
        def pools(self) -> list[str]:
            return []

        def depth_by_tier(self, pool: str | None = None) -> dict[int, int]:
            return {}

    snapshot = fleet_loads(reg, Admission())  # type: ignore[arg-type]
    assert len(snapshot[M].workers) == 1  # N: only "a" may take a request now
    assert snapshot[M].fleet == 4  # a, b, c, and e
    assert DesiredWorkers().evaluate(snapshot, 0.0)[0].desired_workers == 4


def start_sim_on(port: int) -> subprocess.Popen[bytes]:
    """One simulated worker on `port` (the gateway already has its URL), not waited for."""
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--workers", "1"]
    cmd += ["--profile", "fast", "--model", MODEL]
    return subprocess.Popen(cmd, start_new_session=True, cwd=REPO)


async def test_gateway_started_while_a_worker_is_down_keeps_the_fleet() -> None:
    """The gateway starts with 1 of its 2 workers down; the first scrape sees 1. Once both are
    healthy (and idle), the gauge must not ask for fewer than 2."""
    fleet = start_sims(1)
    port = free_port()
    late: subprocess.Popen[bytes] | None = None
    try:
        s = settings_for([fleet.urls[0], f"http://127.0.0.1:{port}"])
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=10) as c:
            await g.wait_healthy(1, timeout=30)
            m = flat_metrics((await c.get(g.url + "/metrics")).text)
            assert m[f'kvgate_autoscale_desired_workers{{model="{MODEL}"}}'] >= 1
            late = start_sim_on(port)
            await g.wait_healthy(2, timeout=60)
            m = flat_metrics((await c.get(g.url + "/metrics")).text)
            healthy = m[f'kvgate_autoscale_healthy_workers{{model="{MODEL}"}}']
            desired = m[f'kvgate_autoscale_desired_workers{{model="{MODEL}"}}']
            assert healthy == 2 and desired == 2, (healthy, desired)
    finally:
        fleet.kill()
        if late is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(late.pid, signal.SIGKILL)
            late.wait(10)
