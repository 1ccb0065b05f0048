"""Precise routing against real vLLM: the index built from live KV events is what vLLM reported,
and its predictions come true in the workers' own `cached_tokens`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import zmq

from scoring.prefix import chain_hashes_tokens, seed_for
from tests.gateway.conftest import RunningGateway
from tests.integration.conftest import (
    BLOCK_SIZE,
    MODEL,
    VllmFleet,
    gateway_over,
    openai_client,
)
from workers.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

pytestmark = pytest.mark.integration

END = (-1).to_bytes(8, "big", signed=True)


def replay_all(port: int, timeout_ms: int = 10_000) -> list[Any]:
    """Every event the worker still buffers, decoded by kvgate's own decoder, in order."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    events: list[Any] = []
    try:
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError(f"no replay end marker from port {port}")
            frames = sock.recv_multipart()
            if len(frames) >= 3 and frames[2] == END:
                return events
            events += decode_batch(frames[-1])[1]
    finally:
        sock.close(linger=0)
        ctx.term()


def expected_keys(events: list[Any], model: str) -> set[int]:
    """What the worker holds, keyed independently of scoring.precise: replay the events in order."""
    key_of: dict[Any, int] = {}
    held: dict[int, int] = {}  # key -> engine hashes naming it
    for ev in events:
        if isinstance(ev, BlockStored):
            if ev.parent is not None and ev.parent not in key_of:
                continue
            seed = key_of[ev.parent] if ev.parent is not None else seed_for(model, "", "")
            keys = chain_hashes_tokens(
                list(ev.token_ids),
                block_size=ev.block_size,
                seed=seed,
                max_blocks=len(ev.engine_hashes),
            )
            for h, k in zip(ev.engine_hashes, keys, strict=True):
                if h not in key_of:
                    key_of[h] = k
                    held[k] = held.get(k, 0) + 1
        elif isinstance(ev, BlockRemoved):
            for h in ev.engine_hashes:
                k = key_of.pop(h, None)
                if k is not None:
                    held[k] -= 1
                    if not held[k]:
                        del held[k]
        elif isinstance(ev, AllBlocksCleared):
            key_of.clear()
            held.clear()
    return set(held)


@pytest.fixture
async def precise_gateway(fleet: VllmFleet) -> AsyncIterator[RunningGateway]:
    workers = [
        {
            "name": w.name,
            "url": w.url,
            "kv_events": f"tcp://127.0.0.1:{w.config.kv_events_port}",
            "kv_events_replay": f"tcp://127.0.0.1:{w.kv_events_replay_port}",
        }
        for w in fleet.workers
    ]
    async with gateway_over(
        fleet,
        "kv_aware",
        routing={"token_mode": {"models": {MODEL: str(fleet.model_dir)}}},
        server={"debug_headers": True},
        workers=workers,
    ) as g:
        deadline = time.monotonic() + 30
        while g.gw.precise.trusted(time.monotonic()) != {w.name for w in fleet.workers}:
            assert time.monotonic() < deadline, "KV event subscribers never got in sync"
            await asyncio.sleep(0.05)
        yield g


async def _settled(g: RunningGateway, fleet: VllmFleet) -> dict[str, set[int]]:
    """Poll until the gateway's index equals every worker's replayed events (events are async)."""
    deadline = time.monotonic() + 20
    while True:
        want = {
            w.name: expected_keys(
                await asyncio.to_thread(replay_all, w.kv_events_replay_port),
                g.gw.registry.cache_name(MODEL),  # vLLM's `root`: one key for every alias
            )
            for w in fleet.workers
        }
        have = {w.name: g.gw.precise.blocks(w.name) for w in fleet.workers}
        if have == want or time.monotonic() > deadline:
            assert have == want, {n: (len(have[n]), len(want[n])) for n in want}
            return want
        await asyncio.sleep(0.2)


async def test_precise_index_is_what_vllm_reported_and_predicts_cached_tokens(
    fleet: VllmFleet, precise_gateway: RunningGateway
) -> None:
    g = precise_gateway
    nonce = uuid.uuid4().hex[:10]
    shared = f"Run {nonce}. " + " ".join(
        f"Paragraph {s}: the precise index keys what the worker stored." for s in range(24)
    )
    async with openai_client(g.url) as client:
        first = await client.completions.with_raw_response.create(
            model=MODEL, prompt=shared + " First question?", max_tokens=2
        )
        held = await _settled(g, fleet)
        owner = first.headers["x-kvgate-worker"]

        # The prompt's own blocks, keyed by the gateway from its tokenizer, are all there.
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(
                fleet.worker(owner).url + "/tokenize",
                json={"model": MODEL, "prompt": shared + " First question?"},
            )
        ids = r.json()["tokens"]
        prompt_keys = chain_hashes_tokens(
            ids,
            block_size=BLOCK_SIZE,
            seed=seed_for(g.gw.registry.cache_name(MODEL), "", ""),
            max_blocks=10_000,
        )
        assert len(prompt_keys) >= 5
        assert set(prompt_keys) <= held[owner]
        for other, keys in held.items():
            if other != owner:
                assert not set(prompt_keys) & keys

        # A second request with the same prefix goes where the blocks are, and the worker's
        # cached_tokens is what the index predicted, within one block.
        second = await client.completions.with_raw_response.create(
            model=MODEL, prompt=shared + " Second question, a different one?", max_tokens=2
        )
    assert second.headers["x-kvgate-worker"] == owner
    route = dict(kv.split("=", 1) for kv in second.headers["x-kvgate-route"].split(";"))
    predicted = int(route["matched_blocks"]) * BLOCK_SIZE
    usage = second.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    actual = usage.prompt_tokens_details.cached_tokens or 0
    print(f"precise: predicted {predicted} cached tokens, worker reported {actual}")
    assert predicted >= 4 * BLOCK_SIZE
    assert abs(predicted - actual) <= BLOCK_SIZE, (predicted, actual)
    m = await g.metrics()
    assert m.get('kvgate_cached_tokens_predictions_total{outcome="agree",source="precise"}', 0) >= 1
