"""Each request is counted once: in kvgate_rejected_requests_total when the gateway refused it
before any worker was picked, in kvgate_requests_total (under its worker) once one was."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.support.sim_workers import run_sim_workers


def _chat(**kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def _sum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix + "{"))


async def test_an_admission_refusal_is_counted_once() -> None:
    async with run_sim_workers(1, faults={"added_latency_ms": 400}) as fleet:
        s = settings_for(list(fleet), admission={"worker_concurrency": 1, "max_queued": 1})
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=10) as c:
                rs = await asyncio.gather(
                    *[
                        c.post(
                            g.url + "/v1/chat/completions",
                            json=_chat(),
                            headers={"x-kvgate-deadline-ms": "100"},
                        )
                        for _ in range(6)
                    ]
                )
            refused = [r.status_code for r in rs if r.status_code != 200]
            assert refused and set(refused) == {503}
            m = await g.metrics()
    outcomes = {
        k: v
        for k, v in m.items()
        if k.startswith("kvgate_admission_outcomes_total{") and 'outcome="admitted"' not in k
    }
    assert sum(outcomes.values()) == len(refused), outcomes
    assert _sum(m, "kvgate_rejected_requests_total") == len(refused)
    assert m['kvgate_rejected_requests_total{reason="503"}'] == len(refused)
    assert _sum(m, "kvgate_requests_total") == len(rs) - len(refused)


async def test_a_whole_answer_past_its_total_timeout_is_a_request_of_its_worker_only() -> None:
    async with run_sim_workers(1, faults={"added_latency_ms": 300}) as fleet:
        s = settings_for(list(fleet), timeouts={"total_s": 0.1})
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(g.url + "/v1/chat/completions", json=_chat())
            assert r.status_code == 504
            m = await g.metrics()
    assert m[f'kvgate_requests_total{{model="{MODEL}",status="504",worker="w0"}}'] == 1
    assert _sum(m, "kvgate_requests_total") == 1
    assert _sum(m, "kvgate_rejected_requests_total") == 0, m


async def test_a_client_that_leaves_during_the_prefill_is_counted_on_its_worker() -> None:
    """The worker had the request (no response head yet): its 499 is that worker's, not "-"."""
    async with (
        run_sim_workers(1, faults={"added_latency_ms": 5000}) as fleet,
        run_gateway(settings_for(list(fleet))) as g,
    ):
        await g.wait_healthy(1)
        w0 = g.gw.registry.workers["w0"]
        async with httpx.AsyncClient(timeout=30) as c:

            async def stream() -> None:
                async with c.stream(
                    "POST", g.url + "/v1/chat/completions", json=_chat(stream=True)
                ) as r:
                    async for _ in r.aiter_bytes():
                        pass

            task = asyncio.create_task(stream())
            await until(lambda: w0.in_flight == 1, 10, "dispatched")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        get = g.gw.metrics.registry.get_sample_value
        labels = {"model": MODEL, "status": "499", "worker": "w0"}
        await until(lambda: get("kvgate_requests_total", labels) == 1, 10, "counted")
        m = await g.metrics()
    assert m[f'kvgate_requests_total{{model="{MODEL}",status="499",worker="w0"}}'] == 1
    assert not any('worker="-"' in k for k in m), m
    assert _sum(m, "kvgate_rejected_requests_total") == 0, m
