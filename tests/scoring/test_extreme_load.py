"""Routing on reachable extremes: a worker reporting an absurd queue, a tiny weight, a client
alternating models; and the view a policy reads is always the worker's current one.

Review findings: `vllm:num_requests_waiting 1e306` (or a worker weight of 1e-310, which the config
accepts) made kv_aware's wait infinite, its queue term NaN and the decision an IndexError, a 500
for every request of the model; round-robin's one counter sent each of two alternating models'
requests to the same worker; `Worker.view()` keyed its cache on `id(metrics)`, and a later scrape
at the same address was routed on the old one.
"""

from __future__ import annotations

import gc
import random

import pytest

from scoring.policy import make_policy
from scoring.route_key import route_request
from scoring.views import RouteRequest
from workers.vllm_metrics import parse_vllm_metrics
from workers.worker import Health, Worker, WorkerMetrics, WorkerSpec

SCRAPE = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="m"} WAITING\n'
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
)


def _route() -> RouteRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi " * 50}]}
    return route_request("chat", body, hash_prefix=True)


def test_an_absurd_queue_is_capped_when_scraped() -> None:
    assert parse_vllm_metrics(SCRAPE.replace("WAITING", "1e306")).waiting == 1 << 31
    assert parse_vllm_metrics(SCRAPE.replace("WAITING", "-5")).waiting == 0


@pytest.mark.parametrize("policy", ["kv_aware", "least_loaded", "prefix", "session"])
def test_a_worker_whose_wait_is_unbounded_is_still_a_choice(policy: str) -> None:
    huge = WorkerMetrics(running=3, waiting=10**306)
    tiny = WorkerSpec("w1", "http://y", weight=1e-310)
    workers = [
        Worker(WorkerSpec("w0", "http://x"), health=Health.HEALTHY, metrics=huge),
        Worker(tiny, health=Health.HEALTHY, metrics=WorkerMetrics(running=2, waiting=2)),
    ]
    p = make_policy(policy, rng=random.Random(0))
    for ws in ([workers[0]], [workers[1]], workers):
        d = p.choose([w.view() for w in ws], _route())
        assert d.worker.name in {w.spec.name for w in ws}


def test_round_robin_spreads_each_model_over_its_workers() -> None:
    p = make_policy("round_robin")
    a = [Worker(WorkerSpec(f"a{i}", f"http://a{i}")).view() for i in range(2)]
    b = [Worker(WorkerSpec(f"b{i}", f"http://b{i}")).view() for i in range(2)]
    seen: dict[str, int] = {}
    for _ in range(100):  # a client alternating two models
        for ws, model in ((a, "ma"), (b, "mb")):
            name = p.choose(ws, RouteRequest(model=model)).worker.name
            seen[name] = seen.get(name, 0) + 1
    assert seen == {"a0": 50, "a1": 50, "b0": 50, "b1": 50}


def test_the_view_follows_every_scrape_even_at_a_reused_address() -> None:
    w = Worker(WorkerSpec("w0", "http://x"), health=Health.HEALTHY)
    stale = 0
    for i in range(200):
        w.metrics = WorkerMetrics(waiting=0)
        w.view()
        # A scrape the view is not read after, then one that may take its freed address.
        w.metrics = WorkerMetrics(waiting=1)
        w.metrics = WorkerMetrics(waiting=40 + i % 2)
        gc.collect()
        stale += w.view().waiting != w.metrics.waiting
    assert stale == 0
