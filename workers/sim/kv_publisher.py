"""KV-cache events from a simulated worker, on the wire exactly as vLLM's ZMQ publisher sends them.

The simulator stands in for vLLM, so it speaks vLLM's format on its own (msgpack, no shared
decoder): a gateway that subscribes to a simulated fleet must see what it would see from real
servers. The reference is `vllm/distributed/kv_events.py` (0.32) and the recorded
`tests/fixtures/vllm-0.32/kv_events.bin`; the encoder reproduces those payloads byte for byte.

- PUB socket, one multipart message per engine step that produced events:
  `[topic, seq (8-byte big-endian), msgpack([ts, [event, ...], dp_rank])]`, seq from 0 per start.
- ROUTER replay socket: a DEALER sends `[b"", start_seq (8 bytes)]` and gets
  `[b"", topic, seq, payload]` for every buffered batch with seq >= start_seq, then
  `[b"", b"", seq -1, b""]`.

Events are maps tagged by "type" in the 0.32 layout and positional arrays in the 0.11 one.
Like vLLM, every evicted block gets its own BlockRemoved.

Publishing runs on the worker's event loop and never waits: the PUB send is non-blocking and,
like any PUB socket, drops messages for a subscriber past its high-water mark (the replay buffer
is how a consumer recovers them). Replay is served by a task of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

from workers import kv_wire
from workers.sim.engine_types import KVEvent

__all__ = [
    "LAYOUTS",
    "KVEventPublisher",
    "encode_batch",
    "encode_event",
    "zmq_endpoint",
]

Layout = Literal["0.32", "0.11"]
LAYOUTS: tuple[str, ...] = ("0.32", "0.11")
MEDIUM_GPU = "GPU"
# Every simulated block lives in one full-attention KV cache group, as with a plain decoder model.
_GROUP_IDX = 0
_SPEC_KIND = "full_attention"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REPLAY_SEND_TIMEOUT_MS = 5000  # a replay client that stops reading is dropped after this
_REPLAY_YIELD_EVERY = 64  # batches sent between yields, so a long replay never stalls the loop

_log = logging.getLogger(__name__)


def _stored_032(e: KVEvent) -> dict[str, Any]:
    # Key order is vLLM's struct field order (msgspec encodes in declaration order); fields whose
    # value is their default (None) are omitted there, so they are left out here too.
    return {
        "type": "BlockStored",
        "block_hashes": e.block_hashes,
        "parent_block_hash": e.parent_block_hash,
        "token_ids": e.token_ids,
        "block_size": e.block_size,
        "lora_id": None,
        "medium": MEDIUM_GPU,
        "lora_name": e.lora_name,
        "extra_keys": e.extra_keys if e.extra_keys is not None else [None] * len(e.block_hashes),
        "group_idx": _GROUP_IDX,
        "kv_cache_spec_kind": _SPEC_KIND,
    }


def encode_event(e: KVEvent, layout: Layout = "0.32") -> list[Any]:
    """One engine event as the wire event(s) vLLM would publish for it.

    A list because the engine reports an eviction in bulk where vLLM sends one BlockRemoved per
    block hash.
    """
    kind = e.kind
    if layout == "0.32":
        if kind == "BlockStored":
            return [_stored_032(e)]
        if kind == "BlockRemoved":
            return [
                {
                    "type": "BlockRemoved",
                    "block_hashes": [h],
                    "medium": MEDIUM_GPU,
                    "group_idx": _GROUP_IDX,
                }
                for h in e.block_hashes
            ]
        if kind == "AllBlocksCleared":
            return [{"type": "AllBlocksCleared"}]
    elif layout == "0.11":
        if kind == "BlockStored":
            return [
                [
                    "BlockStored",
                    e.block_hashes,
                    e.parent_block_hash,
                    e.token_ids,
                    e.block_size,
                    None,
                    MEDIUM_GPU,
                ]
            ]
        if kind == "BlockRemoved":
            return [["BlockRemoved", [h], MEDIUM_GPU] for h in e.block_hashes]
        if kind == "AllBlocksCleared":
            return [["AllBlocksCleared"]]
    else:
        raise ValueError(f"unknown KV event layout {layout!r}; expected one of {LAYOUTS}")
    raise ValueError(f"unknown KV event kind {kind!r}")


def wire_events(events: Iterable[KVEvent]) -> list[kv_wire.KVEvent]:
    """The engine's events as the gateway's decoder hands them to its intake
    (`workers.kv_intake.PreciseSink`), without the msgpack round trip, for in-process consumers
    (bench.simulate): a stored event goes through the decoder's own field conversion
    (`kv_wire.stored_event`: validation, the salt lifted from the extra keys); an eviction stays
    one event where vLLM sends one per block, which the intake applies alike."""
    out: list[kv_wire.KVEvent] = []
    for e in events:
        if e.kind == "BlockStored":
            d = _stored_032(e)
            out.append(
                kv_wire.stored_event(
                    d["block_hashes"],
                    d["parent_block_hash"],
                    d["token_ids"],
                    d["block_size"],
                    d["lora_id"],
                    d["medium"],
                    d["lora_name"],
                    d["extra_keys"],
                    d["group_idx"],
                    d["kv_cache_spec_kind"],
                )
            )
        elif e.kind == "BlockRemoved":
            out.append(kv_wire.BlockRemoved(tuple(e.block_hashes), MEDIUM_GPU, _GROUP_IDX))
        elif e.kind == "AllBlocksCleared":
            out.append(kv_wire.AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event kind {e.kind!r}")
    return out


def encode_batch(
    ts: float, events: Iterable[KVEvent], layout: Layout = "0.32", rank: int = 0
) -> bytes:
    """The msgpack payload of one batch: `[ts, [event, ...], data_parallel_rank]`."""
    wire: list[Any] = []
    for e in events:
        wire += encode_event(e, layout)
    return msgpack.packb([float(ts), wire, rank])


def zmq_endpoint(host: str, port: int) -> str:
    """`tcp://host:port`; port 0 asks for any free port (ZMQ spells that `*`)."""
    h = f"[{host}]" if ":" in host else host
    return f"tcp://{h}:{port if port else '*'}"


class KVEventPublisher:
    """One worker's PUB socket, replay buffer and ROUTER replay socket.

    Sockets are bound in `__init__` so that a taken port fails the worker's creation (and with
    it the whole start) instead of surfacing later inside a running server.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int | None = 0,
        *,
        topic: str = "kv",
        layout: Layout = "0.32",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        rank: int = 0,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV event layout {layout!r}; expected one of {LAYOUTS}")
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be at least 1")
        self.topic = topic
        self.layout: Layout = layout
        self.rank = rank
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0  # batches the PUB socket refused (only possible past its HWM)
        ctx = zmq.asyncio.Context.instance()
        ipv6 = ":" in host
        self._pub: zmq.asyncio.Socket = ctx.socket(zmq.PUB)
        self._router: zmq.asyncio.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.IPV6, int(ipv6))
            self.endpoint = self._bind(self._pub, zmq_endpoint(host, port))
            self.replay_endpoint: str | None = None
            if replay_port is not None:
                router = ctx.socket(zmq.ROUTER)
                self._router = router
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.IPV6, int(ipv6))
                # Report an unreachable peer instead of silently dropping its replay, and hold a
                # whole buffer's worth for one slow reader before a send has to wait.
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                router.setsockopt(zmq.SNDHWM, buffer_steps + 2)
                router.setsockopt(zmq.SNDTIMEO, _REPLAY_SEND_TIMEOUT_MS)
                self.replay_endpoint = self._bind(router, zmq_endpoint(host, replay_port))
        except BaseException:
            self._close_sockets()
            raise
        self._replay_task: asyncio.Task[None] | None = None

    @staticmethod
    def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise OSError(e.errno, f"cannot bind {endpoint}: {e.strerror}") from e
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        """Start answering replay requests (needs the running loop the worker serves on)."""
        if self._router is not None and (self._replay_task is None or self._replay_task.done()):
            self._replay_task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name="sim-kv-replay"
            )

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch now (never waits) and keep it for replay; returns its sequence number."""
        seq = self._next_seq
        self._next_seq = seq + 1
        payload = encode_batch(time.time() if ts is None else ts, events, self.layout, self.rank)
        self._buffer.append((seq, payload))
        fut = self._pub.send_multipart(
            (self._topic, seq.to_bytes(8, "big", signed=True), payload), flags=zmq.NOBLOCK
        )
        # With NOBLOCK the send is attempted at once and the future is already resolved; read its
        # outcome so a refusal is counted rather than logged as an unretrieved exception.
        if fut.done():
            self._check_sent(fut)
        else:
            fut.add_done_callback(self._check_sent)
        return seq

    def _check_sent(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            return
        self.num_dropped += 1
        if not isinstance(exc, zmq.Again):
            _log.warning("KV event publish failed on %s: %s", self.endpoint, exc)

    def buffered(self, start_seq: int = 0) -> list[tuple[int, bytes]]:
        """Buffered (seq, payload) pairs with seq >= start_seq, oldest first."""
        buf = self._buffer
        if not buf or buf[0][0] >= start_seq:
            return list(buf)
        # Sequence numbers are consecutive, so the first wanted batch sits at a known index.
        return list(itertools.islice(buf, start_seq - buf[0][0], None))

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:  # vLLM ignores anything but [identity, b"", start_seq]
                _log.warning("invalid KV replay request with %d frames", len(frames))
                continue
            ident, _, start = frames
            try:
                await self._replay(router, ident, int.from_bytes(start, "big", signed=True))
            except (zmq.ZMQError, OSError) as e:  # the client left or stopped reading
                _log.info("KV replay to a client on %s abandoned: %s", self.replay_endpoint, e)

    async def _replay(self, router: zmq.asyncio.Socket, ident: bytes, start_seq: int) -> None:
        topic = self._topic
        for i, (seq, payload) in enumerate(self.buffered(start_seq), 1):
            await router.send_multipart(
                (ident, b"", topic, seq.to_bytes(8, "big", signed=True), payload)
            )
            if i % _REPLAY_YIELD_EVERY == 0:
                await asyncio.sleep(0)  # an already-resolved send never yields by itself
        await router.send_multipart((ident, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._close_sockets()

    def close_now(self) -> None:
        """Close without waiting (idempotent); a pending replay task ends on its own."""
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
