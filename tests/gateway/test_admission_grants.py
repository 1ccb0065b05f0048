"""Room admission has granted but its waiter has not used yet, and the model-wide queue bounds.

Review findings, each reproduced with the real Gateway/Registry/Slots/AdmissionController (and
the real Proxy where a retry is involved; only the upstream client is fake):

* A retry checked only `Slots.worker_room` of its next worker: it took a slot just granted to a
  queued waiter (which then went to a full worker) or the priority reserve its tier may not use.
* Pending grants were one global count: a pool on a superset of another's workers (a base model
  beside an adapter loaded on some of its workers, a model beside its retries) took the slot a
  grant of the narrower one counted on.
* Each retry queue had its own ``max_queued`` and ``max_queued_per_tenant``.

"Dispatch" in the admission-level tests is what the proxy does right after admission: pick a
worker with room (`Slots.eligible`, which falls back to a full one) and count it in flight; the
pick is the worst one for the other waiters, which the policy is free to make.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection
from typing import Any

import pytest

from gateway.admission import AdmissionController, AdmissionSettings
from gateway.app import Gateway
from gateway.call import Account, Call
from gateway.errors import APIError
from gateway.fair_queue import tier_of
from gateway.proxy import Proxy
from gateway.tenancy import Tenant
from gateway.upstream import UpstreamConnectError
from scoring.views import RouteRequest
from tests.gateway.conftest import MODEL, settings_for
from workers.worker import Health, Worker

LORA = "sim-llama-lora"


def _gateway(n: int, **admission: Any) -> tuple[Gateway, list[Worker]]:
    """``n`` healthy workers capped at 1 request each, serving MODEL; kept in rotation whatever
    they answer, and no recheck timer within a test."""
    s = settings_for(
        [f"http://127.0.0.1:{9 + i}" for i in range(n)],
        admission={"recheck_s": 10.0, **admission},
        probes={"unhealthy_after": 1000, "breaker_window": 0},
    )
    workers = [w.model_copy(update={"max_concurrency": 1}) for w in s.workers]
    gw = Gateway(s.model_copy(update={"workers": workers}))
    ws = list(gw.registry.workers.values())
    for w in ws:
        w.health = Health.HEALTHY
        w.models = frozenset({MODEL})
    return gw, ws


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class _Upstream:
    """The proxy's upstream client: records how many requests each worker had in flight when
    one was sent to it; an attempt on a worker in ``refuse`` fails once ``fail`` is set (a
    connect error: retried elsewhere), any other holds its slot until ``release`` is set."""

    def __init__(self, gw: Gateway, refuse: Collection[str] = ()) -> None:
        self.gw = gw
        self.refuse = set(refuse)
        self.fail = asyncio.Event()
        self.release = asyncio.Event()
        self.peak: dict[str, int] = {}
        self.sent: list[tuple[str, str]] = []  # (request id, worker)

    async def post(self, url: str, body: bytes, headers: dict[str, str], sent: Any = None) -> Any:
        if sent is not None:
            sent()
        w = next(w for w in self.gw.registry.workers.values() if url.startswith(w.url))
        self.peak[w.name] = max(self.peak.get(w.name, 0), w.in_flight)
        self.sent.append((headers["x-request-id"], w.name))
        if w.name in self.refuse:
            self.refuse.discard(w.name)  # refuses one attempt
            await self.fail.wait()
            raise UpstreamConnectError("refused")
        await self.release.wait()
        raise UpstreamConnectError("done")

    async def close(self) -> None:
        pass


def _with_proxy(gw: Gateway, upstream: _Upstream) -> None:
    gw.proxy = Proxy(gw.registry, upstream, gw.metrics, gw.slots, gw.life)  # type: ignore[arg-type]
    gw.proxy.wait_room = gw._wait_room


def _call(rid: str, tenant: Tenant) -> Call:
    c = Call(rid, MODEL, "/v1/chat/completions", b"{}", True, False, RouteRequest(MODEL))
    c.account = Account(tenant, None, 1)
    c.admit_s = 5.0
    return c


async def _forward(gw: Gateway, call: Call) -> None:
    assert gw.proxy is not None
    with pytest.raises(APIError):  # every attempt ends in a connect error here
        await gw.proxy.forward(call, gw.settings, gw.policy)


async def _walk(gw: Gateway, call: Call) -> None:
    """What `Gateway._dispatch` does: admission, then the proxy, with no await between."""
    assert call.account is not None
    await gw._admit(call.account.tenant, call.model, call.admit_s)
    await _forward(gw, call)


# -- retries are admitted (gateway/proxy.py) ------------------------------------------------------


async def test_a_retry_does_not_take_a_slot_granted_to_a_waiter() -> None:
    gw, (w0, w1) = _gateway(2)
    up = _Upstream(gw, refuse={w0.name})
    _with_proxy(gw, up)
    tenant = gw.tenants.authenticate(None, None)
    w1.in_flight = 1  # a request outside this test runs on w1
    r = asyncio.create_task(_forward(gw, _call("R", tenant)))  # goes to w0, which will refuse it
    await _turns()
    assert up.sent == [("R", w0.name)]
    x = asyncio.create_task(_walk(gw, _call("X", tenant)))
    y = asyncio.create_task(_walk(gw, _call("Y", tenant)))
    await _turns()
    assert gw.admission.queued() == 2
    # In one loop turn: R's attempt fails (its retry comes next) and w1's request ends, whose
    # release grants w1's slot to X; R's release then grants w0's to Y. Neither has resumed yet
    # when R looks for a worker it has not tried: w1 seems free, but X holds it.
    up.fail.set()
    w1.in_flight -= 1
    gw.admission.kick(MODEL)
    await _turns()
    assert up.peak == {w0.name: 1, w1.name: 1}, f"over a cap of 1: {up.peak}"
    assert {rid for rid, _ in up.sent} == {"R", "X", "Y"}
    assert not r.done() and gw.admission.queued() == 1  # the retry waits for w1's next slot
    up.release.set()  # every attempt from now on fails: the retries run out, each on a slot
    await asyncio.wait_for(asyncio.gather(r, x, y), 10)
    assert max(up.peak.values()) == 1 and gw.admission._granted == 0


def _reserved(gw: Gateway) -> None:
    """3 workers capped at 1; 2 of the 3 slots kept free for tier 7 and above."""
    gw.slots.priority_reserve = 0.67
    gw.slots.reserve_tier = tier_of(0.7, gw.slots.priority_levels)


def _tenant(gw: Gateway, priority: float) -> Tenant:
    t = gw.tenants.authenticate(None, None)
    return dataclasses.replace(t, cfg=t.cfg.model_copy(update={"priority": priority}))


async def test_a_low_priority_retry_does_not_take_the_priority_reserve() -> None:
    gw, (w0, w1, w2) = _gateway(3)
    _reserved(gw)
    up = _Upstream(gw, refuse={w0.name})
    _with_proxy(gw, up)
    low = _tenant(gw, 0.1)
    w1.in_flight = w2.in_flight = 1  # R goes to w0
    r = asyncio.create_task(_forward(gw, _call("R", low)))
    await _turns()
    w2.in_flight = 0  # 2 free slots once R leaves w0: exactly the reserve
    assert gw.slots.free(MODEL, 0.1) == 0  # a new low request would wait
    up.fail.set()
    await _turns()
    assert up.sent == [("R", w0.name)], "the low-priority retry took a reserved slot"
    assert gw.admission.queued() == 1 and w2.in_flight == 0
    w1.in_flight = 0  # a third slot frees: one above the reserve, the retry's (on w1 or w2)
    gw.admission.kick(MODEL)
    await _turns()
    assert [rid for rid, _ in up.sent] == ["R", "R"] and up.sent[1][1] != w0.name
    assert gw.slots.free(MODEL, 0.9) == 2  # the reserve is still free
    up.release.set()
    await asyncio.wait_for(r, 10)


async def test_a_high_priority_retry_takes_the_reserve_at_once() -> None:
    gw, (w0, w1, w2) = _gateway(3)
    _reserved(gw)
    up = _Upstream(gw, refuse={w0.name})
    _with_proxy(gw, up)
    w1.in_flight = w2.in_flight = 1
    r = asyncio.create_task(_forward(gw, _call("R", _tenant(gw, 0.9))))
    await _turns()
    w2.in_flight = 0
    up.fail.set()
    await _turns()
    assert up.sent == [("R", w0.name), ("R", w2.name)]
    assert gw.admission.queued() == 0
    w1.in_flight = 0  # free for its last attempt
    up.release.set()
    await asyncio.wait_for(r, 10)


def test_a_retrys_reserve_counts_the_free_slots_of_the_workers_it_tried() -> None:
    # All 3 free, 2 reserved: one slot may go to the low tier, retry or not. Withheld from the
    # 2 untried workers alone, the reserve left the retry none (and it waited to its deadline).
    gw, (w0, _w1, _w2) = _gateway(3)
    _reserved(gw)
    assert gw.slots.free(MODEL, 0.1) == 1
    assert gw.slots.free(MODEL, 0.1, {w0.name}) == 1
    assert gw.slots.free(MODEL, 0.9, {w0.name}) == 2
    w0.in_flight = 1  # the tried worker is busy: 2 free, both reserved
    assert gw.slots.free(MODEL, 0.1, {w0.name}) == 0


# -- pools on overlapping workers: a grant pending in one, a newcomer in another ----------------


def _dispatch(gw: Gateway, model: str, prefer: Worker, tried: Collection[str] = ()) -> Worker:
    """The proxy's pick right after admission: ``prefer`` if it has room (the policy may pick
    any worker with room), else the first `Slots.eligible` offers (a full one if none has)."""
    cands = gw.slots.eligible(model, tried, None)
    w = prefer if prefer in cands and gw.slots.worker_room(prefer) else cands[0]
    w.in_flight += 1
    return w


async def test_a_wider_pool_does_not_take_the_slot_granted_to_a_narrower_one() -> None:
    # The adapter is loaded on w0 only; its base model is on w0 and w1.
    gw, (w0, w1) = _gateway(2)
    w0.models = frozenset({MODEL, LORA})
    peak: list[int] = []

    async def adapter() -> None:
        await gw._admit(_tenant(gw, 0.5), LORA, 5.0)
        peak.append(_dispatch(gw, LORA, w0).in_flight)

    w0.in_flight = w1.in_flight = 1
    waiter = asyncio.create_task(adapter())
    await _turns()
    assert gw.admission.queued() == 1
    w1.in_flight = 0  # w1 frees (its release kicks the base model: nobody waits there)
    gw.admission.kick(MODEL)
    w0.in_flight = 0  # w0 frees: its slot is granted to the adapter's waiter
    gw.admission.kick(sorted(w0.models))
    assert gw.admission._granted == 1 and not waiter.done()
    # A base-model request admitted before the waiter resumes: 2 free for it, 1 granted. It
    # must not go at once: the policy may pick w0 (here it does, when w0 has room).
    await gw._admit(_tenant(gw, 0.5), MODEL, 5.0)
    peak.append(_dispatch(gw, MODEL, w0).in_flight)
    await asyncio.wait_for(waiter, 5)
    assert max(peak) == 1 and w0.in_flight == w1.in_flight == 1, peak
    assert gw.admission._granted == 0 and gw.admission.queued() == 0


async def test_a_new_request_does_not_take_the_slot_granted_to_a_retry() -> None:
    # A retry's pool (the workers it has not tried) is narrower than its model's.
    gw, (w0, w1) = _gateway(2)
    peak: list[int] = []
    tried = frozenset({w0.name})

    async def retry() -> None:
        await gw._admit(_tenant(gw, 0.5), MODEL, 5.0, tried)
        peak.append(_dispatch(gw, MODEL, w1, tried).in_flight)

    w0.in_flight = w1.in_flight = 1
    waiter = asyncio.create_task(retry())
    await _turns()
    assert gw.admission.queued() == 1
    w0.in_flight = w1.in_flight = 0  # both free in one loop turn: w1's slot goes to the retry
    gw.admission.kick(MODEL)
    assert gw.admission._granted == 1 and not waiter.done()
    await gw._admit(_tenant(gw, 0.5), MODEL, 5.0)
    peak.append(_dispatch(gw, MODEL, w1).in_flight)
    await asyncio.wait_for(waiter, 5)
    assert max(peak) == 1 and w0.in_flight == w1.in_flight == 1, peak


async def test_a_pool_on_workers_of_its_own_still_goes_at_once_beside_a_pending_grant() -> None:
    # The price of the check above must not be paid by pools that share nothing: a base-model
    # grant pending with room to spare leaves a model on its own worker its no-wait path.
    gw, (w0, w1, w2) = _gateway(3)
    w2.models = frozenset({LORA})
    w2.spec = dataclasses.replace(w2.spec, max_concurrency=2)
    w0.in_flight = w1.in_flight = 1
    waiter = asyncio.create_task(gw._admit(_tenant(gw, 0.5), MODEL, 5.0))
    await _turns()
    w0.in_flight = w1.in_flight = 0
    gw.admission.kick(MODEL)  # one grant pending, 2 free for it
    assert gw.admission._granted == 1
    adm = await gw._admit(_tenant(gw, 0.5), LORA, 5.0)
    assert not adm.queued
    await asyncio.wait_for(waiter, 5)


# -- max_queued and max_queued_per_tenant hold across a model's queues -------------------------

_TRIED = (frozenset(), frozenset({"w0"}), frozenset({"w1"}), frozenset({"w0", "w1"}))


def _waiters(
    c: AdmissionController, specs: list[tuple[str, float, frozenset[str]]]
) -> list[asyncio.Task[Any]]:
    return [
        asyncio.create_task(
            c.admit(tenant=t, priority=p, has_room=lambda: 0, pool="m", tried=tried)
        )
        for t, p, tried in specs
    ]


def _refusal(task: asyncio.Task[Any]) -> APIError | None:
    if not task.done():
        return None
    e = task.exception()
    assert isinstance(e, APIError)
    return e


async def test_max_queued_bounds_a_models_queues_together() -> None:
    c = AdmissionController(AdmissionSettings(max_queued=2, recheck_s=10))
    tasks = _waiters(c, [(f"t{i}", 0.5, tried) for i, tried in enumerate(_TRIED)])
    await _turns()
    assert c.queued() == 2
    refused = [e for e in map(_refusal, tasks) if e is not None]
    assert [e.status for e in refused] == [503, 503]
    c.close()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_max_queued_per_tenant_counts_a_tenants_retries_too() -> None:
    c = AdmissionController(AdmissionSettings(max_queued_per_tenant=1, recheck_s=10))
    tasks = _waiters(c, [("t", 0.5, _TRIED[0]), ("t", 0.5, _TRIED[1]), ("u", 0.5, _TRIED[1])])
    await _turns()
    assert c.queued() == 2
    e = _refusal(tasks[1])
    assert e is not None and e.status == 429 and e.headers["x-kvgate-admission"] == "tenant_limit"
    assert not tasks[0].done() and not tasks[2].done()
    c.close()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_full_model_sheds_its_lowest_tier_across_its_queues() -> None:
    # Full with two low-priority new requests: a high-priority retry pushes the newest out, as it
    # would inside one queue; a low-priority retry is refused.
    c = AdmissionController(AdmissionSettings(max_queued=2, recheck_s=10))
    low = _waiters(c, [("a", 0.1, _TRIED[0]), ("b", 0.1, _TRIED[0])])
    await _turns()
    high = _waiters(c, [("c", 0.9, _TRIED[1])])
    await _turns()
    assert c.queued() == 2 and not high[0].done()
    assert _refusal(low[0]) is None
    shed = _refusal(low[1])
    assert shed is not None and shed.status == 503
    assert shed.headers["x-kvgate-admission"] == "shed"
    late = _waiters(c, [("d", 0.1, _TRIED[2])])
    await _turns()
    full = _refusal(late[0])
    assert full is not None and full.status == 503 and c.queued() == 2
    c.close()
    await asyncio.gather(*low, *high, *late, return_exceptions=True)
