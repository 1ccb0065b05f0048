"""Admission pools (one per model) that share workers: a worker serving a base model and its LoRA
adapters counts its free slots in every one of those pools, so a slot granted in one pool is gone
for the others until the grantee dispatches. And the other side of it: a pool on workers of its
own must not wait for another pool's grants longer than the loop turn they take to be used.

The real Gateway/Slots/Registry where the sharing comes from the registry; "dispatch" is the
synchronous ``in_flight += 1`` the proxy does right after admission.
"""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
from prometheus_client import generate_latest

from gateway.admission import AdmissionController, AdmissionSettings
from gateway.app import Gateway
from gateway.call import Call
from gateway.core_settings import worker_spec
from gateway.errors import APIError
from scoring.views import RouteRequest
from tests.gateway.conftest import MODEL, settings_for
from workers.worker import Health, Worker

LORA = "sim-llama-lora"


def _one_worker_two_models(cap: int, *, recheck_s: float = 10.0) -> tuple[Gateway, Worker]:
    s = settings_for(["http://127.0.0.1:9"], admission={"recheck_s": recheck_s})
    s = s.model_copy(
        update={"workers": [w.model_copy(update={"max_concurrency": cap}) for w in s.workers]}
    )
    gw = Gateway(s)
    (w,) = gw.registry.workers.values()
    w.health = Health.HEALTHY
    w.models = frozenset({MODEL, LORA})
    return gw, w


async def _admit(gw: Gateway, model: str) -> None:
    await gw.admission.admit(
        tenant="t",
        priority=0.5,
        deadline_s=5.0,
        has_room=functools.partial(gw.slots.free, model, 0.5),
        pool=model,
    )


async def _turns(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_one_freed_slot_is_granted_once_not_once_per_model() -> None:
    gw, w = _one_worker_two_models(2)
    w.in_flight = 2  # full
    peak = 0

    async def request(model: str) -> None:
        nonlocal peak
        await _admit(gw, model)
        w.in_flight += 1  # the dispatch
        peak = max(peak, w.in_flight)

    tasks = [asyncio.create_task(request(MODEL)), asyncio.create_task(request(LORA))]
    await _turns()
    assert gw.admission.queued() == 2
    w.in_flight -= 1  # one request finished: one slot free
    gw.admission.kick()  # every pool, as a probe or the recheck timer does
    await _turns()
    assert peak == 2 and w.in_flight == 2 and gw.admission.queued() == 1
    w.in_flight -= 1  # the next one frees: the other model's waiter takes it
    gw.admission.kick()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert peak == 2 and gw.admission.queued() == 0 and gw.admission._granted == 0
    gw.admission.close()


async def test_a_model_that_never_queued_does_not_take_a_slot_granted_to_another() -> None:
    gw, w = _one_worker_two_models(2)
    w.in_flight = 2
    peak = 0

    async def request(model: str) -> None:
        nonlocal peak
        await _admit(gw, model)
        w.in_flight += 1
        peak = max(peak, w.in_flight)

    base = asyncio.create_task(request(MODEL))
    await _turns()
    assert gw.admission.pool_queue(LORA) is None  # the adapter's pool does not exist yet
    lora = asyncio.create_task(request(LORA))  # first runs after the kick below, before `base`
    w.in_flight -= 1
    gw.admission.kick(MODEL)  # the only free slot is granted to `base`, which has not resumed
    await _turns()
    assert peak == 2 and w.in_flight == 2
    assert base.done() and not lora.done() and gw.admission.queued() == 1
    lora.cancel()
    await asyncio.gather(base, lora, return_exceptions=True)
    assert gw.admission._granted == 0
    gw.admission.close()


async def test_a_pool_on_other_workers_is_admitted_once_the_grants_holding_it_are_used() -> None:
    """Grants are counted across pools, so a pool on workers of its own can be held back by
    another pool's pending grants; it must go the loop turn they are used, not at the recheck
    timer (10 s here)."""
    c = AdmissionController(AdmissionSettings(recheck_s=10.0))
    cap = {"a": 0, "b": 1}  # disjoint workers: pool a none free, pool b one
    busy = {"a": 0, "b": 0}

    def free(pool: str) -> int:
        return cap[pool] - busy[pool]

    async def request(pool: str) -> bool:
        got = await c.admit(
            tenant="t", priority=0.5, has_room=functools.partial(free, pool), pool=pool
        )
        busy[pool] += 1
        assert busy[pool] <= cap[pool]
        return got.queued

    waiting_a = [asyncio.create_task(request("a")) for _ in range(3)]
    await _turns()
    b = asyncio.create_task(request("b"))  # first runs after the kick below
    cap["a"] = 3
    c.kick("a")  # three grants pending in pool a when b arrives
    for _ in range(5):
        await asyncio.sleep(0)
        if b.done():
            break
    assert b.done(), "pool b was still waiting for pool a's grants after 5 loop turns"
    assert busy == {"a": 3, "b": 1}
    await asyncio.wait_for(asyncio.gather(*waiting_a), 5)
    assert c.queued() == 0 and c._granted == 0


async def test_random_traffic_on_pools_sharing_workers_never_oversubscribes() -> None:
    """Three models on one worker set of 4 slots, int predicates, kicks of one pool and of all
    pools, cancellations: every request ends exactly once and the workers never exceed 4."""
    rng = random.Random(4321)
    c = AdmissionController(AdmissionSettings(max_queued=40, recheck_s=0.005))
    slots = 4
    in_flight = peak = 0
    served = refused = 0

    def free() -> int:
        return slots - in_flight

    async def request(pool: str) -> None:
        nonlocal in_flight, peak, served, refused
        try:
            await c.admit(
                tenant=rng.choice("ab"),
                priority=rng.choice([0.1, 0.5, 0.9]),
                deadline_s=rng.choice([0.05, 0.5, 5.0]),
                has_room=free,
                pool=pool,
            )
        except APIError:
            refused += 1
            return
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(rng.random() * 0.004)
        finally:
            in_flight -= 1
            if rng.random() < 0.5:
                c.kick(pool)
            else:
                c.kick()  # every pool, as the recheck timer and a probe do
        served += 1

    tasks = []
    for _ in range(300):
        tasks.append(asyncio.create_task(request(rng.choice(["base", "lora1", "lora2"]))))
        if rng.random() < 0.1:
            rng.choice(tasks).cancel()
        if rng.random() < 0.3:
            await asyncio.sleep(0)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert not [r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)]
    assert served + refused + cancelled == 300 and served > 0
    assert peak <= slots and in_flight == 0
    assert c.queued() == 0 and c._granted == 0


