"""A simulated worker whose engine loop died (an engine bug) says so, as vLLM does with a dead
engine: /health answers 503, and every generation request a 500 in vLLM's error envelope
(`InternalServerError`), never the server framework's plain-text 500."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from tests.support.sim_workers import run_sim_workers
from workers.sim.engine_types import StepOutput

MODEL = "sim-llama"


def _boom(now: float) -> StepOutput:
    raise RuntimeError("simulated engine bug")


def _envelope(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 500, (r.status_code, r.text[:200])
    assert r.headers["content-type"] == "application/json", r.text[:200]
    body = r.json()
    assert list(body) == ["error"]
    err = body["error"]
    assert list(err) == ["message", "type", "param", "code"]
    assert err["type"] == "InternalServerError" and err["code"] == 500 and err["param"] is None
    assert err["message"]
    return err


async def test_a_dead_engine_loop_fails_health_and_answers_vllms_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="workers.sim.realtime")
    async with (
        run_sim_workers(1, profile="fast", num_blocks=64, block_size=16) as fleet,
        httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client,
    ):
        base, w = fleet[0], fleet.workers[0]
        assert (await client.get(f"{base}/health")).status_code == 200
        w.engine.step = _boom  # type: ignore[method-assign]
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 2}
        first = await client.post(f"{base}/v1/completions", json=body)
        _envelope(first)  # the request the engine died under
        for _ in range(200):  # the loop records its error as it ends
            if not w.loop.alive:
                break
            await asyncio.sleep(0.01)
        assert not w.loop.alive and isinstance(w.loop.error, RuntimeError)

        health = await client.get(f"{base}/health")
        assert health.status_code == 503 and health.content == b""

        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for path, req in (
            ("/v1/completions", body),
            ("/v1/completions", {**body, "stream": True}),
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", {**chat, "stream": True}),
        ):
            r = await client.post(base + path, json=req)
            err = _envelope(r)
            assert "simulated engine bug" in err["message"], (path, err)
