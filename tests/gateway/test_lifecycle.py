"""What a dispatch changes, through `gateway.lifecycle.Lifecycle` directly: the counts routing
reads come back to zero whatever the attempt's end, the policy hears once per attempt, a freed
slot wakes admission, a failure that leaves a worker unhealthy gets it probed, and a finished
request is settled and counted. The walk's suites (tests/gateway, tests/faults) check the proxy and the
relay report every attempt."""

from __future__ import annotations

from typing import Any

from gateway.app import Gateway
from gateway.call import Account, Call
from gateway.config import TenantSettings
from gateway.quota import TenantLimits
from gateway.tenancy import Tenant
from scoring.views import Decision, RouteRequest, WorkerView
from tests.gateway.conftest import settings_for
from workers.worker import Health


class Recorder:
    """A policy that records what the lifecycle tells it."""

    name = "recorder"

    def __init__(self) -> None:
        self.dispatched: list[str] = []
        self.prefilled: list[str] = []

    def on_dispatch(self, worker_name: str, request: RouteRequest) -> None:
        self.dispatched.append(worker_name)

    def on_prefill_done(self, worker_name: str, request: RouteRequest) -> None:
        self.prefilled.append(worker_name)


class Prober:
    def __init__(self) -> None:
        self.poked: list[str] = []

    def poke(self, name: str) -> None:
        self.poked.append(name)


def gateway() -> tuple[Gateway, list[str | None]]:
    gw = Gateway(settings_for(["http://127.0.0.1:9", "http://127.0.0.1:10"]))
    kicks: list[str | None] = []
    gw.admission.kick = kicks.append  # type: ignore[method-assign]
    for w in gw.registry.workers.values():
        w.health = Health.HEALTHY
        gw.registry.probe_ok(w.name, [{"id": "m"}], None)  # they serve `call()`'s model
    return gw, kicks


def call(attempts: int = 1) -> Call:
    route = RouteRequest("m", chain=(1, 2, 3), prompt_tokens=48, block_chain=(7, 8, 9))
    c = Call("r1", "m", "/v1/chat/completions", b"{}", True, False, route)
    c.attempts = attempts
    return c


def decision(name: str, prefill: int) -> Decision:
    return Decision(WorkerView(name=name), "load", {"queue": 0.1}, 0, prefill)


def test_an_attempt_counts_on_its_worker_until_released_and_the_policy_hears_once() -> None:
    gw, kicks = gateway()
    life, w = gw.life, gw.registry.workers["w0"]
    policy, c = Recorder(), call()
    life.dispatched(policy, c, decision("w0", 40), w)  # type: ignore[arg-type]
    assert (w.in_flight, w.prefill_tokens, w.sent_tokens_since_scrape) == (1, 40, 40)
    assert policy.dispatched == [] and c.route_debug is not None  # learned once it is sent
    life.learned(c, w)
    assert policy.dispatched == ["w0"]
    life.first_byte(w, c, 0.05)
    assert (w.in_flight, w.prefill_tokens) == (1, 0)
    assert policy.prefilled == ["w0"]
    life.released(w, c)
    assert (w.in_flight, w.prefill_tokens) == (0, 0)
    assert policy.prefilled == ["w0"]  # not told twice
    assert kicks == ["m"]  # the freed slot wakes admission for the model


def test_an_attempt_released_before_its_first_byte_gives_its_prefill_back() -> None:
    gw, kicks = gateway()
    life, w = gw.life, gw.registry.workers["w1"]
    policy, c = Recorder(), call()
    life.dispatched(policy, c, decision("w1", 25), w)  # type: ignore[arg-type]
    w.prefill_tokens += 5  # another request's share stays
    life.released(w, c)
    assert (w.in_flight, w.prefill_tokens) == (0, 5)
    assert policy.prefilled == ["w1"]  # its pending prefill is over either way
    assert kicks == ["m"]


def test_failures_that_take_a_worker_out_get_it_probed() -> None:
    gw, _ = gateway()
    prober = Prober()
    gw.life.prober = prober  # type: ignore[assignment]
    w = gw.registry.workers["w0"]
    gw.life.failed(w, "connect: refused")
    assert w.health is Health.HEALTHY and prober.poked == []  # one failure: not yet
    gw.life.failed(w, "connect: refused")  # unhealthy_after = 2
    assert w.health is not Health.HEALTHY and prober.poked == ["w0"]


async def test_a_finished_request_is_settled_and_counted() -> None:
    gw, _ = gateway()
    settled: list[Any] = []

    async def settle(c: Call) -> None:
        settled.append(c.request_id)

    gw.life.settlement.settle = settle  # type: ignore[method-assign]
    c = call()
    tenant = Tenant("t", TenantSettings(), TenantLimits(), "salt", "")
    c.account = Account(tenant, None, prompt_estimate=48)
    c.status, c.outcome, c.worker = 200, "ok", "w0"
    await gw.life.finish(c)
    assert settled == ["r1"]
    labels = {"model": "m", "worker": "w0", "status": "200"}
    assert gw.metrics.registry.get_sample_value("kvgate_requests_total", labels) == 1