async def test_a_slot_a_base_model_request_frees_admits_a_queued_adapter_request_at_once() -> None:
    # Released through the lifecycle, as the proxy releases it: every model the worker serves
    # is kicked, not only the finished request's (the recheck timer here is 10 s away).
    gw, w = _one_worker_two_models(1)
    w.in_flight = 1  # full, with a base-model request
    waiter = asyncio.create_task(_admit(gw, LORA))
    await _turns()
    assert gw.admission.queued() == 1
    done = Call("r1", MODEL, "/v1/chat/completions", b"{}", True, False, RouteRequest(MODEL))
    gw.life.released(w, done)
    await _turns()
    assert waiter.done() and gw.admission.queued() == 0
    gw.admission.close()


async def test_a_model_that_leaves_the_fleet_takes_its_pool_and_series_with_it() -> None:
    # Review finding: the admission pool and kvgate_admission_* series of a model no worker
    # serves any more stayed forever (a dashboard ghost per retired model).
    s = settings_for(["http://127.0.0.1:9", "http://127.0.0.1:10"])
    workers = [w.model_copy(update={"max_concurrency": 1}) for w in s.workers]
    gw = Gateway(s.model_copy(update={"workers": workers}))
    for name, model in (("w0", MODEL), ("w1", LORA)):
        gw.registry.probe_ok(name, [{"id": model}], None)
        gw.registry.workers[name].health = Health.HEALTHY
    for name, model in (("w0", MODEL), ("w1", LORA)):
        gw.registry.workers[name].in_flight = 1  # full: the request queues in its model's pool
        waiter = asyncio.ensure_future(_admit(gw, model))
        await _turns()
        assert not waiter.done()
        gw.registry.workers[name].in_flight = 0
        gw.admission.kick()
        await asyncio.wait_for(waiter, 5)
    metrics = gw.metrics.registry
    assert sorted(gw.admission.pools()) == sorted([MODEL, LORA])

    def series(model: str) -> float | None:
        labels = {"model": model, "tier": "5", "outcome": "admitted"}
        return metrics.get_sample_value("kvgate_admission_outcomes_total", labels)

    assert series(LORA) == 1 and series(MODEL) == 1
    gw.sync_workers([s for s in map(worker_spec, gw.settings.workers) if s.name == "w0"])
    assert gw.admission.pools() == [MODEL]
    assert series(LORA) is None and series(MODEL) == 1
    assert 'model="sim-llama-lora"' not in generate_latest(metrics).decode()


