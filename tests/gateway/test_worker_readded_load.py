"""A worker removed and added back at the same URL while requests run there is the same server:
its new record counts those requests (in flight, queued prefill), so its room is its cap minus
what still runs, and each of them, ending, frees its slot once. The new record used to start at
0 while the retired one kept counting them: the worker took its whole cap again on top (cap 4,
4 running, room 4), and [cluster] published none of that load."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.app import Gateway
from gateway.call import Call
from gateway.config import Settings
from scoring.views import RouteRequest
from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.support.polling import until as _until
from workers.worker import Health, Worker

CARDS = [{"id": MODEL, "object": "model"}]
CAP = 4
ADMIN = "kvg-readded-admin"


def _settings(url: str | None) -> Settings:
    workers = [] if url is None else [{"name": "w0", "url": url, "max_concurrency": CAP}]
    return settings_for([], workers=workers)


def _healthy(gw: Gateway) -> Worker:
    gw.registry.probe_ok("w0", CARDS, None)
    w = gw.registry.workers["w0"]
    assert w.health is Health.HEALTHY
    return w


def _dispatch(gw: Gateway, w: Worker, prefill: int = 100) -> Call:
    """One request on `w`, as the lifecycle counts it (its prefill still queued)."""
    call = Call("r", MODEL, "/v1/chat/completions", b"{}", True, False, RouteRequest(MODEL))
    w.dispatched(prefill)
    call.prefill_tokens = prefill
    return call


def _remove_and_add_back(gw: Gateway, how: str, url: str) -> None:
    if how == "file":
        gw.apply(_settings(None))
        gw.apply(_settings(url))
    else:  # /admin/workers: DELETE, then POST (both go through sync_workers)
        spec = gw.registry.workers["w0"].spec
        gw.sync_workers([])
        gw.sync_workers([spec])


@pytest.mark.parametrize("how", ["file", "admin"])
async def test_the_re_added_record_counts_what_still_runs_there(how: str) -> None:
    gw = Gateway(_settings("http://127.0.0.1:9"))
    old = _healthy(gw)
    calls = [_dispatch(gw, old) for _ in range(CAP)]
    assert gw.slots.worker_room(old) == 0
    _remove_and_add_back(gw, how, "http://127.0.0.1:9")
    await asyncio.sleep(0)
    new = _healthy(gw)  # probed anew, like any added worker
    assert (new.in_flight, new.prefill_tokens) == (CAP, CAP * 100)
    assert gw.slots.worker_room(new) == 0  # not a fresh cap on top of the 4 still running
    assert gw._in_flight() == CAP  # counted once: not also as a retired record's
    gauge = gw.metrics.registry.get_sample_value("kvgate_worker_in_flight", {"worker": "w0"})
    assert gauge == CAP
    # The requests end on the record they hold: each frees one slot of the worker, once.
    for i, call in enumerate(calls, 1):
        gw.life.first_byte(old, call, 0.01)
        gw.life.released(old, call)
        assert new.in_flight == CAP - i and gw.slots.worker_room(new) == i
    assert (new.in_flight, new.prefill_tokens, gw._in_flight()) == (0, 0, 0)
    assert not gw._retired


async def test_a_worker_moved_away_and_back_counts_what_runs_at_its_address() -> None:
    gw = Gateway(_settings("http://127.0.0.1:9"))
    at_a = _healthy(gw)
    on_a = [_dispatch(gw, at_a) for _ in range(3)]
    gw.apply(_settings("http://127.0.0.1:10"))  # another server: nothing of A's is its load
    at_b = _healthy(gw)
    assert at_b.in_flight == 0 and gw._in_flight() == 3
    on_b = [_dispatch(gw, at_b)]
    gw.apply(_settings("http://127.0.0.1:9"))  # back at A, where 3 still run
    back = _healthy(gw)
    assert back.in_flight == 3 and gw.slots.worker_room(back) == CAP - 3
    assert gw._in_flight() == 4  # A's 3, and B's 1 on its retired record
    for call in on_a:
        gw.life.released(at_a, call)
    for call in on_b:
        gw.life.released(at_b, call)
    assert back.in_flight == 0 and at_b.in_flight == 0 and gw._in_flight() == 0


async def test_a_worker_added_back_after_its_requests_ended_starts_at_zero() -> None:
    gw = Gateway(_settings("http://127.0.0.1:9"))
    old = _healthy(gw)
    call = _dispatch(gw, old)
    gw.apply(_settings(None))
    gw.life.released(old, call)
    gw.apply(_settings("http://127.0.0.1:9"))
    new = _healthy(gw)
    assert new is not old and new.in_flight == 0 and gw.slots.worker_room(new) == CAP


@contextlib.asynccontextmanager
async def _held_stream(c: httpx.AsyncClient, url: str) -> AsyncIterator[None]:
    """A stream the worker stalls in (its fault), held open until the block is left."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hold"}],
        "stream": True,
        "max_tokens": 500,
        "ignore_eos": True,
    }
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        started = asyncio.Event()

        async def read() -> None:  # to the end (leaving the iterator early closes the stream)
            async for _ in r.aiter_bytes():
                started.set()

        reader = asyncio.create_task(read())
        try:
            await asyncio.wait_for(started.wait(), 30)  # it runs on the worker
            yield
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await reader


async def test_through_the_admin_api_the_cap_holds_for_requests_still_running(sims) -> None:  # type: ignore[no-untyped-def]
    """Real requests: two streams fill a cap of 2, w0 is removed and added back through
    /admin/workers; a third request waits for a slot instead of running as a third, and every
    request's end is counted once."""
    fleet = sims(1)
    url = fleet.urls[0]
    settings = settings_for(
        [],
        workers=[{"name": "w0", "url": url, "max_concurrency": 2}],
        timeouts={"first_byte_s": 30, "idle_s": 60, "total_s": 60},
        admission={"default_deadline_s": 30, "max_deadline_s": 30, "priority_reserve": 0},
        admin={"key_sha256": hashlib.sha256(ADMIN.encode()).hexdigest()},
    )
    admin = {"authorization": f"Bearer {ADMIN}"}
    async with run_gateway(settings) as g, httpx.AsyncClient(timeout=60) as c:
        gw = g.gw
        await g.wait_healthy(1)
        assert (await c.post(url + "/sim/faults", json={"stall_after_tokens": 2})).is_success
        async with _held_stream(c, g.url), _held_stream(c, g.url):
            assert gw.registry.workers["w0"].in_flight == 2
            r = await c.delete(g.url + "/admin/workers/w0", headers=admin)
            assert r.status_code == 200, r.text
            r = await c.post(
                g.url + "/admin/workers",
                json={"name": "w0", "url": url, "max_concurrency": 2},
                headers=admin,
            )
            assert r.status_code == 201, r.text
            await g.wait_healthy(1)
            await c.post(url + "/sim/faults", json={"stall_after_tokens": None})
            third = asyncio.create_task(
                c.post(
                    g.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "3"}]},
                )
            )
            assert await _until(lambda: third.done() or gw.admission.queued() == 1)
            assert not third.done(), "a third request ran beside the two on a worker capped at 2"
            rec = gw.registry.workers["w0"]
            assert rec.in_flight == 2 and gw.slots.worker_room(rec) == 0
        # The streams hung up: their slots free, the third runs.
        r = await third
        assert r.status_code == 200, r.text
        assert await _until(lambda: gw._in_flight() == 0)
        assert rec is gw.registry.workers["w0"] and rec.in_flight == 0
        assert gw.slots.worker_room(rec) == 2 and not gw._retired
