"""vLLM KV-cache events: a self-healing subscriber per worker.

The precise index is only as good as the event stream behind it, and that stream is lossy by
design: ZMQ PUB drops messages a subscriber was not connected for (or had no room for), servers
restart and begin a new sequence, and formats drift between vLLM releases. So decoding
(``workers.kv_wire``) is strict about structure but tolerant of growth, and the subscriber
treats every sequence number as evidence: a hole is filled from the publisher's replay buffer
when it can be, and otherwise the worker's entries are reset so the index under-claims instead
of routing on blocks that may be gone.

Framing (see tests/fixtures/vllm-0.32/README.md): PUB ``[topic, seq (8-byte BE signed),
payload]``, the payload decoded by ``workers.kv_wire.decode_batch``. Replay: a DEALER sends
``[b"", start_seq]`` and gets ``[b"", topic, seq, payload]`` per buffered batch (older servers
omit the topic frame), then an end marker with seq -1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
import time
from array import array
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from workers.kv_wire import KVEvent, KVEventDecodeError, count_skipped, decode_batch_steps

__all__ = [
    "KVEventSink",
    "KVEventStats",
    "KVEventSubscriber",
]

log = logging.getLogger("kvgate.kv_events")


# --------------------------------------------------------------------------- subscriber


class KVEventSink(Protocol):
    """What a subscriber drives. Called on the event loop for every batch, so it must not
    block; ``reset`` reasons: "restart", "gap", "cleared", "disconnect", "health" (or whatever
    a caller passed to ``resync``).

    A sink may also have ``apply_steps(worker, events) -> Iterator[None]``, ``apply`` with a
    pause at each ``yield``: it is then used instead, and the loop gets a turn at every pause
    (one batch can carry hundreds of thousands of blocks)."""

    def apply(self, worker: str, events: Sequence[KVEvent]) -> None: ...

    def reset(self, worker: str, reason: str) -> None: ...

    def set_live(self, worker: str, live: bool) -> None: ...


@dataclass
class KVEventStats:
    events: int = 0  # decoded events handed to the sink
    batches: int = 0  # batches applied (from the stream or a replay)
    gaps: int = 0  # sequence holes seen on the stream
    replays: int = 0  # replay requests sent
    replay_failures: int = 0  # of those, no usable answer (timeout, unreachable, malformed)
    resets: int = 0  # sink.reset calls
    decode_errors: int = 0  # undecodable batches or frames
    last_seq: int | None = None  # last sequence applied (-1: the publisher had published none)
    last_event_monotonic: float | None = None  # when the publisher last sent us a batch
    connected: bool = False  # the SUB socket has a live connection to the publisher
    duplicates: int = 0  # batches seen twice (stream and replay overlap) and skipped
    skipped_events: int = 0  # events of unknown types left out


_SEQ = struct.Struct(">q")
_END_SEQ = -1
# Stream batches held while a replay runs or the sink catches up; beyond either bound the reader
# stops and the publisher's own buffer (vLLM's PUB HWM, 100,000 batches) holds the rest. Bounded
# in bytes too: a publisher whose batches cost more to apply than to send must not pile up
# gigabytes here (the count alone allowed 50,000 x 4 MiB). (Setting to expose:
# kv_events_inbox_max_bytes.)
_INBOX_MAX = 50_000
_INBOX_MAX_BYTES = 64 << 20
_RING = 4096  # how far back a repeated sequence can still be recognised as a duplicate
_WARN_EVERY_S = 10.0
# Work on the event loop is done in slices of about this long, then the loop gets a turn: a
# replay of vLLM's whole buffer (10,000 batches by default) is seconds of decoding and indexing,
# and every client stream and routing decision of the gateway waits on the same loop.
_SLICE_S = 0.005
# A batch is one engine step's events: even a 1M-token prefill step is ~4 MiB of msgpack (ids of
# 3-5 bytes, a 9-byte hash per block). A bigger payload is not decoded (counted as a decode error,
# its sequence kept), since decoding and indexing it would hold the loop for seconds.
# (Setting to expose: kv_events_max_batch_bytes.)
_MAX_BATCH_BYTES = 4 << 20
# ZMQ's own limit (MAXMSGSIZE) on both sockets, for memory: a bigger message drops the connection
# before it is buffered whole, and the sequence check recovers from what it lost. Just over the
# batch limit: a message that will not be decoded is not worth receiving.
_MAX_MSG_BYTES = _MAX_BATCH_BYTES + (64 << 10)
# ZMQ redials a connection that failed, never one it dropped for breaking the protocol, and an
# oversized message is such a break: the subscription would stay dead for good. So a connection
# that has not come back this long after a disconnect is dialled anew (at most this often).
_REDIAL_S = 5.0
# Messages ZMQ queues for us before we read them (RCVHWM): each can be _MAX_MSG_BYTES, so this
# bounds the socket's buffer at ~130 MiB. Bursts are not lost to it: past it ZMQ stops reading
# the connection and the publisher buffers (vLLM's PUB keeps 100,000 batches per subscriber).
_RCVHWM = 32
# The same for a replay answer, which vLLM's ROUTER sends in one go: past its own queue for us it
# drops replies, a hole the sequence check turns into a reset, so the reader keeps up meanwhile.
_REPLAY_RCVHWM = 32
# A replay answer is bounded in time as a whole, not only per reply (``replay_timeout_s``): a
# publisher that keeps answering and never sends the end marker must not hold the worker's
# intake (the stream waits in the inbox meanwhile). (Setting to expose:
# kv_events_replay_deadline_s.)
_REPLAY_DEADLINE_MIN_S = 5.0
_REPLAY_DEADLINE_FACTOR = 4.0  # x replay_timeout_s, when that is more
# ... and in size. vLLM buffers `buffer_steps` batches (10,000 by default); an answer with more is
# cut to its newest batches, which are still a valid history (a shorter buffer's). The byte budget
# keeps one worker's replay from holding the gateway's memory. (Settings to expose:
# kv_events_replay_max_batches, kv_events_replay_max_bytes.)
_REPLAY_MAX_BATCHES = 20_000
_REPLAY_MAX_BYTES = 128 << 20
# After a failed replay none is tried for a while (doubling per failure up to the maximum): each
# try holds the worker's intake for up to its deadline, and one that just failed will likely fail
# again. Meanwhile the worker runs as one without a replay endpoint (a gap resets).
_REPLAY_BACKOFF_S = 5.0
_REPLAY_BACKOFF_MAX_S = 120.0
_STOP_RECANCEL_S = 1.0  # stop() cancels its tasks again at this interval until they are done

_shared: zmq.asyncio.Context | None = None


def _context() -> zmq.asyncio.Context:
    """One asyncio context for all subscribers: a context per worker would cost an I/O thread
    each. (``zmq.asyncio.Context.instance()`` can hand back a plain context if one was made
    first, so it is not used.)"""
    global _shared
    if _shared is None or _shared.closed:
        _shared = zmq.asyncio.Context()
    return _shared


def _parse_seq(frame: bytes) -> int | None:
    return _SEQ.unpack(frame)[0] if len(frame) == 8 else None


class _ReplayError(Exception):
    pass


class KVEventSubscriber:
    """Keeps ``sink`` equal to one worker's KV cache, as far as its events allow.

    Three tasks: a reader that drains the SUB socket into an inbox (so the stream is buffered,
    not lost, while a replay is in flight), a monitor reader (connects and disconnects), and a
    processor that applies batches in sequence order and does every replay. Only the processor
    touches the sequence state or the sink, so there is no interleaving to reason about.
    """

    def __init__(
        self,
        worker: str,
        endpoint: str,
        sink: KVEventSink,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.sink = sink
        self.replay_endpoint = replay_endpoint or None
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.stats = KVEventStats()
        self._ctx = ctx
        self._sub: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._inbox: deque[tuple[int, bytes]] = deque()
        self._inbox_bytes = 0  # payload bytes in _inbox
        self._control: deque[tuple[str, str]] = deque()
        self._wake: asyncio.Event | None = None
        self._room: asyncio.Event | None = None
        self._redial: asyncio.TimerHandle | None = None
        # Sequence state (processor only). _ring holds payload digests of the last _RING
        # applied sequences, from _ring_from on: a repeated seq with the same bytes is a
        # duplicate, with other bytes a new publisher.
        self._last: int | None = None
        self._ring = array("q", bytes(8 * _RING))
        self._ring_from: int | None = None
        self._synced = False  # the publisher's history is in (a replay from 0 succeeded)
        self._lost_connection = False  # disconnected since the last successful sync
        self._live: bool | None = None
        # Held state not yet verified since a reconnect (no replay could tell): not live until a
        # batch on the new connection shows whether the sequence went on (see _on_control).
        self._verify = False
        self._replay_after = 0.0  # monotonic: no replay before (backoff after a failure)
        self._replay_backoff = 0.0
        self._skipped: Counter[str] = Counter()  # bounded per tag (kv_wire.count_skipped)
        self._tally: Counter[str] = Counter()  # this batch's skips, empty between batches
        self._warned: dict[str, float] = {}

    # ----------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    async def start(self) -> None:
        if self._tasks:
            return
        ctx = self._ctx or _context()
        self._wake, self._room = asyncio.Event(), asyncio.Event()
        self._room.set()
        self._set_live(False)
        sub = ctx.socket(zmq.SUB)
        mon: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, _RCVHWM)
            sub.setsockopt(zmq.RECONNECT_IVL, 100)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)  # back off from a dead host
            # Heartbeats notice a publisher host that vanished without closing the connection.
            sub.setsockopt(zmq.HEARTBEAT_IVL, 5000)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
            sub.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG_BYTES)
            mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sub.connect(self.endpoint)
        except zmq.ZMQError as e:
            # A bad endpoint (vLLM's own "tcp://*:5557" copied into the gateway config, say) is
            # a config error for this worker only; the others must still subscribe.
            log.error(
                "kv events %s: cannot subscribe to %r: %s (use the publisher's host, not *)",
                self.worker,
                self.endpoint,
                e,
            )
            self._close_sockets(sub, mon)
            return
        assert mon is not None
        self._sub, self._mon = sub, mon
        name = f"kv-events-{self.worker}"
        self._tasks = [
            asyncio.create_task(self._read_stream(sub), name=f"{name}-sub"),
            asyncio.create_task(self._read_monitor(mon), name=f"{name}-monitor"),
            asyncio.create_task(self._process(), name=f"{name}-apply"),
        ]
        for t in self._tasks:
            t.add_done_callback(self._task_done)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        pending = set(tasks)
        try:
            # Cancelled again until done: a cancel can be swallowed (3.11's wait_for drops one
            # that lands when its inner future is done, gh-86296), and a task that lost its
            # cancel would otherwise leave stop() and its caller (a config sync under the
            # gateway's lock, shutdown) waiting for good.
            while pending:
                for t in pending:
                    t.cancel()
                _done, pending = await asyncio.wait(pending, timeout=_STOP_RECANCEL_S)
                if pending:
                    self._warn("stop", "%d task(s) still running after cancel", len(pending))
        finally:
            if self._redial is not None:
                self._redial.cancel()
                self._redial = None
            sub, mon, self._sub, self._mon = self._sub, self._mon, None, None
            self._close_sockets(sub, mon)
            self._inbox.clear()
            self._inbox_bytes = 0
            self._control.clear()
            self.stats.connected = False
            if self._last is not None:
                self._lost_connection = True  # a later start() must check it is the publisher
            self._set_live(False)

    def resync(self, reason: str) -> None:
        """Void what the sink holds for this worker and rebuild it from the replay buffer.

        For callers that learn of a restart before the stream shows it (the health prober sees
        a new process; a restarted server may not have published yet).
        """
        if not self._tasks:
            self._reset(reason)
            return
        self._set_live(False)
        if ("resync", reason) not in self._control:
            self._control.append(("resync", reason))
        self._wake_up()

    # ----------------------------------------------------------------- tasks

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "kv events %s: %s died", self.worker, task.get_name(), exc_info=task.exception()
            )

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def verify_continuity(self) -> None:
        """Check, as after a reconnect, that the publisher's sequence went on from the last
        batch applied (the worker was out of service without a restart: a health flap): with a
        replay endpoint, by finding that batch in the replay byte for byte (then applying what
        follows; a new publisher or a hole the buffer no longer covers resets); without one,
        not live until the stream's next batch shows its sequence number. Disconnected, the
        reconnect check runs anyway when the connection is back."""
        if not self.running or not self.stats.connected:
            return
        if self.replay_endpoint is None and not self._holds_state():
            return  # nothing held to check
        self._set_live(False)
        self._lost_connection = True
        if ("connected", "") not in self._control:
            self._control.append(("connected", ""))
        self._wake_up()

    async def _read_stream(self, sub: zmq.asyncio.Socket) -> None:
        assert self._room is not None
        while True:
            try:
                frames = await sub.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if sub.closed or e.errno in (zmq.ENOTSOCK, zmq.ETERM):
                    return
                log.warning("kv events %s: receive failed: %s", self.worker, str(e))
                await asyncio.sleep(0.1)
                continue
            except Exception:
                log.exception("kv events %s: receive failed", self.worker)
                await asyncio.sleep(0.1)
                continue
            seq = _parse_seq(frames[1]) if len(frames) == 3 else None
            if seq is None:
                self.stats.decode_errors += 1
                self._warn("frames", "not a [topic, seq, payload] message (%d frames)", len(frames))
                continue
            self.stats.last_event_monotonic = time.monotonic()
            payload = frames[2]
            self._inbox.append((seq, payload))
            self._inbox_bytes += len(payload)
            self._wake_up()
            if len(self._inbox) >= _INBOX_MAX or self._inbox_bytes >= _INBOX_MAX_BYTES:
                self._room.clear()
                await self._room.wait()

    async def _read_monitor(self, mon: zmq.asyncio.Socket) -> None:
        while True:
            try:
                event = parse_monitor_message(await mon.recv_multipart())["event"]
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                if mon.closed:
                    return
                await asyncio.sleep(0.1)
                continue
            except Exception:
                log.exception("kv events %s: monitor failed", self.worker)
                await asyncio.sleep(0.1)
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.stats.connected = True
                self._control.append(("connected", ""))
                if self._redial is not None:
                    self._redial.cancel()
                    self._redial = None
            elif event == zmq.EVENT_DISCONNECTED:
                self.stats.connected = False
                self._control.append(("disconnected", ""))
                if self._redial is None:
                    loop = asyncio.get_running_loop()
                    self._redial = loop.call_later(_REDIAL_S, self._dial_again)
            elif event == zmq.EVENT_MONITOR_STOPPED:
                return
            self._wake_up()

    async def _process(self) -> None:
        assert self._wake is not None and self._room is not None
        me = asyncio.current_task()
        assert me is not None
        try:
            if self.replay_endpoint is not None:
                if self._last is None:
                    await self._full_sync()
                else:
                    await self._reconnect_sync()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv events %s: initial sync failed", self.worker)
        inbox, control, room = self._inbox, self._control, self._room
        while True:
            if me.cancelling():  # a cancel swallowed on the way: do not wait on for good
                raise asyncio.CancelledError
            await self._wake.wait()
            self._wake.clear()
            pause_at = time.perf_counter() + _SLICE_S
            while control or inbox:
                try:
                    if control:
                        kind, arg = control.popleft()
                        await self._on_control(kind, arg)
                    else:
                        seq, payload = inbox.popleft()
                        self._inbox_bytes -= len(payload)
                        if (
                            not room.is_set()
                            and len(inbox) < _INBOX_MAX // 2
                            and self._inbox_bytes < _INBOX_MAX_BYTES // 2
                        ):
                            room.set()
                        await self._on_message(seq, payload)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("kv events %s: failed to handle an update", self.worker)
                if time.perf_counter() >= pause_at:  # a long backlog: let the loop breathe
                    await asyncio.sleep(0)
                    pause_at = time.perf_counter() + _SLICE_S

    def _dial_again(self) -> None:
        """No connection since a disconnect: drop the endpoint's dead session, if ZMQ kept one,
        and connect anew (a publisher that is down is then retried by ZMQ as before)."""
        self._redial = None
        sub = self._sub
        if sub is None or sub.closed or self.stats.connected:
            return
        log.info("kv events %s: no connection since a disconnect: dialling again", self.worker)
        with contextlib.suppress(zmq.ZMQError):
            sub.disconnect(self.endpoint)
        try:
            sub.connect(self.endpoint)
        except zmq.ZMQError as e:
            self._warn("redial", "cannot connect to %r again: %s", self.endpoint, e)

    # ----------------------------------------------------------------- processing

    async def _on_control(self, kind: str, arg: str) -> None:
        if kind == "resync":
            self._reset(arg)
            if self.replay_endpoint is not None:
                await self._full_sync()
            else:
                self._set_live(self.stats.connected)
        elif kind == "disconnected":
            self._lost_connection = True
            self._set_live(False)
        elif kind == "connected":
            if self.replay_endpoint is not None and (self._lost_connection or not self._synced):
                await self._reconnect_sync()
            elif self._lost_connection and self._holds_state():
                self._lost_connection = False
                # No replay to compare with: the publisher may have restarted behind the same
                # address (its cache empty) or evicted blocks while we were away (PUB drops
                # what it sends to no one). Not trusted until its next batch tells, by its
                # sequence number: the next one (kept), a restart or a gap (reset). Not a reset
                # right away: vLLM announces a block once, when it is computed, so a cleared
                # index would under-claim a still-cached hot prefix for as long as it stays hot.
                self._verify = True
            self._set_live(not self._verify)

    async def _on_message(self, seq: int, payload: bytes) -> None:
        if self._lost_connection and self.replay_endpoint is not None:
            # First batch over a new connection, ahead of the monitor's news of it. Only the
            # reconnect check can tell a restarted publisher whose sequence has already passed
            # ours (which would pass for a gap and be "filled" from the wrong history).
            await self._reconnect_sync()
        self._verify = False  # this batch tells where the sequence is (see _on_control)
        digest = hash(payload)
        action = await self._ingest(seq, payload, digest)
        if action == "gap":
            assert self._last is not None
            self.stats.gaps += 1
            start = self._last + 1
            log.info("kv events %s: gap: expected seq %d, got %d", self.worker, start, seq)
            if self.replay_endpoint is None:
                self._reset("gap")
            else:
                await self._gap_sync(start)
            await self._ingest_final(seq, payload, digest)
        elif action == "restart":
            log.info(
                "kv events %s: seq %d after %s: the publisher restarted",
                self.worker,
                seq,
                self._last,
            )
            self._reset("restart")
            if self.replay_endpoint is not None:
                await self._full_sync()
            await self._ingest_final(seq, payload, digest)
        if self.stats.connected:
            self._set_live(True)

    async def _ingest(
        self, seq: int, payload: bytes, digest: int
    ) -> Literal["ok", "gap", "restart"]:
        last = self._last
        if last is not None:
            if seq <= last:
                if self._seen(seq, digest):
                    self.stats.duplicates += 1
                    return "ok"
                return "restart"
            if seq > last + 1:
                return "gap"
        steps = self._apply(seq, payload, digest)
        if steps is not None:
            await self._run_steps(seq, steps)
        return "ok"

    async def _ingest_final(self, seq: int, payload: bytes, digest: int) -> None:
        """Apply with no further replay: any hole left now is lost for good, so reset."""
        action = await self._ingest(seq, payload, digest)
        if action != "ok":
            log.info(
                "kv events %s: seq %d after %s cannot be filled in (%s): starting over",
                self.worker,
                seq,
                self._last,
                action,
            )
            self._reset(action)
            await self._ingest(seq, payload, digest)

    def _apply(self, seq: int, payload: bytes, digest: int) -> Iterator[None] | None:
        """Take the batch's sequence and decode and apply it. With a sink that applies in steps
        the work is returned, as steps, for the caller to run (``_run_steps``) before anything
        else touches the sequence state or the sink; with any other sink it is done here, in
        one piece. ``stats.last_seq`` moves once the batch is applied."""
        self._last = seq
        if self._ring_from is None:
            self._ring_from = seq
        self._ring[seq % _RING] = digest
        # An undecodable or oversized batch is counted and passed over: a lost batch can only
        # leave stale entries, which the next store or eviction of those blocks corrects.
        if len(payload) > _MAX_BATCH_BYTES:
            self.stats.decode_errors += 1
            self.stats.last_seq = seq
            self._warn(
                "oversized",
                "batch seq %d of %d bytes not decoded (limit %d)",
                seq,
                len(payload),
                _MAX_BATCH_BYTES,
            )
            return None
        steps = self._batch(seq, payload)
        if getattr(self.sink, "apply_steps", None) is None:
            for _ in steps:
                pass
            return None
        return steps

    def _batch(self, seq: int, payload: bytes) -> Iterator[None]:
        """Decoding, then applying, one batch: a step at a time, since a 4 MiB batch can be a
        million tiny events or 650,000 blocks, seconds of work either way. All or nothing up to
        the sink: an undecodable batch, found however late, applies no event."""
        tally = self._tally
        try:
            _ts, events, _rank = yield from decode_batch_steps(payload, skipped=tally)
        except KVEventDecodeError as e:
            self.stats.decode_errors += 1
            self.stats.last_seq = seq
            self._warn("decode", "undecodable batch seq %d: %s", seq, e)
            tally.clear()
            return
        if tally:
            self._note_skipped(tally)
        if events:
            stepper = getattr(self.sink, "apply_steps", None)
            try:
                if stepper is None:
                    self.sink.apply(self.worker, events)
                else:
                    yield from stepper(self.worker, events)
            except Exception:
                log.exception("kv events %s: sink failed on seq %d", self.worker, seq)
        self.stats.batches += 1
        self.stats.events += len(events)
        self.stats.last_seq = seq

    async def _run_steps(self, seq: int, steps: Iterator[None]) -> None:
        """A batch's steps with the loop's turn between them: a batch of 650,000 one-token
        blocks held the loop for ~2 s in one piece, 40,000 small events ~0.6 s. Only this task
        touches the sequence state and the sink, so nothing else sees or changes them half-way
        (the index, read meanwhile by routing, shows part of the batch)."""
        try:
            for _ in steps:
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv events %s: sink failed on seq %d", self.worker, seq)

    def _note_skipped(self, tally: Counter[str]) -> None:
        """Unknown event types of one batch: into the running total and the (bounded) table."""
        for tag, n in tally.items():
            self.stats.skipped_events += n
            count_skipped(self._skipped, tag, n)
        tally.clear()
        if self._warn_due("skipped"):
            log.warning(
                "kv events %s: skipping unknown event types %s", self.worker, dict(self._skipped)
            )

    def _seen(self, seq: int, digest: int) -> bool:
        last, first = self._last, self._ring_from
        return (
            last is not None
            and first is not None
            and first <= seq <= last
            and last - seq < _RING
            and self._ring[seq % _RING] == digest
        )

    def _holds_state(self) -> bool:
        """The sink holds something of this publisher's (batches applied since the last reset)."""
        return self._last is not None and self._last >= 0

    def _reset(self, reason: str) -> None:
        self.stats.resets += 1
        self._last = self.stats.last_seq = None
        self._ring_from = None
        self._synced = self._verify = False
        try:
            self.sink.reset(self.worker, reason)
        except Exception:
            log.exception("kv events %s: sink reset failed", self.worker)

    def _set_live(self, live: bool) -> None:
        if live == self._live:
            return
        self._live = live
        try:
            self.sink.set_live(self.worker, live)
        except Exception:
            log.exception("kv events %s: sink set_live failed", self.worker)

    async def _apply_history(self, batches: Sequence[tuple[int, bytes]]) -> None:
        if not batches and self._last is None:
            # Nothing published yet: the very next batch must be seq 0, or it is a gap.
            self._last = self.stats.last_seq = -1
        await self._ingest_all(batches)

    async def _ingest_all(self, batches: Sequence[tuple[int, bytes]], after: int = -2) -> None:
        """``_ingest_final`` of each batch past ``after``, in slices: the event loop gets a turn
        every ``_SLICE_S`` (only this task touches the sequence state and the sink, so nothing
        else can see or change it half-way)."""
        pause_at = time.perf_counter() + _SLICE_S
        for seq, payload in batches:
            if seq > after:
                await self._ingest_final(seq, payload, hash(payload))
            if time.perf_counter() >= pause_at:
                await asyncio.sleep(0)
                pause_at = time.perf_counter() + _SLICE_S

    # ----------------------------------------------------------------- replays

    async def _full_sync(self) -> None:
        """Everything the publisher still buffers, into a sink that holds nothing for us."""
        self._set_live(False)
        batches = await self._fetch(0)
        if batches is None:
            return  # live again with the next in-order batch from the stream
        await self._apply_history(batches)
        self._synced, self._lost_connection, self._verify = True, False, False
        self._set_live(True)

    async def _gap_sync(self, start: int) -> None:
        self._set_live(False)
        batches = await self._fetch(start)
        if batches is None:
            self._reset("gap")
            return
        # A buffer that no longer reaches back to `start` shows up as a gap on its first batch,
        # which _ingest_final turns into reset("gap") before applying the rest.
        await self._ingest_all(batches)

    async def _reconnect_sync(self) -> None:
        """After a reconnect the publisher may be the same process (fill in what we missed) or a
        new one on the same address (start over); the replay tells which, by whether our last
        batch is still there byte for byte."""
        # One attempt per disconnect: a dead replay endpoint must not stall every batch.
        self._lost_connection = False
        self._set_live(False)
        batches = await self._fetch(0)
        if batches is None:
            # Neither the same publisher nor a new one can be told: what the sink holds is not
            # trusted until the stream's next batch shows (see _on_control).
            self._verify = self._holds_state()
            return
        last = self._last
        if last is None or last < 0 or self._ring_from is None:
            await self._apply_history(batches)
        else:
            ours = next((p for s, p in batches if s == last), None)
            if ours is not None and self._seen(last, hash(ours)):
                await self._ingest_all(batches, after=last)
            elif ours is not None or not batches or batches[-1][0] < last:
                log.info("kv events %s: new publisher after reconnect", self.worker)
                self._reset("restart")
                await self._apply_history(batches)
            else:
                log.info("kv events %s: missed more than the replay buffer holds", self.worker)
                self.stats.gaps += 1
                self._reset("gap")
                await self._apply_history(batches)
        self._synced, self._verify = True, False
        self._set_live(True)

    async def _fetch(self, start: int) -> Sequence[tuple[int, bytes]] | None:
        """The publisher's buffered batches from ``start`` on, or None if it did not answer.

        ``replay_timeout_s`` bounds each wait (connect, every reply); the whole answer is
        bounded too, in time (a deadline past which it failed) and in size (only its newest
        ``_REPLAY_MAX_BATCHES`` batches, ``_REPLAY_MAX_BYTES`` bytes are kept). After a failure
        no replay is tried until a backoff has passed (None at once meanwhile).
        """
        assert self.replay_endpoint is not None
        now = time.monotonic()
        if now < self._replay_after:
            self._warn(
                "replay-backoff",
                "no replay for %.0fs after a failed one: gaps reset",
                self._replay_after - now,
            )
            return None
        self.stats.replays += 1
        ctx = self._ctx or _context()
        sock = ctx.socket(zmq.DEALER)
        timeout = self.replay_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(_REPLAY_DEADLINE_MIN_S, _REPLAY_DEADLINE_FACTOR * timeout)
        out: deque[tuple[int, bytes]] = deque()
        size = got = 0
        prev = start - 1
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG_BYTES)
            sock.setsockopt(zmq.RCVHWM, _REPLAY_RCVHWM)
            sock.connect(self.replay_endpoint)
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that lands when
            # the inner future is done, which is nearly always mid-transfer (gh-86296).
            async with asyncio.timeout(timeout) as tm:
                await sock.send_multipart([b"", _SEQ.pack(start)])
                pause_at = time.perf_counter() + _SLICE_S
                while True:
                    tm.reschedule(min(loop.time() + timeout, deadline))
                    # Done at once while replies queue up, so the loop gets turns below.
                    frames = await sock.recv_multipart()
                    # [b"", topic, seq, payload] (0.32) or [b"", seq, payload] (older servers).
                    if len(frames) == 4:
                        seq_frame, payload = frames[2], frames[3]
                    elif len(frames) == 3:
                        seq_frame, payload = frames[1], frames[2]
                    else:
                        raise _ReplayError(f"reply of {len(frames)} frames")
                    seq = _parse_seq(seq_frame)
                    if seq is None:
                        raise _ReplayError("reply without an 8-byte sequence")
                    if seq == _END_SEQ:
                        break
                    if seq <= prev:
                        raise _ReplayError(f"seq {seq} after {prev} (asked from {start})")
                    prev = seq
                    got += 1
                    out.append((seq, payload))
                    size += len(payload)
                    while len(out) > _REPLAY_MAX_BATCHES or size > _REPLAY_MAX_BYTES:
                        size -= len(out.popleft()[1])
                    if time.perf_counter() >= pause_at:
                        await asyncio.sleep(0)
                        pause_at = time.perf_counter() + _SLICE_S
        except asyncio.CancelledError:
            raise
        except (TimeoutError, zmq.ZMQError, _ReplayError) as e:
            if not isinstance(e, TimeoutError):
                why = str(e)
            elif loop.time() >= deadline:
                why = f"no end after {len(out)} kept batches by its deadline"
            else:
                why = "timed out"
            self._replay_failed()
            self._warn(
                "replay", "replay from %d via %s failed: %s", start, self.replay_endpoint, why
            )
            return None
        except Exception:
            self._replay_failed()
            log.exception("kv events %s: replay from %d failed", self.worker, start)
            return None
        finally:
            sock.close(linger=0)
        self._replay_backoff = 0.0
        if got > len(out):
            self._warn(
                "replay-cut",
                "replay from %d of %d batches cut to its newest %d (%d bytes)",
                start,
                got,
                len(out),
                size,
            )
        log.debug("kv events %s: replayed %d batches from %d", self.worker, len(out), start)
        return out

    def _replay_failed(self) -> None:
        self.stats.replay_failures += 1
        b = self._replay_backoff
        self._replay_backoff = b = (
            _REPLAY_BACKOFF_S if b <= 0 else min(2 * b, _REPLAY_BACKOFF_MAX_S)
        )
        self._replay_after = time.monotonic() + b

    # ----------------------------------------------------------------- helpers

    def _warn_due(self, key: str) -> bool:
        """Whether a warning of ``key`` may be logged now (at most once every few seconds)."""
        now = time.monotonic()
        if now - self._warned.get(key, -math.inf) >= _WARN_EVERY_S:
            self._warned[key] = now
            return True
        return False

    def _warn(self, key: str, msg: str, *args: object) -> None:
        """Warnings that can repeat per batch, at most once per key every few seconds."""
        if self._warn_due(key):
            log.warning("kv events %s: " + msg, self.worker, *args)

    @staticmethod
    def _close_sockets(sub: zmq.asyncio.Socket | None, mon: zmq.asyncio.Socket | None) -> None:
        if sub is not None and not sub.closed:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
        for s in (mon, sub):
            if s is not None and not s.closed:
                s.close(linger=0)
