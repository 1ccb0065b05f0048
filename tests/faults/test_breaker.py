"""A worker that passes `/health` but fails every request.

Before the fix, three consecutive request failures marked it unhealthy, the next `/health` probe
(poked at once by the passive failure) readmitted it milliseconds later, and readmission wiped
the breaker's window: under load it flapped `-> healthy` many times a second and a third of the
requests needed a retry. Now request failures hold it out (the hold doubling per ejection) and
only a successful real request readmits it, so after the first few failures it costs almost
nothing. Default probe settings, as in the report.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import orjson

from gateway.config import ProbeSettings
from tests.faults.conftest import KEY_OPEN, MODEL, Stack, fault_settings
from tests.gateway.conftest import run_gateway
from tests.support.sim_workers import run_sim_workers
from workers.worker import Health, Worker

AUTH = {"authorization": f"Bearer {KEY_OPEN}"}
REQUESTS = 300
CLIENTS = 4


async def _one(c: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    """(status, the worker that answered)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: " + "words " * 20}],
        "max_tokens": 4,
        "stream": i % 2 == 0,
    }
    async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH) as r:
        raw = await r.aread()
    if r.status_code == 200 and body["stream"]:
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-200:]
    elif r.status_code == 200:
        assert orjson.loads(raw)["choices"], raw[:300]
    return r.status_code, r.headers.get("x-kvgate-worker", "")


async def test_a_worker_failing_every_request_while_health_says_200_stays_ejected() -> None:
    async with run_sim_workers(4, profile="fast") as fleet:
        s = fault_settings(list(fleet), probes=ProbeSettings().model_dump())
        async with run_gateway(s) as running:
            assert running.server is not None
            st = Stack(running.url, 0, running.gw, running.server, fleet)
            reg = st.gw.registry
            deadline = time.monotonic() + 10
            while len(reg.healthy()) < 4:
                assert time.monotonic() < deadline, "workers never became healthy"
                await asyncio.sleep(0.02)
            readmitted: list[Health] = []  # w3's transitions to HEALTHY, and from what
            hook = reg.on_change

            def watch(w: Worker, was: Health) -> None:
                if w.name == "w3" and w.health is Health.HEALTHY:
                    readmitted.append(was)
                if hook is not None:
                    hook(w, was)

            reg.on_change = watch
            fleet.workers[3].faults.update({"error_rate": 1.0, "error_status": 500})
            sem = asyncio.Semaphore(CLIENTS)

            async def bounded(c: httpx.AsyncClient, i: int) -> tuple[int, str]:
                async with sem:
                    return await _one(c, st.url, i)

            async with httpx.AsyncClient(timeout=30) as c:
                results = await asyncio.gather(*(bounded(c, i) for i in range(REQUESTS)))
            statuses = Counter(status for status, _ in results)
            served = Counter(worker for _, worker in results)
            m = st.metrics()
            retries = sum(v for k, v in m.items() if k.startswith("kvgate_retries_total"))
            w3 = reg.workers["w3"]
            summary = (statuses, served, retries, Counter(readmitted), w3.health, w3.ejections)
            # Every client request succeeded: the failures were retried on good workers.
            assert statuses == {200: REQUESTS}, summary
            assert served["w3"] == 0, summary
            # It was ejected and stayed out: never (or hardly ever) fully readmitted ...
            assert w3.health is not Health.HEALTHY and w3.ejection_reason, summary
            assert len(readmitted) <= 2, summary
            # ... so the retries it caused are the first few failures and one per trial.
            assert retries <= REQUESTS * 0.1, summary
            await st.assert_quiescent(timeout=10)

            # Fixed: after its hold it goes half-open, and the first request routed to it (the
            # trial) brings it back, with no retry.
            fleet.workers[3].faults.reset()
            async with httpx.AsyncClient(timeout=30) as c, asyncio.timeout(60):
                i = REQUESTS
                while w3.health is not Health.HEALTHY:
                    assert (await _one(c, st.url, i))[0] == 200, summary
                    i += 1
                    if w3.health is Health.UNHEALTHY:
                        await asyncio.sleep(0.05)  # held: let the hold run out
            assert readmitted == [Health.HALF_OPEN], summary
            m = st.metrics()
            assert sum(v for k, v in m.items() if k.startswith("kvgate_retries_total")) == retries
            await st.assert_quiescent(timeout=10)