@pytest.mark.parametrize("via", ["every pool", "the worker's models"])
async def test_a_freed_shared_slot_goes_to_the_highest_priority_of_every_pool(via: str) -> None:
    # Review finding: strict priority held inside one pool's queue only, and pools were kicked
    # in creation (or frozenset) order: a 0.1 adapter request that queued first took the slot
    # ahead of a 0.9 base-model request waiting for the same worker.
    gw, w = _one_worker_two_models(1)
    w.in_flight = 1  # full
    order: list[str] = []

    async def request(name: str, model: str, priority: float) -> None:
        await gw.admission.admit(
            tenant=name,
            priority=priority,
            deadline_s=5.0,
            has_room=functools.partial(gw.slots.free, model, priority),
            pool=model,
        )
        w.in_flight += 1
        order.append(name)

    low = asyncio.create_task(request("low", LORA, 0.1))
    await _turns()
    high = asyncio.create_task(request("high", MODEL, 0.9))
    await _turns()
    assert gw.admission.queued() == 2
    w.in_flight -= 1
    gw.admission.kick() if via == "every pool" else gw.admission.kick(w.models)
    await _turns()
    try:
        assert order == ["high"]
    finally:
        gw.admission.close()
        await asyncio.gather(low, high, return_exceptions=True)


def test_a_full_canary_pool_yields_to_room_outside_it() -> None:
    # Review finding: admission counts every worker's free slots, but dispatch kept a canary
    # request on its full canary worker (the pool filter was dropped only when empty): a canary
    # at max_concurrency 1 reached 6 in flight beside an idle stable worker.
    s = settings_for(["http://127.0.0.1:9", "http://127.0.0.1:10"])
    canary_labels = {"pool": "canary"}
    workers = [
        s.workers[0].model_copy(update={"max_concurrency": 1, "labels": canary_labels}),
        s.workers[1].model_copy(update={"max_concurrency": 1}),
    ]
    gw = Gateway(s.model_copy(update={"workers": workers}))
    for name in ("w0", "w1"):
        gw.registry.probe_ok(name, [{"id": MODEL}], None)
        gw.registry.workers[name].health = Health.HEALTHY
    canary, stable = gw.registry.workers["w0"], gw.registry.workers["w1"]

    def in_canary(w: Worker) -> bool:
        return w.spec.labels == canary_labels

    assert gw.slots.eligible(MODEL, set(), in_canary) == [canary]  # room in the pool: the pool
    canary.in_flight = 1
    assert gw.slots.eligible(MODEL, set(), in_canary) == [stable]  # full: room elsewhere
    stable.in_flight = 1
    assert gw.slots.eligible(MODEL, set(), in_canary) == [canary]  # all full: the pool still


# -- retries: one queue per model and set of tried workers -----------------------------------------


async def test_a_retry_is_not_held_up_by_another_retry_waiting_for_a_full_worker() -> None:
    # Review finding: every retry of a model shared one queue whose kick stopped at the head; a
    # retry waiting for full worker B held up one behind it whose own untried worker A was free.
    ac = AdmissionController(AdmissionSettings(default_deadline_s=10, recheck_s=10))
    room = {"A": 0, "B": 0}
    x = asyncio.create_task(
        ac.admit(
            tenant="t", priority=0.5, has_room=lambda: room["B"], pool="m", tried=frozenset("A")
        )
    )
    await _turns()
    y = asyncio.create_task(
        ac.admit(
            tenant="t", priority=0.5, has_room=lambda: room["A"], pool="m", tried=frozenset("B")
        )
    )
    await _turns()
    assert ac.queued() == 2
    room["A"] = 1
    ac.kick("m")  # what a request finishing on A does
    await _turns()
    assert y.done() and y.result().queued
    assert not x.done()  # B is still full
    room["B"] = 1
    ac.kick("m")
    await _turns()
    assert x.done()
    assert ac._retries == {}  # emptied retry queues are dropped, not kept per tried set


async def test_a_retry_with_no_untried_worker_left_is_refused_at_once() -> None:
    # Review finding: a retry whose untried workers all stopped serving its model (drained,
    # removed, unhealthy) while one it tried still did waited out its whole deadline.
    gw, w = _one_worker_two_models(1)
    w.in_flight = 1
    retry = asyncio.create_task(
        gw.admission.admit(
            tenant="t",
            priority=0.5,
            deadline_s=30.0,
            has_room=functools.partial(gw.slots.free, MODEL, 0.5, frozenset({"other"})),
            pool=MODEL,
            tried=frozenset({"other"}),
        )
    )
    await _turns()
    assert gw.admission.queued() == 1  # it has one untried worker: it waits for its room
    left_out = functools.partial(gw.slots.free, MODEL, 0.5, frozenset({w.name}))
    assert left_out() == -1  # the only worker is one it tried
    gone = asyncio.create_task(
        gw.admission.admit(
            tenant="t",
            priority=0.5,
            deadline_s=30.0,
            has_room=left_out,
            pool=MODEL,
            tried=frozenset({w.name}),
        )
    )
    await _turns()
    assert gone.done()
    with pytest.raises(APIError) as e:
        gone.result()
    assert e.value.status == 503 and "has not tried" in e.value.message
    assert gw.admission.queued() == 1 and not retry.done()
    retry.cancel()
