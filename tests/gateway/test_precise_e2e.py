"""Precise routing end to end over simulated workers that publish KV events like vLLM.

The property that lets kvgate scale out: two gateway processes that never talk to each other see
the same KV events, so they make the same affinity choice for the same prompt, including for
blocks that traffic bypassing every gateway put on a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from gateway.config import load_settings
from tests.gateway.conftest import (
    MODEL,
    RunningGateway,
    flat_metrics,
    free_ports,
    run_gateway,
    settings_for,
    until,
)
from tests.support.sim_workers import SimFleet, run_sim_workers

N = 4
PROMPT_BLOCKS = 16  # 256 tokens at the simulator's block size 16


def _prompt(i: int) -> list[int]:
    """A token-id prompt unique to worker i (token-id prompts need no tokenizer in the gateway)."""
    return [1000 + 97 * i + j for j in range(PROMPT_BLOCKS * 16)]


def _config(fleet: SimFleet, port: int) -> str:
    workers = "\n".join(
        f'[[workers]]\nname = "w{i}"\nurl = "{url}"\nkv_events = "{fleet.kv_endpoints[i]}"\n'
        f'kv_events_replay = "{fleet.kv_replay_endpoints[i]}"\n'
        for i, url in enumerate(fleet)
    )
    return f"""
[server]
host = "127.0.0.1"
port = {port}
debug_headers = true

[logging]
level = "warning"

[probes]
interval_s = 0.2
unhealthy_after = 2

[routing]
policy = "kv_aware"

{workers}
"""


async def _trusted(url: str, n: int, timeout: float = 30) -> None:
    """Until the gateway at `url` reports every worker's events in sync (its /metrics)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as c:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                m = flat_metrics((await c.get(url + "/metrics")).text)
                ok = [m.get(f'kvgate_kv_events_trusted{{worker="w{i}"}}', 0) for i in range(n)]
                healthy = [m.get(f'kvgate_worker_up{{worker="w{i}"}}', 0) for i in range(n)]
                if all(ok) and all(healthy):
                    return
            assert time.monotonic() < deadline, f"gateway at {url} never got every worker in sync"
            await asyncio.sleep(0.1)


def _events_in(g: RunningGateway, fleet: SimFleet) -> bool:
    """The gateway has applied every KV event batch each worker has published so far."""
    stats = g.gw.kv_fleet.stats()
    for i, w in enumerate(fleet.workers):
        assert w.kv_publisher is not None
        sent = w.kv_publisher.buffered()
        if sent and stats[f"w{i}"].last_seq != sent[-1][0]:
            return False
    return True


