"""Series of what a reload removed stay gone: the autoscale series of a model nobody serves any
more, and the series of a worker (or a model) whose last stream finished after it was removed.

`metrics._forget` drops the series of workers, models and tenants that left (test_metrics_churn).
Two ways around it: the ``kvgate_autoscale_*`` series come from ``DesiredWorkers``, which kept
evaluating a model that left for as long as it held samples or requests in flight (the p95 window,
or the whole length of a stream still running on the removed worker), still asking for its old
``desired``; and a request that finished on a removed worker counted itself under that worker's
name again, after its series had been dropped, bringing them back for good.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CollectorRegistry

from gateway.autoscale import AutoscaleCollector, fleet_loads
from gateway.desired_workers import DesiredWorkers
from gateway.metrics import GatewayMetrics
from tests.gateway.conftest import (
    MODEL,
    SCRIPTED_EVENTS,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
    until,
)
from tests.gateway.test_autoscale import scrape
from tests.gateway.test_autoscale_from_zero import NoAdmission, est, loads, one, registry
from tests.gateway.test_metrics_churn import _fill, _labels_in, _series
from tests.support.sim_workers import run_sim_workers
from workers.vllm_metrics import WorkerMetrics
from workers.worker import Health, WorkerSpec

M = "m"


# -- 1. the autoscale series of a model that left ------------------------------------------------
def test_a_model_absent_from_the_snapshot_is_not_evaluated() -> None:
    d = est()
    for i in range(20):
        d.observe_ttft(M, 0.1, now=0.1 * i)
    lease = d.begin(M, 100, now=1.0)  # a stream still running on the removed worker
    assert one(d, loads(2, fleet=3), 2.0).desired_workers == 3
    # A reload removed the model's workers: no signals, though samples and a lease remain.
    assert d.evaluate({}, 3.0) == []
    assert d.evaluate({}, 30.0) == []
    # Back within the window (its worker moved to a new URL and answered again): it resumes
    # where it was, the floor of the fleet seen included, and no scale event was counted.
    assert one(d, loads(1, fleet=1), 31.0).desired_workers == 3
    assert d.scale_events(M) == (0, 0)
    # Gone for longer than the window with nothing in flight: forgotten, it starts afresh.
    lease.end()
    assert d.evaluate({}, 200.0) == []
    assert one(d, loads(1, fleet=1), 201.0).desired_workers == 1


def test_removing_a_models_last_worker_drops_its_autoscale_series() -> None:
    reg = registry("a", "b")
    reg.probe_ok("a", [{"id": M}], WorkerMetrics(kv_usage=0.1))
    reg.probe_ok("b", [{"id": "other"}], WorkerMetrics(kv_usage=0.1))
    t = [0.0]
    d = DesiredWorkers(clock=lambda: t[0])
    prom = CollectorRegistry(auto_describe=True)
    prom.register(AutoscaleCollector(d, functools.partial(fleet_loads, reg, NoAdmission())))
    for model in (M, "other"):
        d.observe_ttft(model, 0.2, now=0.0)
        d.observe_queue_wait(model, 0.0, now=0.0)
    t[0] = 1.0
    assert {"other", M} <= _models_in(scrape(prom))
    reg.sync([WorkerSpec("a", "http://a")])  # the reload: "b", the only worker of "other", goes
    t[0] = 2.0  # well inside the p95 window: its samples are still there
    assert _models_in(scrape(prom)) == {M}


def _models_in(got: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> set[str]:
    return {dict(labels)["model"] for series in got.values() for labels in series}


async def test_a_reload_that_removes_a_model_drops_its_autoscale_series_at_once() -> None:
    async with (
        run_sim_workers(1) as a,
        run_sim_workers(1, model="model-b") as b,
        run_gateway(settings_for(list(a))) as g,
        httpx.AsyncClient(timeout=10) as c,
    ):
        await g.wait_healthy(1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        assert (await c.post(g.url + "/v1/chat/completions", json=body)).status_code == 200
        text = (await c.get(g.url + "/metrics")).text
        assert MODEL in _labels_in(text, "model")
        g.gw.apply(settings_for(list(b)))  # the fleet moves to model-b
        await until(lambda: bool(g.gw.registry.healthy()), 10, "model-b's worker healthy")
        text = (await c.get(g.url + "/metrics")).text
    assert MODEL not in _labels_in(text, "model"), [
        line for line in text.splitlines() if MODEL in line
    ]
    assert "model-b" in _labels_in(text, "model")


# -- 2. a request that finishes on a worker that is gone -----------------------------------------
def test_a_worker_that_is_gone_gets_no_series_back() -> None:
    m = GatewayMetrics()
    fleet = {"pod-1", "pod-2"}
    m.worker_names = fleet  # what the gateway wires: its registry's workers
    _fill(m, "pod-1", "a", "t1")
    _fill(m, "pod-2", "a", "t1")
    fleet.discard("pod-1")
    m.forget_worker("pod-1")
    # Its last stream ends after that: counted, released, exported as the walk does.
    m.child(m.requests, "a", "pod-1", "200").inc()
    m.child(m.in_flight, "pod-1").set(0)
    m.child(m.queue_delay, "pod-1").set(0.3)
    m.export_health("pod-1", Health.HEALTHY)
    assert _series(m, "worker", "pod-1") == []
    # The others count as before, a request no worker had ("-") included.
    m.child(m.requests, "a", "-", "503").inc()
    m.child(m.requests, "a", "pod-2", "200").inc()
    got = m.registry.get_sample_value
    assert got("kvgate_requests_total", {"model": "a", "worker": "-", "status": "503"}) == 1
    assert got("kvgate_requests_total", {"model": "a", "worker": "pod-2", "status": "200"}) == 2
    # Added back under the name: its series start again from nothing.
    fleet.add("pod-1")
    m.child(m.requests, "a", "pod-1", "200").inc()
    assert got("kvgate_requests_total", {"model": "a", "worker": "pod-1", "status": "200"}) == 1


def test_a_model_that_is_gone_gets_no_series_back() -> None:
    # The same for a model: a stream ending after a reload removed its model's last worker
    # brought back its requests, ttft, tpot and e2e series until the next reload.
    m = GatewayMetrics()
    listed = {"a", "b"}
    m.model_known = listed.__contains__  # what the gateway wires: Registry.knows_model
    _fill(m, "pod-1", "a", "t1")
    _fill(m, "pod-2", "b", "t1")
    listed.discard("a")
    m.forget_model("a")
    m.child(m.requests, "a", "-", "200").inc()
    m.batched(m.e2e, "a").observe(1.0)
    m.batched(m.ttft, "a", "default").observe(0.1)
    m.batched(m.inter_event, "a").observe(0.01)
    m.flush()
    assert _series(m, "model", "a") == []
    count = m.registry.get_sample_value
    before = count("kvgate_e2e_request_seconds_count", {"model": "b"})
    m.batched(m.e2e, "b").observe(1.0)  # a model still listed counts as before
    m.flush()
    assert count("kvgate_e2e_request_seconds_count", {"model": "b"}) == before + 1
    listed.add("a")  # listed again: its series start from nothing
    m.batched(m.e2e, "a").observe(1.0)
    m.flush()
    assert count("kvgate_e2e_request_seconds_count", {"model": "a"}) == 1


def held_stream(release: asyncio.Event, started: asyncio.Event) -> object:
    """A worker whose stream sends its first event, then waits for ``release`` to finish."""
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse

    async def chat(request: Request) -> Response:
        await request.body()

        async def gen() -> AsyncIterator[bytes]:
            yield SCRIPTED_EVENTS[0]
            started.set()
            await release.wait()
            for event in SCRIPTED_EVENTS[1:]:
                yield event

        return StreamingResponse(gen(), media_type="text/event-stream; charset=utf-8")

    return stub_app(chat)


async def test_a_stream_that_ends_after_its_worker_was_removed_leaves_no_series() -> None:
    release, started = asyncio.Event(), asyncio.Event()
    async with (
        serve_app(held_stream(release, started)) as held,
        run_sim_workers(1) as other,
        run_gateway(settings_for([held, other[0]])) as g,
        httpx.AsyncClient(timeout=10) as c,
    ):
        await g.wait_healthy(2)
        g.gw.drain_worker("w1", True)  # the stream goes to w0
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with c.stream("POST", g.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "w0"
            chunks = r.aiter_raw()
            await anext(chunks)
            await started.wait()
            # The reload removes w0 while its stream runs; w1 still serves the model.
            g.gw.apply(settings_for([], workers=[{"name": "w1", "url": other[0]}]))
            assert "w0" not in g.gw.registry.workers
            text = (await c.get(g.url + "/metrics")).text
            assert "w0" not in _labels_in(text, "worker")
            release.set()
            rest = b"".join([chunk async for chunk in chunks])
        assert rest.endswith(b"data: [DONE]\n\n")
        seen = g.gw.metrics.registry.get_sample_value
        e2e = "kvgate_e2e_request_seconds_count"
        await until(lambda: seen(e2e, {"model": MODEL}) == 1, 10, "the stream recorded")
        text = (await c.get(g.url + "/metrics")).text
    assert "w0" not in _labels_in(text, "worker"), [
        line for line in text.splitlines() if '"w0"' in line
    ]
