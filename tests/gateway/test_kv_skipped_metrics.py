"""KV events a worker publishes that the precise index cannot use are exported per worker and
reason (`kvgate_kv_events_skipped_total`): without it a worker whose every store is ignored (a
hybrid model's sliding-window group, vLLM 0.11 LoRA blocks known by id only, event types this
gateway does not know) only shows as a cache that never gets warm."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from scoring.precise import PreciseIndex
from tests.gateway.conftest import RunningGateway, run_gateway, settings_for, until
from tests.support.sim_workers import run_sim_workers
from workers.kv_intake import PreciseSink
from workers.kv_wire import FULL_ATTENTION, BlockStored

SKIPPED = "kvgate_kv_events_skipped_total"
REASONS = ("not_full_attention", "lora_id_only", "unknown_model", "unknown_block_size")


def _series(reason: str, worker: str = "w0") -> str:
    return f'{SKIPPED}{{reason="{reason}",worker="{worker}"}}'


def _stored(n: int, **fields: Any) -> dict[str, Any]:
    """A 0.32 BlockStored map as vLLM publishes it; ``fields`` override the defaults."""
    return {
        "type": "BlockStored",
        "block_hashes": [1000 * n + 1, 1000 * n + 2],
        "parent_block_hash": None,
        "token_ids": list(range(100 * n, 100 * n + 32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": FULL_ATTENTION,
    } | fields


def _batch(n: int) -> bytes:
    """One store indexed, and one of each kind skipped: a hybrid model's sliding-window copy,
    a LoRA block named by id only, and an event type the decoder does not know."""
    events = [
        _stored(n, group_idx=1),
        _stored(n, group_idx=0, kv_cache_spec_kind="sliding_window"),
        _stored(n + 1, group_idx=1, lora_id=7),
        {"type": "BlockPinned", "block_hashes": [1]},
    ]
    return msgpack.packb([time.time(), events, 0])


@pytest.fixture
async def publisher() -> AsyncIterator[tuple[str, zmq.asyncio.Socket]]:
    """A PUB socket standing in for one vLLM server's `--kv-events-config` publisher."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    try:
        yield pub.getsockopt_string(zmq.LAST_ENDPOINT), pub
    finally:
        pub.close()
        ctx.term()


async def _publish_until_applied(g: RunningGateway, pub: zmq.asyncio.Socket, n: int) -> float:
    """Publish batches until the gateway has applied ``n`` (a SUB connection drops what is sent
    before it is up), then stop and wait for the count to settle; returns batches applied."""
    key = 'kvgate_kv_event_batches_total{worker="w0"}'
    seq, deadline = 0, time.monotonic() + 30
    while (await g.metrics()).get(key, 0) < n:
        assert time.monotonic() < deadline, "the gateway never applied the published batches"
        await pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), _batch(seq)])
        seq += 1
        await asyncio.sleep(0.05)
    applied = -1.0
    while (now := (await g.metrics())[key]) != applied:
        applied = now
        await asyncio.sleep(0.3)
    return applied


async def test_skipped_kv_events_are_exported_per_worker_and_reason(
    publisher: tuple[str, zmq.asyncio.Socket],
) -> None:
    endpoint, pub = publisher
    async with run_sim_workers(1, profile="fast") as fleet:
        worker = {"name": "w0", "url": fleet[0], "kv_events": endpoint}
        settings = settings_for(list(fleet), routing={"policy": "kv_aware"}, workers=[worker])
        async with run_gateway(settings) as g:
            gw = g.gw
            await until(lambda: gw.kv_fleet.subscribed("w0"), 15, "subscribed to w0", 0.05)
            m = await g.metrics()
            # Every reason is there from the start, at 0: the first skip shows as an increase.
            assert {r: m.get(_series(r)) for r in (*REASONS, "unknown_type")} == {
                r: 0.0 for r in (*REASONS, "unknown_type")
            }

            batches = await _publish_until_applied(g, pub, 3)
            m = await g.metrics()
            skipped = {r: m[_series(r)] for r in (*REASONS, "unknown_type")}
            assert skipped == {
                "not_full_attention": batches,
                "lora_id_only": batches,
                "unknown_model": 0.0,
                "unknown_block_size": 0.0,
                "unknown_type": batches,
            }, (batches, skipped)
            assert m['kvgate_kv_events_total{worker="w0"}'] == 3 * batches  # known types only
            assert m['kvgate_precise_index_blocks{worker="w0"}'] > 0  # the full-attention store

            # The worker stops publishing (its kv_events removed by a reload): its series go,
            # like its other per-worker KV-event series.
            gw.apply(settings_for(list(fleet), routing={"policy": "kv_aware"}))
            await until(lambda: not gw.kv_fleet.subscribed("w0"), 15, "unsubscribed", 0.05)
            m = await g.metrics()
            assert not [k for k in m if k.startswith(SKIPPED)], m
            assert 'kvgate_kv_events_total{worker="w0"}' not in m
            assert not gw.kv_fleet.sink.skips


def test_a_store_that_cannot_be_keyed_is_skipped_with_its_reason() -> None:
    """The two reasons the e2e test cannot provoke from a healthy worker: no served model known,
    and a block size given neither by the event nor by the worker's metrics."""
    model: dict[str, str | None] = {"w0": None, "w1": "m"}
    sink = PreciseSink(PreciseIndex(), model.get, lambda _w: 0, clock=lambda: 1.0)
    ev = BlockStored(
        engine_hashes=(1,),
        parent=None,
        token_ids=tuple(range(4)),
        block_size=0,  # the event does not say, and neither do the worker's metrics
        lora_name=None,
        medium="GPU",
        cache_salt=None,
        group_idx=0,
        kv_cache_spec_kind=FULL_ATTENTION,
    )
    sink.apply("w0", [ev])
    sink.apply("w1", [ev, ev])
    assert sink.skip_counts("w0") == {r: int(r == "unknown_model") for r in REASONS}
    assert sink.skip_counts("w1") == {r: 2 * (r == "unknown_block_size") for r in REASONS}
    assert sink.skipped == {"w0": 1, "w1": 2}
    sink.reset("w0", "gap")
    sink.reset("w1", "gap")
    sink.remove("w1")
    assert sink.skipped == {"w0": 1}
    assert sink.resets == {("w0", "gap"): 1}  # a removed worker's reset series go too


def test_blocks_dropped_past_a_workers_claim_bound_are_exported() -> None:
    from types import SimpleNamespace

    from gateway.metrics import KVEventCollector
    from tests.scoring.test_precise_capacity import _store

    idx = PreciseIndex(max_worker_blocks=500)
    idx.set_live("w0", True)
    _store(idx, 400, 10_000)
    _store(idx, 300, 20_000)
    fleet = SimpleNamespace(
        stats=dict, index=idx, sink=SimpleNamespace(resets={}, skip_counts=lambda _w: {})
    )
    families = {f.name: f for f in KVEventCollector(fleet).collect()}  # type: ignore[arg-type]
    (sample,) = families["kvgate_precise_index_overflow_blocks"].samples
    assert sample.labels == {"worker": "w0"} and sample.value == 200