async def test_two_gateway_processes_agree_from_the_same_kv_events(tmp_path: Path) -> None:
    async with run_sim_workers(N, profile="fast", kv_events=True, num_blocks=1024) as fleet:
        # Each worker computes its own prefix before any gateway exists: traffic that bypassed
        # every gateway, which only the workers' events can tell about.
        async with httpx.AsyncClient(timeout=30) as c:
            for i, url in enumerate(fleet):
                r = await c.post(
                    url + "/v1/completions",
                    json={"model": MODEL, "prompt": _prompt(i), "max_tokens": 1},
                )
                assert r.status_code == 200

        port = free_ports(1)
        cfg = tmp_path / "kvgate.toml"
        cfg.write_text(_config(fleet, port))
        other = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(cfg),
            start_new_session=True,
        )
        try:
            async with run_gateway(load_settings(cfg)) as here:
                there = f"http://127.0.0.1:{port}"
                await _trusted(here.url, N)
                await _trusted(there, N)
                choices: dict[str, list[str]] = {here.url: [], there: []}
                async with httpx.AsyncClient(timeout=30) as c:
                    for i in range(N):
                        body = {
                            "model": MODEL,
                            "prompt": _prompt(i) + [5] * 20,
                            "max_tokens": 1,
                        }
                        for url in (there, here.url):
                            r = await c.post(url + "/v1/completions", json=body)
                            assert r.status_code == 200, r.text
                            route = r.headers["x-kvgate-route"]
                            matched = int(route.split("matched_blocks=")[1].split(";")[0])
                            # 16 from the worker's own events (17 once the other gateway's
                            # request stored the suffix's full block too)
                            assert matched >= PROMPT_BLOCKS, route
                            choices[url].append(r.headers["x-kvgate-worker"])
                want = [f"w{i}" for i in range(N)]
                assert choices[here.url] == want
                assert choices[there] == want
                m = await here.metrics()
                for i in range(N):
                    assert m[f'kvgate_precise_index_blocks{{worker="w{i}"}}'] >= PROMPT_BLOCKS
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(other.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(other.wait(), 10)
            except TimeoutError:
                os.killpg(other.pid, signal.SIGKILL)
                await other.wait()


async def test_a_worker_reset_is_seen_through_its_events() -> None:
    """AllBlocksCleared (vLLM's reset_prefix_cache) empties the worker's precise entries, so the
    gateway stops sending that prefix there for a cache it no longer has."""
    async with run_sim_workers(2, profile="fast", kv_events=True, num_blocks=1024) as fleet:
        workers = [
            {
                "name": f"w{i}",
                "url": u,
                "kv_events": fleet.kv_endpoints[i],
                "kv_events_replay": fleet.kv_replay_endpoints[i],
            }
            for i, u in enumerate(fleet)
        ]
        settings = settings_for(list(fleet), routing={"policy": "kv_aware"}, workers=workers)
        async with run_gateway(settings) as g:
            await _trusted(g.url, 2)
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(
                    g.url + "/v1/completions",
                    json={"model": MODEL, "prompt": _prompt(7), "max_tokens": 1},
                )
                owner = r.headers["x-kvgate-worker"]
                idx = g.gw.precise
                deadline = time.monotonic() + 10
                while idx.size(owner) < PROMPT_BLOCKS:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                sim = fleet.workers[int(owner[1:])]
                assert sim.reset_prefix_cache()
                while idx.size(owner) != 0:
                    assert time.monotonic() < deadline, idx.size(owner)
                    await asyncio.sleep(0.05)
            m = await g.metrics()
            assert m[f'kvgate_kv_event_resets_total{{reason="cleared",worker="{owner}"}}'] >= 1


async def test_chat_in_token_mode_predicts_the_cached_tokens_the_worker_reports() -> None:
    """Chat text keyed with the simulators' own tokenizer (token mode "sim"): the precise
    prediction for a follow-up request matches the worker's cached_tokens within one block."""
    async with run_sim_workers(2, profile="fast", kv_events=True, num_blocks=1024) as fleet:
        workers = [
            {
                "name": f"w{i}",
                "url": u,
                "kv_events": fleet.kv_endpoints[i],
                "kv_events_replay": fleet.kv_replay_endpoints[i],
            }
            for i, u in enumerate(fleet)
        ]
        settings = settings_for(
            list(fleet),
            routing={"policy": "kv_aware", "token_mode": {"models": {MODEL: "sim"}}},
            workers=workers,
        )
        system = {"role": "system", "content": "You are a helpful assistant. " * 60}
        async with run_gateway(settings) as g, httpx.AsyncClient(timeout=30) as c:
            await _trusted(g.url, 2)
            for i in range(4):
                body = {
                    "model": MODEL,
                    "messages": [system, {"role": "user", "content": f"question {i}?"}],
                    "max_tokens": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                r = await c.post(g.url + "/v1/chat/completions", json=body)
                assert r.status_code == 200
                # This prompt's events land before the next one (polled: a fixed 0.2 s pause
                # was not always enough for the ZMQ hop on a loaded host).
                await until(lambda: _events_in(g, fleet), 10, "the workers' KV events applied")
            m = await g.metrics()
        agree = m.get('kvgate_cached_tokens_predictions_total{outcome="agree",source="precise"}', 0)
        assert agree >= 3, {k: v for k, v in m.items() if "predictions" in k}
