"""Load through a misbehaving fleet: one worker flapping its health, one stalling mid-stream,
one failing a share of its requests. Nothing but intended outcomes reach clients, and when the
load is over nothing is held anywhere (the worker crash under load, which needs the workers in a
child process, is in tests/gateway/test_tenancy_e2e.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections import Counter
from typing import Any

import httpx
import orjson

from tests.faults.conftest import (
    HEAP_LIMIT,
    KEY_OPEN,
    MODEL,
    Stack,
    fault_settings,
    memory_watch,
)
from tests.gateway.conftest import run_gateway
from tests.support.sim_workers import run_sim_workers

AUTH = {"authorization": f"Bearer {KEY_OPEN}"}


async def _flap(fleet: Any, stop: asyncio.Event) -> None:
    faults = fleet.workers[0].faults
    while not stop.is_set():
        faults.update({"unhealthy": not faults.unhealthy})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.3)
    faults.update({"unhealthy": False})


async def _one(c: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    """(status, how the stream ended: done / error_then_done / body)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: " + "words " * 30}],
        "max_tokens": 24,
        "stream": i % 3 != 0,
    }
    async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH) as r:
        raw = await r.aread()
    if r.status_code != 200:
        doc = orjson.loads(raw)
        assert set(doc["error"]) >= {"message", "type", "param", "code"}, raw[:300]
        assert "retry-after" in r.headers or r.status_code != 503, r.headers
        return r.status_code, "error"
    if not body["stream"]:
        assert orjson.loads(raw)["choices"], raw[:300]
        return 200, "body"
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    return 200, "error_then_done" if b'"error"' in raw else "done"


async def test_load_through_a_flapping_stalling_failing_fleet() -> None:
    async with run_sim_workers(3, profile="fast") as fleet:
        s = fault_settings(list(fleet))
        s = s.model_copy(
            update={
                "probes": s.probes.model_copy(
                    update={"interval_s": 0.1, "unhealthy_after": 1, "backoff_initial_s": 0.1}
                ),
                "timeouts": s.timeouts.model_copy(update={"idle_s": 0.5, "first_byte_s": 5}),
            }
        )
        async with run_gateway(s) as running:
            assert running.server is not None
            st = Stack(running.url, 0, running.gw, running.server, fleet)
            deadline = time.monotonic() + 10
            while len(st.gw.registry.healthy()) < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            with memory_watch() as heap:
                async with httpx.AsyncClient(timeout=30) as c:  # warm-up, no faults yet
                    await asyncio.gather(*(_one(c, st.url, i) for i in range(-12, 0)))
                await st.assert_quiescent(timeout=10)
                heap.mark()
                fleet.workers[1].faults.update({"stall_after_tokens": 5})
                fleet.workers[2].faults.update({"error_rate": 0.3, "error_status": 500})
                fleet.workers[2].faults._rng = random.Random(7)
                stop = asyncio.Event()
                flapper = asyncio.create_task(_flap(fleet, stop))
                sem = asyncio.Semaphore(6)

                async def bounded(c: httpx.AsyncClient, i: int) -> tuple[int, str]:
                    async with sem:
                        return await _one(c, st.url, i)

                try:
                    async with httpx.AsyncClient(timeout=30) as c:
                        results = await asyncio.gather(*(bounded(c, i) for i in range(60)))
                finally:
                    stop.set()
                    await flapper
                for w in fleet.workers:
                    w.faults.reset()
                outcomes = Counter(results)
                # Retries hide failures before the first byte; a stalled stream ends with an SSE
                # error and [DONE]; a 503 only when no worker was routable at that instant.
                assert {status for status, _ in outcomes} <= {200, 503}, outcomes
                assert outcomes[(200, "done")] + outcomes[(200, "body")] >= 20, outcomes
                await st.assert_quiescent(timeout=10)
                m = st.metrics()
                assert m.get('kvgate_stream_errors_total{reason="idle_timeout"}', 0) >= 1, outcomes
                retried = sum(v for k, v in m.items() if k.startswith("kvgate_retries_total"))
                assert retried >= 1, outcomes  # the failing worker's 500s went to another worker
                heap.assert_near_baseline(HEAP_LIMIT)


async def test_a_broken_stream_is_not_kept_alive_by_its_log_line(caplog) -> None:  # type: ignore[no-untyped-def]
    """The warning for a stream that broke off names the error as text: a record holding the
    exception would hold its traceback and, through it, the request's frames, body and relay
    for as long as any handler keeps the record (the writer's queue under a stuck log sink,
    here pytest's capture). Before: every idle-timed-out stream stayed in memory."""
    from gateway.relay import RelayResponse

    async with run_sim_workers(1, profile="fast") as fleet:
        s = fault_settings(list(fleet))
        s = s.model_copy(
            update={"timeouts": s.timeouts.model_copy(update={"idle_s": 0.3, "first_byte_s": 5})}
        )
        async with run_gateway(s) as running:
            deadline = time.monotonic() + 10
            while not running.gw.registry.healthy():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            fleet.workers[0].faults.update({"stall_after_tokens": 3})
            with caplog.at_level("WARNING", logger="kvgate.proxy"):
                async with httpx.AsyncClient(timeout=30) as c:
                    got = [await _one(c, running.url, i) for i in (1, 2, 4)]
            fleet.workers[0].faults.reset()
            assert got == [(200, "error_then_done")] * 3, got
            idle = [r for r in caplog.records if "idle_timeout" in r.getMessage()]
            assert len(idle) == 3 and all(
                not isinstance(a, BaseException) for r in idle for a in (r.args or ())
            )

            def alive() -> int:
                gc.collect()
                return sum(isinstance(o, RelayResponse) for o in gc.get_objects())

            # The relays' own cleanup runs after the client's last byte: polled, as a loaded host
            # may take longer than a fixed pause; a record holding a relay never lets it go.
            deadline = time.monotonic() + 10
            while n := alive():
                assert time.monotonic() < deadline, f"{n} relays still referenced"
                await asyncio.sleep(0.05)
