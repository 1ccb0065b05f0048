"""Series of workers, models and tenants that left go with them: pods that come and go under new
names, a fleet moved to another model and tenants a reload removed must not grow /metrics."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from gateway.metrics import GatewayMetrics
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.support.sim_workers import run_sim_workers
from workers.worker import Health

ADMIN = "adm-churn"


def _series(m: GatewayMetrics, label: str, value: str) -> list[str]:
    """Samples (name and labels) of ``m`` whose ``label`` is ``value``."""
    out = []
    for fam in m.registry.collect():
        for s in fam.samples:
            if s.labels.get(label) == value:
                out.append(f"{s.name}{s.labels}")
    return out


def _fill(m: GatewayMetrics, worker: str, model: str, tenant: str) -> None:
    """One of everything a request, a probe and an admission leave behind."""
    m.child(m.requests, model, worker, "200").inc()
    m.child(m.in_flight, worker).set(0)
    m.child(m.queue_delay, worker).set(0.5)
    m.export_health(worker, Health.HEALTHY)
    m.probe_seconds.labels(worker).observe(0.01)
    m.probe_failures.labels(worker).inc()
    m.batched(m.ttft, model, "default").observe(0.1)
    m.batched(m.tpot, model, "default").observe(0.01)
    m.batched(m.inter_event, model).observe(0.01)
    m.batched(m.e2e, model).observe(0.2)
    m.child(m.admission_wait, model, "5").observe(0.01)
    m.child(m.admission_outcomes, model, "5", "admitted").inc()
    m.child(m.tenant_requests, tenant, "admitted").inc()
    m.child(m.tenant_tokens, tenant, "reserved").inc(10)
    m.child(m.quota_degraded, tenant).inc()


def test_forget_worker_drops_every_series_of_the_worker_and_no_other() -> None:
    m = GatewayMetrics()
    _fill(m, "pod-1", "a", "t1")
    _fill(m, "pod-2", "a", "t1")
    assert _series(m, "worker", "pod-1")
    m.child(m.requests, "a", "pod-1", "200").inc()  # pending in its batched child
    m.forget_worker("pod-1", [])
    assert _series(m, "worker", "pod-1") == []
    assert (
        m.registry.get_sample_value(
            "kvgate_requests_total", {"model": "a", "worker": "pod-2", "status": "200"}
        )
        == 1
    )
    # Cached children went too: a worker added back under the name starts from nothing.
    m.child(m.requests, "a", "pod-1", "200").inc()
    assert (
        m.registry.get_sample_value(
            "kvgate_requests_total", {"model": "a", "worker": "pod-1", "status": "200"}
        )
        == 1
    )


def test_forget_model_drops_its_request_latency_and_admission_series() -> None:
    m = GatewayMetrics()
    _fill(m, "w0", "gone", "t1")
    _fill(m, "w1", "kept", "t1")
    m.forget_model("gone")
    assert _series(m, "model", "gone") == []
    names = {s.split("{")[0] for s in _series(m, "model", "kept")}
    for family in (
        "kvgate_requests_total",
        "kvgate_time_to_first_token_seconds_count",
        "kvgate_time_per_output_token_seconds_count",
        "kvgate_inter_event_seconds_count",
        "kvgate_e2e_request_seconds_count",
        "kvgate_admission_wait_seconds_count",
        "kvgate_admission_outcomes_total",
    ):
        assert family in names
    # A batched histogram of the model is a fresh one afterwards, not the dropped child.
    m.batched(m.e2e, "gone").observe(0.2)
    assert m.registry.get_sample_value("kvgate_e2e_request_seconds_count", {"model": "gone"}) == 1


def test_a_removed_tenant_keeps_its_series_until_its_requests_settle() -> None:
    m = GatewayMetrics()
    _fill(m, "w0", "a", "idle")
    _fill(m, "w0", "a", "busy")
    m.child(m.tenant_in_flight, "busy").inc()
    m.forget_tenants({"idle", "busy"})
    assert _series(m, "tenant", "idle") == []
    assert _series(m, "tenant", "busy")  # a request still runs: its settlement counts here
    m.child(m.tenant_in_flight, "busy").dec()
    m.child(m.tenant_tokens, "busy", "settled").inc(3)
    assert _series(m, "tenant", "busy") == []  # the scrape after it settled dropped them
    assert not m._pending_tenants
    # Added back before they settled: kept.
    m.child(m.tenant_in_flight, "again").inc()
    m.forget_tenants({"again"})
    m.keep_tenants({"again"})
    m.child(m.tenant_in_flight, "again").dec()
    assert _series(m, "tenant", "again")


def _labels_in(text: str, label: str) -> set[str]:
    return {
        s.labels[label]
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if label in s.labels
    }


async def test_workers_removed_through_admin_leave_no_series() -> None:
    async with run_sim_workers(1) as fleet:
        s = settings_for([], admin={"key_sha256": hashlib.sha256(ADMIN.encode()).hexdigest()})
        async with run_gateway(s) as g:
            auth = {"authorization": f"Bearer {ADMIN}"}
            async with httpx.AsyncClient(timeout=10) as c:
                for i in range(3):
                    name = f"pod-{i}"
                    r = await c.post(
                        g.url + "/admin/workers", json={"name": name, "url": fleet[0]}, headers=auth
                    )
                    assert r.status_code == 201, r.text
                    await g.wait_healthy(1)
                    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                    r = await c.post(g.url + "/v1/chat/completions", json=chat)
                    assert r.status_code == 200 and r.headers["x-kvgate-worker"] == name
                    r = await c.delete(g.url + f"/admin/workers/{name}", headers=auth)
                    assert r.status_code == 200
                text = (await c.get(g.url + "/metrics")).text
    assert not {w for w in _labels_in(text, "worker") if w.startswith("pod-")}, text


def _config(url: str, tenants: list[str]) -> Settings:
    d: dict[str, Any] = settings_for([url]).model_dump()
    d["tenants"] = {n: {"keys_sha256": [hashlib.sha256(n.encode()).hexdigest()]} for n in tenants}
    return Settings(**d)


async def test_a_reload_drops_removed_tenants_and_models_nobody_serves() -> None:
    async with run_sim_workers(1) as a, run_sim_workers(1, model="model-b") as b:
        first = _config(a[0], ["cust0", "cust1"])
        async with run_gateway(first) as g:
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=10) as c:
                for name in ("cust0", "cust1"):
                    r = await c.post(
                        g.url + "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": [{"role": "user", "content": "hi"}],
                            "stream": True,
                        },
                        headers={"authorization": f"Bearer {name}"},
                    )
                    assert r.status_code == 200
                text = (await c.get(g.url + "/metrics")).text
                assert {"cust0", "cust1"} <= _labels_in(text, "tenant")
                assert MODEL in _labels_in(text, "model")
                # cust0 leaves, and the fleet moves to model-b: sim-llama is served by nobody.
                g.gw.apply(_config(b[0], ["cust1"]))
                w0 = g.gw.registry
                await until(
                    lambda: "model-b" in w0.workers["w0"].models and bool(w0.healthy()),
                    10,
                    "w0 serves model-b",
                )
                text = (await c.get(g.url + "/metrics")).text
    assert "cust0" not in _labels_in(text, "tenant") and "cust1" in _labels_in(text, "tenant")
    gateway_families = {
        f.name
        for f in text_string_to_metric_families(text)
        if not f.name.startswith("kvgate_autoscale")
    }
    left = [
        f"{s.name}{s.labels}"
        for fam in text_string_to_metric_families(text)
        if fam.name in gateway_families
        for s in fam.samples
        if s.labels.get("model") == MODEL
    ]
    assert not left, left
