"""Failure paths against real vLLM: a client that walks away, and a worker that dies."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.gateway.conftest import RunningGateway
from tests.integration.conftest import (
    MAX_MODEL_LEN,
    MODEL,
    VllmFleet,
    gateway_over,
    metric,
    openai_client,
    worker_metrics,
)
from workers.worker import Health

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Tell me a very long story about KV caches."}]


async def _wait_for(what: str, check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


async def test_client_disconnect_aborts_the_real_request(
    gateway: RunningGateway, client: openai.AsyncOpenAI, fleet: VllmFleet
) -> None:
    """Closing the client's stream must stop generation on the worker and free its slot.

    vLLM 0.32 counts aborted requests nowhere in `request_success_total`, so the evidence is
    `num_requests_running` back to 0 and `generation_tokens_total` frozen far below max_tokens.
    """
    max_tokens = MAX_MODEL_LEN - 64
    before = {w.name: await worker_metrics(w.url) for w in fleet.workers}
    gw_before = await gateway.metrics()
    async with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as resp:
        worker = fleet.worker(resp.headers["x-kvgate-worker"])
        received = 0
        async for chunk in await resp.parse():
            received += bool(chunk.choices)
            if received == 3:
                break  # leaving the block closes the connection mid-stream

    async def idle() -> bool:
        m = await worker_metrics(worker.url)
        return metric(m, "vllm:num_requests_running") == 0

    await _wait_for("the worker to drop the aborted request", idle)
    first = metric(await worker_metrics(worker.url), "vllm:generation_tokens_total")
    await asyncio.sleep(1.0)  # a live request would add hundreds of tokens in this time
    second = metric(await worker_metrics(worker.url), "vllm:generation_tokens_total")
    generated = second - metric(before[worker.name], "vllm:generation_tokens_total")
    assert second == first, "generation went on after the worker reported no running request"
    assert generated < max_tokens // 2, f"{generated} of {max_tokens} tokens generated"

    async def counted() -> bool:
        m = await gateway.metrics()
        return m.get("kvgate_client_disconnects_total", 0) > gw_before.get(
            "kvgate_client_disconnects_total", 0
        )

    await _wait_for("the gateway to count the disconnect", counted, timeout=5)


@pytest.mark.kills_worker
async def test_killed_worker_is_ejected_and_traffic_moves_to_the_survivor(
    fleet: VllmFleet,
) -> None:
    """SIGKILL one vLLM (API server and engine core): every request still succeeds, on the
    other worker, and the registry marks the dead one unhealthy. Round-robin so that requests
    are sent to the dead worker until it is ejected, exercising the retry path too."""
    async with gateway_over(fleet, policy="round_robin") as g, openai_client(g.url) as client:
        victim, survivor = fleet.workers
        fleet.kill(victim.name)
        served = []
        for i in range(6):
            stream = i % 2 == 0
            async with client.chat.completions.with_streaming_response.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=4,
                stream=stream,
            ) as resp:
                assert resp.status_code == 200
                served.append(resp.headers["x-kvgate-worker"])
                parsed = await resp.parse()
                if stream:
                    text = "".join([c.choices[0].delta.content or "" async for c in parsed])
                else:
                    text = parsed.choices[0].message.content or ""
            assert text, f"request {i} came back empty"
        assert set(served) == {survivor.name}

        async def ejected() -> bool:
            return g.gw.registry.workers[victim.name].health is Health.UNHEALTHY

        await _wait_for("the registry to eject the killed worker", ejected, timeout=10)
        m = await g.metrics()
        assert m[f'kvgate_worker_up{{worker="{victim.name}"}}'] == 0
        assert m[f'kvgate_worker_up{{worker="{survivor.name}"}}'] == 1
        assert not victim.alive() and survivor.alive()
