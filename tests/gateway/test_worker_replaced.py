"""A worker a reload moves to a new URL, or that restarts at its address, is a new server with an
empty prefix cache: what routing learned of the old one must go, the old server's late outcomes
must not judge the new one, and requests still running on a removed record still count for a
drain. Each of these went wrong before (the new server was credited with the old one's cache,
ejected for the old pod's failures, and a drain exited under streams on a removed worker)."""

from __future__ import annotations

import asyncio

from gateway.app import Gateway
from gateway.call import Call
from scoring.views import RouteRequest
from tests.gateway.conftest import MODEL, settings_for
from workers.vllm_metrics import WorkerMetrics
from workers.worker import Health

CHAIN = list(range(1000, 1032))
CARDS = [{"id": MODEL, "object": "model"}]


def _gateway(urls: list[str]) -> Gateway:
    return Gateway(settings_for(urls, routing={"policy": "kv_aware"}))


async def test_a_worker_moved_to_a_new_url_is_forgotten_by_routing() -> None:
    gw = _gateway(["http://127.0.0.1:9", "http://127.0.0.1:10"])
    gw.routing_state.index.record("w0", CHAIN)
    gw.routing_state.index.record("w1", CHAIN)
    gw.routing_state.sessions.put("s", "w0", 0.0)
    gw.apply(
        settings_for(["http://127.0.0.1:11", "http://127.0.0.1:10"], routing={"policy": "kv_aware"})
    )
    await asyncio.sleep(0)
    assert gw.registry.workers["w0"].url == "http://127.0.0.1:11"
    assert gw.routing_state.index.match(CHAIN) == {"w1": len(CHAIN)}  # w1 kept its own
    assert gw.routing_state.sessions.lookup("s", 0.0) is None


async def test_a_worker_restarted_at_its_address_is_forgotten_by_routing() -> None:
    gw = _gateway(["http://127.0.0.1:9"])
    reg = gw.registry
    reg.probe_ok("w0", CARDS, WorkerMetrics(process_start=1000.0))
    gw._on_probe(reg.workers["w0"], True, 0.01)
    gw.routing_state.index.record("w0", CHAIN)
    reg.probe_ok("w0", CARDS, WorkerMetrics(process_start=1000.0))  # the same process
    gw._on_probe(reg.workers["w0"], True, 0.01)
    assert gw.routing_state.index.match(CHAIN) == {"w0": len(CHAIN)}
    reg.probe_ok("w0", CARDS, WorkerMetrics(process_start=2000.0))  # vLLM restarted
    gw._on_probe(reg.workers["w0"], True, 0.01)
    assert gw.routing_state.index.match(CHAIN) == {}


async def test_the_old_servers_outcomes_do_not_judge_the_new_one() -> None:
    gw = _gateway(["http://old:8000"])
    reg = gw.registry
    reg.probe_ok("w0", CARDS, None)
    old = reg.workers["w0"]
    for _ in range(3):
        old.dispatched(0)  # requests in flight on the old pod
    gw.apply(settings_for(["http://new:8000"], routing={"policy": "kv_aware"}))
    reg.probe_ok("w0", CARDS, None)
    new = reg.workers["w0"]
    assert new is not old and new.health is Health.HEALTHY
    for _ in range(reg.unhealthy_after + 2):  # the old pod goes away: its requests fail
        gw.life.failed(old, "ConnectError: old pod gone")
    assert new.health is Health.HEALTHY
    # ... and they still count until they end: a drain waits for (or cuts) them.
    assert gw._in_flight() == 3
    call = Call("r1", MODEL, "/v1/chat/completions", b"{}", True, False, RouteRequest(MODEL))
    for _ in range(3):
        gw.life.released(old, call)
    assert gw._in_flight() == 0 and not gw._retired
