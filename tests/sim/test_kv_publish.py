"""The simulator's KV events, checked on the wire against what vLLM 0.32 publishes.

A gateway that learns block placement from KV events must see the same messages from a simulated
fleet as from real vLLM, so these tests subscribe over real ZMQ sockets (SUB and a DEALER for
replay) and compare field names and layout with the recorded fixture
(`tests/fixtures/vllm-0.32/kv_events.*`). All sockets are on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from bench.peers import free_ports
from tests.support.sim_workers import SimFleet, run_sim_workers
from workers.sim.cli import _configure, build_configs
from workers.sim.engine import Engine
from workers.sim.engine_types import EngineConfig, KVEvent, SimRequest
from workers.sim.kv_publisher import END_SEQ, encode_batch
from workers.sim.profiles import get_profile

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32"
BS = 16
# A SUB socket misses what is published before its subscription reaches the PUB: `subscribe`
# waits for the connection's handshake (however long a loaded host takes), then this margin for
# the subscription that follows it.
SETTLE_S = 0.3
WAIT_S = 10.0


def _fixture_events() -> list[dict[str, Any]]:
    decoded = json.loads((FIXTURES / "kv_events.decoded.json").read_text())
    return [e for m in decoded if m["channel"] == "pub" for e in m["payload"][1]]


STORED_KEYS = list(_fixture_events()[0])  # field order as vLLM 0.32's msgspec encodes it


@dataclass
class Batch:
    topic: bytes
    seq: int
    ts: float
    events: list[Any]
    rank: int
    payload: bytes


def _batch(frames: list[bytes]) -> Batch:
    assert len(frames) == 3, frames
    topic, seq, payload = frames
    assert len(seq) == 8
    decoded = msgpack.unpackb(payload)
    assert isinstance(decoded, list) and len(decoded) == 3
    ts, events, rank = decoded
    return Batch(topic, int.from_bytes(seq, "big", signed=True), ts, events, rank, payload)


class Subscriber:
    """A SUB socket that accumulates decoded batches."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Before connecting, so the handshake cannot be missed (the gateway's subscriber does
        # the same to know when it is connected).
        self._mon: zmq.asyncio.Socket | None = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[Batch] = []

    async def connected(self, timeout: float = WAIT_S) -> None:
        """Until the connection to the publisher is up (its handshake done)."""
        mon = self._mon
        assert mon is not None
        try:
            while True:
                msg = await asyncio.wait_for(mon.recv_multipart(), timeout)
                if parse_monitor_message(msg)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return
        finally:
            self._mon = None
            self.sock.disable_monitor()
            mon.close(linger=0)

    async def wait_for(self, pred: Callable[[list[Batch]], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not pred(self.batches):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"condition not met; got {len(self.batches)} batches")
            try:
                frames = await asyncio.wait_for(self.sock.recv_multipart(), left)
            except TimeoutError:
                continue
            self.batches.append(_batch(frames))

    async def quiet(self, for_s: float = 0.2) -> None:
        """Drain whatever is still in flight."""
        while True:
            try:
                frames = await asyncio.wait_for(self.sock.recv_multipart(), for_s)
            except TimeoutError:
                return
            self.batches.append(_batch(frames))

    def events(self, kind: str) -> list[Any]:
        return [e for b in self.batches for e in b.events if _kind(e) == kind]

    def close(self) -> None:
        if self._mon is not None:
            self._mon.close(linger=0)
            self._mon = None
        self.sock.close(linger=0)


def _kind(e: Any) -> str:
    return e["type"] if isinstance(e, dict) else e[0]


async def subscribe(endpoint: str) -> Subscriber:
    sub = Subscriber(endpoint)
    try:
        await sub.connected()
    except BaseException:
        sub.close()
        raise
    await asyncio.sleep(SETTLE_S)
    return sub


async def replay(endpoint: str, start: int) -> tuple[list[list[bytes]], list[bytes]]:
    """Ask the replay socket for batches from `start`: (batch frames, end marker frames)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out: list[list[bytes]] = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), WAIT_S)
            if frames[2] == END_SEQ:
                return out, frames
            out.append(frames)
    finally:
        sock.close(linger=0)


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with run_sim_workers(
        1, profile="fast", num_blocks=256, block_size=BS, kv_events=True
    ) as f:
        yield f


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as c:
        yield c


@pytest.fixture
async def sub(fleet: SimFleet) -> AsyncIterator[Subscriber]:
    s = await subscribe(fleet.kv_endpoints[0])
    yield s
    s.close()


def ids(n: int, base: int = 100) -> list[int]:
    return [base + i for i in range(n)]


async def complete(
    client: httpx.AsyncClient, url: str, prompt: list[int] | str, max_tokens: int = 1, **extra: Any
) -> dict[str, Any]:
    r = await client.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()


def stored_hashes(batches: list[Batch]) -> list[int]:
    return [
        h for b in batches for e in b.events if _kind(e) == "BlockStored" for h in e["block_hashes"]
    ]


# ---- the encoder, byte for byte --------------------------------------------------------------


def test_encoder_reproduces_the_recorded_vllm_payloads() -> None:
    """Same events in, the very bytes real vLLM 0.32 sent out (msgpack widths, key order)."""
    n = 0
    for line in (FIXTURES / "kv_events.bin").read_text().splitlines():
        msg = json.loads(line)
        if msg["channel"] != "pub":
            continue
        payload = base64.b64decode(msg["frames"][2])
        ts, wire, rank = msgpack.unpackb(payload)
        events = [
            KVEvent(
                "BlockStored",
                e["block_hashes"],
                e["parent_block_hash"],
                e["token_ids"],
                e["block_size"],
                [tuple(k) if k is not None else None for k in e["extra_keys"]],
            )
            for e in wire
        ]
        assert encode_batch(ts, events, "0.32", rank) == payload
        n += 1
    assert n >= 5


def test_engine_events_carry_block_size_and_salt() -> None:
    engine = Engine(
        EngineConfig(num_blocks=64, block_size=4, enable_kv_events=True), get_profile("fast")
    )
    engine.add_request(SimRequest("a", ids(10), 1, cache_salt="tenant-b"), 0.0)
    engine.add_request(SimRequest("b", ids(9), 1), 0.0)
    engine.step(0.0)
    salted, plain = engine.take_kv_events()
    assert salted.block_size == plain.block_size == 4
    assert salted.extra_keys == [("tenant-b",), None]
    assert plain.extra_keys == [None, None]
    assert salted.block_hashes[0] != plain.block_hashes[0], "a salt isolates the chain"
    assert salted.lora_name is None


# ---- over the wire ---------------------------------------------------------------------------


async def test_block_stored_has_vllm_032_fields_and_chains(
    fleet: SimFleet, sub: Subscriber, client: httpx.AsyncClient
) -> None:
    url = fleet[0]
    prompt = ids(5 * BS)
    await complete(client, url, prompt, max_tokens=BS + 2)  # fills one decode block too
    await sub.wait_for(lambda bs: len(stored_hashes(bs)) >= 6)
    first = sub.batches[0]
    assert first.topic == b"kv" and first.seq == 0 and first.rank == 0
    assert isinstance(first.ts, float) and abs(first.ts - time.time()) < 60
    assert [b.seq for b in sub.batches] == list(range(len(sub.batches)))

    events = sub.events("BlockStored")
    for e in events:
        assert list(e) == STORED_KEYS
        assert len(e["token_ids"]) == len(e["block_hashes"]) * e["block_size"]
        assert e["block_size"] == BS
        assert e["lora_id"] is None and e["lora_name"] is None
        assert e["medium"] == "GPU" and e["group_idx"] == 0
        assert e["kv_cache_spec_kind"] == "full_attention"
        assert e["extra_keys"] == [None] * len(e["block_hashes"])
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in e["block_hashes"])
    prompt_blocks, decode_block = events[0], events[1]
    assert prompt_blocks["parent_block_hash"] is None
    assert prompt_blocks["token_ids"] == prompt
    assert prompt_blocks["block_hashes"] == fleet.workers[0].engine.prompt_block_hashes(prompt)
    assert decode_block["parent_block_hash"] == prompt_blocks["block_hashes"][-1]
    assert len(decode_block["block_hashes"]) == 1

    # A longer prompt sharing the prefix stores only its new blocks, chained onto the cached ones.
    await complete(client, url, prompt + ids(2 * BS, base=5000))
    await sub.wait_for(lambda bs: len(sub.events("BlockStored")) >= 3)
    extension = sub.events("BlockStored")[2]
    seen = set(prompt_blocks["block_hashes"] + decode_block["block_hashes"])
    assert extension["parent_block_hash"] in seen
    assert extension["parent_block_hash"] == prompt_blocks["block_hashes"][-1]
    assert extension["token_ids"] == ids(2 * BS, base=5000)
    assert not seen & set(extension["block_hashes"])


async def test_salted_chat_carries_its_salt_on_the_first_block(
    fleet: SimFleet, sub: Subscriber, client: httpx.AsyncClient
) -> None:
    body = {
        "messages": [{"role": "user", "content": "tell me about paged attention " * 12}],
        "max_tokens": 1,
    }
    for salt in (None, "tenant-b"):
        extra = {"cache_salt": salt} if salt else {}
        r = await client.post(f"{fleet[0]}/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
    await sub.wait_for(lambda _: len(sub.events("BlockStored")) >= 2)
    plain, salted = sub.events("BlockStored")[:2]
    assert plain["token_ids"] == salted["token_ids"]
    assert not set(plain["block_hashes"]) & set(salted["block_hashes"])
    assert plain["extra_keys"] == [None] * len(plain["block_hashes"])
    assert salted["extra_keys"] == [["tenant-b"]] + [None] * (len(salted["block_hashes"]) - 1)
    assert salted["parent_block_hash"] is None


async def test_eviction_publishes_block_removed(client: httpx.AsyncClient) -> None:
    async with run_sim_workers(1, profile="fast", num_blocks=8, block_size=BS, kv_events=True) as f:
        sub = await subscribe(f.kv_endpoints[0])
        try:
            for i in range(4):  # 4 prompt blocks + 1 for the output each: the cache must turn over
                await complete(client, f[0], ids(4 * BS, base=1000 * (i + 1)), max_tokens=2)
            await sub.wait_for(lambda _: len(sub.events("BlockRemoved")) >= 2)
            await sub.quiet()
        finally:
            sub.close()
    stored = set(stored_hashes(sub.batches))
    for e in sub.events("BlockRemoved"):
        assert list(e) == ["type", "block_hashes", "medium", "group_idx"]
        assert e["medium"] == "GPU" and e["group_idx"] == 0
        assert len(e["block_hashes"]) == 1, "vLLM sends one BlockRemoved per evicted block"
        assert e["block_hashes"][0] in stored


async def test_replay_returns_buffered_batches_and_ends_with_minus_one(
    fleet: SimFleet, sub: Subscriber, client: httpx.AsyncClient
) -> None:
    for i in range(3):
        await complete(client, fleet[0], ids(2 * BS, base=1000 * (i + 1)))
    await sub.wait_for(lambda bs: len(bs) >= 3)
    await sub.quiet()
    endpoint = fleet.kv_replay_endpoints[0]

    everything, end = await replay(endpoint, 0)
    assert end == [b"", b"", END_SEQ, b""]
    assert [len(f) for f in everything] == [4] * len(everything)
    assert all(f[0] == b"" and f[1] == b"kv" for f in everything)
    assert [(_batch(f[1:]).seq, f[3]) for f in everything] == [
        (b.seq, b.payload) for b in sub.batches
    ], "replay returns exactly what was published"

    later, end = await replay(endpoint, 2)
    assert [_batch(f[1:]).seq for f in later] == list(range(2, len(sub.batches)))
    assert end[2] == END_SEQ
    nothing, end = await replay(endpoint, 10_000)
    assert nothing == [] and end[2] == END_SEQ


async def test_reset_publishes_all_blocks_cleared(
    fleet: SimFleet, sub: Subscriber, client: httpx.AsyncClient
) -> None:
    url = fleet[0]
    await complete(client, url, ids(3 * BS))
    r = await client.post(f"{url}/sim/reset")
    assert r.status_code == 200 and r.json()["error_rate"] == 0
    await sub.wait_for(lambda _: bool(sub.events("AllBlocksCleared")))
    assert sub.batches[-1].events == [{"type": "AllBlocksCleared"}]
    assert fleet.workers[0].engine.cached_block_hashes() == set()
    # vLLM's own endpoint does the same and says whether it could.
    await complete(client, url, ids(3 * BS))
    r = await client.post(f"{url}/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True}
    await sub.wait_for(lambda _: len(sub.events("AllBlocksCleared")) == 2)


async def test_011_layout_uses_positional_arrays(client: httpx.AsyncClient) -> None:
    async with run_sim_workers(
        1, profile="fast", num_blocks=8, block_size=BS, kv_events=True, kv_events_layout="0.11"
    ) as f:
        sub = await subscribe(f.kv_endpoints[0])
        try:
            for i in range(3):
                await complete(client, f[0], ids(4 * BS, base=1000 * (i + 1)), max_tokens=2)
            await client.post(f"{f[0]}/sim/reset")
            await sub.wait_for(lambda _: bool(sub.events("AllBlocksCleared")))
        finally:
            sub.close()
    stored = sub.events("BlockStored")
    assert stored
    for e in stored:
        assert isinstance(e, list) and len(e) == 7
        _, hashes, parent, tokens, block_size, lora_id, medium = e
        assert block_size == BS and lora_id is None and medium == "GPU"
        assert len(tokens) == len(hashes) * BS
        assert parent is None or isinstance(parent, int)
    removed = sub.events("BlockRemoved")
    assert removed and all(e == ["BlockRemoved", e[1], "GPU"] and len(e[1]) == 1 for e in removed)
    assert sub.events("AllBlocksCleared") == [["AllBlocksCleared"]]
    assert all(b.rank == 0 for b in sub.batches)


async def test_stored_minus_removed_is_the_engines_cache(client: httpx.AsyncClient) -> None:
    """Replaying a worker's events rebuilds exactly its set of reusable blocks."""
    rng = random.Random(7)
    shared = [
        ids(rng.randint(1, 4) * BS + rng.randint(0, BS - 1), base=10_000 * (i + 1))
        for i in range(4)
    ]
    async with run_sim_workers(
        2, profile="fast", num_blocks=24, block_size=BS, kv_events=True
    ) as f:

        async def one(i: int) -> None:
            prefix = rng.choice(shared)
            suffix = ids(rng.randint(0, 2 * BS), base=500_000 + 1000 * i)
            salt = rng.choice([None, None, "t1", "t2"])
            extra = {"cache_salt": salt} if salt else {}
            await complete(client, f[i % 2], prefix + suffix, rng.randint(1, BS + 3), **extra)

        await asyncio.gather(*(one(i) for i in range(16)))
        await client.post(f"{f[0]}/sim/reset")
        await asyncio.gather(*(one(i) for i in range(16, 40)))

        for worker, endpoint in zip(f.workers, f.kv_replay_endpoints, strict=True):
            frames, _ = await replay(endpoint, 0)
            batches = [_batch(fr[1:]) for fr in frames]
            assert [b.seq for b in batches] == list(range(len(batches)))
            cached: set[int] = set()
            kinds: set[str] = set()
            for b in batches:
                for e in b.events:
                    kinds.add(e["type"])
                    if e["type"] == "BlockStored":
                        assert not cached & set(e["block_hashes"]), "stored twice without removal"
                        cached |= set(e["block_hashes"])
                    elif e["type"] == "BlockRemoved":
                        assert set(e["block_hashes"]) <= cached, "removed a block never stored"
                        cached -= set(e["block_hashes"])
                    else:
                        cached.clear()
            assert cached == worker.engine.cached_block_hashes()
            assert {"BlockStored", "BlockRemoved"} <= kinds
            worker.engine.check_consistency()


# ---- the CLI ---------------------------------------------------------------------------------


def _parse(*argv: str) -> Any:
    import argparse

    p = argparse.ArgumentParser()
    _configure(p)
    return p.parse_args(list(argv))


def test_cli_kv_event_ports_are_two_per_worker() -> None:
    cfgs = build_configs(
        _parse("--workers", "3", "--kv-events-port", "6000", "--kv-events-layout", "0.11")
    )
    assert [(c.kv_events_port, c.kv_replay_port) for c in cfgs] == [
        (6000, 6001),
        (6002, 6003),
        (6004, 6005),
    ]
    assert all(c.kv_events and c.engine.enable_kv_events for c in cfgs)
    assert {(c.kv_events_layout, c.kv_events_topic, c.kv_events_host) for c in cfgs} == {
        ("0.11", "kv", "127.0.0.1")
    }
    off = build_configs(_parse("--workers", "2"))
    assert not any(c.kv_events or c.engine.enable_kv_events for c in off)
    with pytest.raises(SystemExit):
        _parse("--kv-events-layout", "0.5")
    with pytest.raises(ValueError, match="no room"):
        build_configs(_parse("--workers", "2", "--kv-events-port", "65534"))
    with pytest.raises(ValueError, match="overlaps"):
        build_configs(_parse("--port", "7000", "--workers", "2", "--kv-events-port", "6999"))
    build_configs(_parse("--port", "7000", "--workers", "2", "--kv-events-port", "6996"))


def _popen_cli(base: int) -> subprocess.Popen[bytes]:
    """HTTP on `base`, KV events on base+1 and replay on base+2."""
    args = ["--port", str(base), "--profile", "fast", "--kv-events-port", str(base + 1)]
    return subprocess.Popen(
        [sys.executable, "-m", "workers.sim.cli", *args, "--block-size", str(BS)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def _start_cli(client: httpx.AsyncClient, base: int) -> tuple[subprocess.Popen[bytes], str]:
    proc = _popen_cli(base)
    url = f"http://127.0.0.1:{base}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if (await client.get(f"{url}/health")).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.05)
    _stop(proc)
    raise AssertionError((proc.stdout.read() if proc.stdout else b"").decode(errors="replace"))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def test_cli_publishes_and_a_restart_starts_again_at_seq_0(client: httpx.AsyncClient) -> None:
    base = free_ports(3)
    for attempt in range(2):  # the crashed process is started again on the very same ports
        proc, url = await _start_cli(client, base)
        try:
            assert proc.stdout is not None
            line = (await asyncio.to_thread(proc.stdout.readline)).decode()
            assert f"kv_events=tcp://127.0.0.1:{base + 1}" in line, line
            assert f"replay=tcp://127.0.0.1:{base + 2}" in line and "layout=0.32" in line, line
            sub = await subscribe(f"tcp://127.0.0.1:{base + 1}")
            try:
                await complete(client, url, ids(2 * BS, base=1000 * (attempt + 1)))
                await sub.wait_for(lambda bs: len(bs) >= 1)
            finally:
                sub.close()
            assert sub.batches[0].seq == 0
            with pytest.raises(httpx.TransportError):
                await client.post(f"{url}/sim/faults", json={"crash": True})
            assert await asyncio.to_thread(proc.wait, 30) != 0
        finally:
            _stop(proc)
            if proc.stdout is not None:
                proc.stdout.close()
