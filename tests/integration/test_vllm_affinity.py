"""Prefix-cache affinity, measured on real vLLM: which worker holds a prompt's blocks, and does
kvgate's choice of worker show up in that worker's own cache counters and KV events?"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.affinity import assert_cache_follows_routing, run_shared_prefix
from tests.integration.conftest import BLOCK_SIZE, MODEL, VllmFleet

pytestmark = pytest.mark.integration

KV_REPLAY = Path(__file__).with_name("kv_replay.py")


async def test_kv_aware_keeps_a_shared_prefix_on_the_worker_that_holds_it(
    fleet: VllmFleet,
) -> None:
    """The point of kvgate: one cold prefill for the whole run, every later request hits."""
    run = await run_shared_prefix(fleet, policy="kv_aware", n_requests=4)
    run.save()
    assert_cache_follows_routing(run)
    assert len(run.workers_used) == 1, run
    assert run.misses == 1


async def test_shared_prefix_hits_the_cache_of_the_worker_kvgate_chose(fleet: VllmFleet) -> None:
    """Round-robin baseline: the shared prefix is prefilled once per worker, then hits."""
    run = await run_shared_prefix(fleet, policy="round_robin", n_requests=4)
    run.save()
    assert_cache_follows_routing(run)
    workers = [r.worker for r in run.requests]
    assert workers[0] != workers[1] and workers[:2] == workers[2:], workers  # alternates
    assert run.misses == 2  # one cold prefill per worker: what cache-blind routing costs
    assert all(run.hits[w] > 0 for w in run.workers_used)


async def _replay(fleet: VllmFleet, worker: str) -> list[dict[str, object]]:
    port = fleet.worker(worker).kv_events_replay_port
    proc = await asyncio.to_thread(
        subprocess.run,
        [str(fleet.python), str(KV_REPLAY), str(port)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"kv_replay.py failed:\n{proc.stderr[-3000:]}"
    events: list[dict[str, object]] = json.loads(proc.stdout)
    return events


def _stored_blocks(events: list[dict[str, object]]) -> set[tuple[int, ...]]:
    """Token ids of every block a worker announced with `BlockStored`."""
    blocks = set()
    for ev in events:
        if ev.get("type") != "BlockStored":
            continue
        tokens = list(ev["token_ids"])  # type: ignore[call-overload]
        size = int(ev["block_size"])  # type: ignore[call-overload]
        assert size == BLOCK_SIZE
        for i in range(len(ev["block_hashes"])):  # type: ignore[arg-type]
            blocks.add(tuple(tokens[i * size : (i + 1) * size]))
    return blocks


async def test_kv_events_announce_the_prompt_blocks_on_the_chosen_worker_only(
    client: openai.AsyncOpenAI, fleet: VllmFleet
) -> None:
    """The bound `tcp://*:PORT` publisher + replay endpoint (the flags compose uses) work, and
    the events name exactly the worker the gateway routed to: the precise index's input."""
    prompt = f"Run {uuid.uuid4().hex}. " + " ".join(
        f"Section {s}: blocks are announced by the worker that stored them." for s in range(12)
    )
    async with client.completions.with_streaming_response.create(
        model=MODEL, prompt=prompt, max_tokens=1
    ) as resp:
        worker = resp.headers["x-kvgate-worker"]
        await resp.parse()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            fleet.worker(worker).url + "/tokenize", json={"model": MODEL, "prompt": prompt}
        )
    tokens = r.json()["tokens"]
    full = len(tokens) // BLOCK_SIZE
    assert full >= 5, len(tokens)
    want = {tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]) for i in range(full)}

    assert want <= _stored_blocks(await _replay(fleet, worker))
    for other in fleet.workers:
        if other.name != worker:
            assert not want & _stored_blocks(await _replay(fleet, other.name))
