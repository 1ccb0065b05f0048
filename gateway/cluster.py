"""Gateway replicas sharing per-worker load and what they learn, through Redis.

A replica that sees only its own dispatches under-counts every worker's queue by the other
replicas' share (`bench.simulate --replicas 4`, Mooncake: p99 TTFT 2.05 s against 1.43 s with one
gateway; sharing per-worker queued-prefill tokens alone restored the single-gateway figures) and
enforces `max_concurrency` per replica instead of per worker. So every replica runs one background
task that, every ``publish_interval_s``, writes its own per-worker (in-flight requests,
queued-prefill tokens) and reads everyone else's, in ONE pipelined round trip:

    HSET    <prefix>load <replica id> <snapshot>   (the replica's heartbeat too: seq moves)
    PEXPIRE <prefix>load <10 x expiry>             (the hash goes away with the last replica)
    HGETALL <prefix>load
    TIME                                           (dates the snapshots read: see the end)
    HDEL    <prefix>load <expired ids>             (only when a peer has just expired)

and, at the same time, in a pipeline and a timeout of its own (what replicas learn, below):

    XADD    <prefix>learned MAXLEN ~ N r <id> s <seq> b <batch>  (new dispatches, <= 1 MB each)
    XREAD   COUNT n STREAMS <prefix>learned <last id>            (everyone's, since the last read)
    TIME                                           (ages the entries read: see below)

and sets ``Worker.remote_in_flight`` / ``remote_prefill_tokens`` from the sums
(`workers.load_view`). The request path never waits on Redis: it reads two ints per worker that
this task refreshed. Routing signals (`Worker.view`), `Slots.worker_room` (fleet-wide
`max_concurrency`) and admission room all count them; ``Worker.in_flight`` stays this replica's
own (what it must release, and what drain waits for). Load is per worker name and URL (a name
moved to a new server is another worker until every replica has moved it), and a worker this
replica removed keeps its published load until the requests running there end.

Fleet-wide `max_concurrency` is therefore a bound with slack, not a lock: each replica admits
against the others' load as it last read it, up to two intervals plus a round trip old. When room
appears while N replicas have requests waiting for that worker, each fills it before it sees the
others do, so the worker can run up to N x its cap for as long as those requests run (two
replicas, cap 2: 4 ran at once in a burst; above the cap 6.8% of the time under sustained
overload). A shorter interval narrows the window; a lock in Redis on every dispatch would put a
round trip on the request path.

Why polling a hash and not pub/sub: measured once with 4 and 8 replicas on one local Redis (all
replicas in one process on 2 shared cores; delay = a change on replica 0 until replica 1 saw it,
~65 changes each; client CPU summed over all replicas):

                     delay median   delay p99    Redis CPU      client CPU
    poll, 50 ms      54 / 58 ms     96 / 113 ms  0.29 / 0.42 %  3.2 / 5.9 %
    pub/sub, 50 ms   28 / 26 ms     51 / 61 ms   0.29 / 0.74 %  3.5 / 10.5 %
    pub/sub, 100 ms  51 / 53 ms     102 / 105 ms 0.16 / 0.35 %  1.7 / 5.4 %

Pub/sub halves the staleness at one interval (it waits for the publisher's tick only, polling
for the reader's too), and at equal staleness it costs about the same. Polling won on everything
else: one connection and one code path (no subscriber connection to re-subscribe after a Redis
restart, no pushed messages lost while it reconnects: a read is always the whole state, so the
first successful round trip after an outage IS the resync), plain commands every Redis proxy
forwards (common proxies refuse SUBSCRIBE), and one key in one slot under Redis Cluster, where
PUBLISH is broadcast to every node. Staleness target: 100 ms at the default 50 ms interval (a
dispatch waits for its replica's next write, then for the reader's next read: up to two intervals
plus a round trip); tests/gateway/test_cluster_e2e.py measures it between two real gateways.

The second half is what replicas learn (`scoring.learned`, `workers.learned_share`): every dispatch
is noted in a bounded journal on the request path (one tuple append), shipped as one stream entry
per sync (a backlog as several), and replayed by each peer into its own approximate prefix index and
session table (in KV-event mode also into the precise index's pending dispatches, until the first
token: what no event shows yet), so a prefix or session one replica routed goes to the same worker
through any replica (without it, four replicas each learned a quarter of the fleet: Mooncake hit
rate 35.5% -> 10.8% offline). A stream, not the hash: learned state is a log of events that every
reader must see once and in order, where load is a current value. Its entry ids carry Redis' own
milliseconds, so ``TIME`` in the same round trip tells each reader how long an entry waited in Redis
without comparing two hosts' clocks; ``kvgate_cluster_learned_lag_seconds`` is dispatch-to-learned,
measured by test_cluster_learned.py at a median ~20-30 ms, p99 ~60 ms on a loaded 2-core box. A
replica that starts (or comes back) reads the stream's history, up to ``learned_stream_maxlen``
batches: a warm start.

Everything on the learned path is bounded in bytes and in work per sync, not in dispatches: a
dispatch is ~0.5 KB on the wire in text mode but up to 64 KB in KV-event mode (8 bytes a worker
block), and when Redis came back after an outage, one 4096-dispatch batch (~64 MB) could not be
encoded, written and read back within ``op_timeout_s``; it was written anyway, counted as a
failure and sent again every sync, and the heartbeat failed with it (see
tests/gateway/test_cluster_backlog.py). So:
- each sync packs the journal's new dispatches into rows (8 bytes a block, not the request's
  ~40-byte ints), outside any timeout, into an outbox of batches of at most
  ``LEARNED_BATCH_BYTES``. While Redis is down the outbox is what waits, bounded by
  ``learned_journal_max`` dispatches and ``learned_journal_max`` KB (oldest batches dropped,
  counted), so an outage costs the oldest notes, never GBs;
- a sync publishes at most ``LEARNED_SEND_BYTES`` of it (one batch after a failure), in a pipeline
  and a timeout apart from the heartbeat's: a slow learned write or read never makes the replica
  degraded, nor stops load sharing;
- a batch keeps its per-replica ``s`` (sequence) until Redis confirms it: a publish that timed
  out after Redis ran it is sent again under the same ``s``, and readers skip an ``s`` they
  already took from that replica. A reader of an older version ignores ``s`` and replays the
  copy, which is harmless (recording a chain twice changes nothing; a session's note only wins
  over an older turn); this version takes an older publisher's entries, which have no ``s``;
- a read's COUNT follows the entries' size (about ``LEARNED_READ_BYTES`` a read, one entry after
  a failed read), and what it returned is replayed at most ``LEARNED_APPLY_MAX`` dispatches and
  ``LEARNED_APPLY_KEYS`` keys a sync, yielding the event loop every ``LEARNED_APPLY_CHUNK``
  dispatches or ``LEARNED_CHUNK_KEYS`` keys (inside a stream entry too: one of KV-event mode
  dispatches holds ~125k keys): a backlog (a warm start, peers publishing theirs) is caught up
  over several syncs, never in one stall of the event loop.

What is replayed must stay true, and the same on every replica:
- a worker restarts with an empty cache, and routing forgets it (`gateway.app` on a new
  ``process_start``). A note from before that must not teach it back: readers skip notes from
  before ``RoutingState.forgot_at`` (a peer's outage backlog), and notes whose epoch time (the
  stream id's, less the time from dispatch to publish) is before the worker's current process
  start (a warm start's history; NTP-synced hosts, ``LEARNED_RESTART_SLACK_S``). No wire change.
  Notes taken while a worker's start is unknown are checked once it is (`_verify_starts`), and a
  started replica reads the history after the first probes (`_starts_known`);
- a name moved to a new server is another worker, for notes as for load: a batch names its
  workers' URLs, and readers skip notes about a server their fleet does not run under that name
  (an older peer's batch names none: by name, as before). Chains are recorded only between
  replicas that key the worker's models alike, token or text mode (`_chainless`);
- session turns are resolved in the stream's order when concurrent (`SessionTable.learn`), an
  order every replica reads the same, so a replica also reads back its own entries, for their
  session notes only.

Liveness is judged on each reader's own clock (`workers.load_view`): a peer whose sequence number
has not moved for ``expiry_s`` counts for nothing, and readers delete its field (only one whose
heartbeat stood still for ``expiry_s`` while they were reading: not after their own pause or
outage). A replica that starts has no reads of its own to judge by, so a snapshot carries when it
was written on Redis' clock (the last ``TIME`` this replica read, plus its own clock's seconds
since; left out once that is older than ``expiry_s``), and the ``TIME`` of a read tells how long
each snapshot stood unchanged: a replica restarted after a SIGKILL sees its predecessor's snapshot
as old as it is, not as a live peer's for a fresh ``expiry_s``; one it saw once, undated, and that
a sibling has deleted since is dropped. Redis down: every sync fails fast, the outage is logged
once (and its end once), ``kvgate_cluster_state`` says ``degraded``, the peers' contributions lapse
after ``expiry_s`` (routing on the local view, never on counts that only grow staler), and the
next successful round trip restores everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Collection, Container, Iterable, Iterator
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import ClusterSettings
from scoring.learned import Journal, Learned, apply_learned
from scoring.state import RoutingState
from workers.learned_share import decode_frame, frame_batch, pack_entry
from workers.load_view import Load, LoadView, encode_snapshot
from workers.registry import Registry
from workers.worker import Worker

log = logging.getLogger("kvgate.cluster")

# The learned path's bounds, in bytes and in work per sync (see the module docstring).
LEARNED_BATCH_BYTES = 1 << 20  # one stream entry (a single larger row goes alone)
LEARNED_SEND_BYTES = 2 << 20  # published per sync: a backlog drains over several
LEARNED_READ_BYTES = 4 << 20  # what one read aims at: its COUNT follows the entries' size
LEARNED_READ_MAX = 64  # stream entries per read, at most
LEARNED_READ_START = 4  # ... at a start (the history may hold another replica's backlog)
LEARNED_APPLY_MAX = 4096  # dispatches replayed per sync; the rest wait for the next syncs
# ... and keys (chain entries + KV-event worker blocks: ~0.6-0.8 us each to replay, either kind),
# which is what a replay costs: a text-mode dispatch carries <= 64, a KV-event one of a 32k-token
# prompt 2048. Per sync, the text-mode budget of 4096 x 64 keys (~0.15-0.2 s of work, yielding).
LEARNED_APPLY_KEYS = LEARNED_APPLY_MAX * 64
LEARNED_APPLY_CHUNK = 512  # dispatches replayed between two yields of the event loop, at most
LEARNED_CHUNK_KEYS = 16_384  # ... and keys (~10-15 ms of work), one stream entry split if need be
# A peer's note is placed on the epoch scale by its stream id (Redis' clock) and compared with the
# worker's process_start_time_seconds (its host's clock): notes before start + this slack (+ the
# publish timeout, by which a stream id can trail the dispatch) are about an earlier process. It
# covers NTP skew and the start time's own error (Linux derives it from a boot time in whole
# seconds); a vLLM server loads its model for far longer than this before its first request.
LEARNED_RESTART_SLACK_S = 2.0
# A started replica waits this long at most for every worker's first probe before it reads the
# stream's history, so that it can judge which notes are about a worker's current process.
LEARNED_PROBE_WAIT_S = 5.0
# Session turns of one session this close together (seconds) are concurrent: the note later in the
# stream wins on every replica (`SessionTable.learn`); at least 4 publish intervals.
LEARNED_CONCURRENT_S = 1.0
# Outbox bytes allowed per ``learned_journal_max`` dispatch: the ~1 KB the option documents. A
# text-mode dispatch packs to ~0.2-0.6 KB, so the count binds there; a KV-event one to ~8 bytes a
# worker block (16 KB for a 32k-token prompt), where the bytes bind.
LEARNED_BACKLOG_BYTES_PER_ENTRY = 1024
LEARNED_SEEN_MAX = 4096  # publishers whose last batch sequence is remembered (ids per process)

State = Literal["starting", "ok", "degraded"]
STATES: tuple[State, ...] = ("starting", "ok", "degraded")


def make_replica_id() -> str:
    """Unique per process: a restarted replica is a new one (its predecessor's load expires)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def redact_url(url: str) -> str:
    """The URL for logs, password masked."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def make_client(url: str, op_timeout_s: float) -> Redis:
    """A small client of its own: a stalled quota call must not delay the heartbeat, nor the
    reverse. One immediate retry on a dead pooled connection (a restarted Redis) makes the first
    tick after a restart a reconnect, not a failure."""
    return Redis.from_url(
        url,
        socket_timeout=op_timeout_s,
        socket_connect_timeout=op_timeout_s,
        socket_keepalive=True,
        max_connections=4,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError, RedisTimeoutError)),
    )


def _seq(raw: Any) -> int | None:
    """A stream entry's batch sequence; None when absent (an older publisher) or not a count."""
    if raw is None:
        return None
    try:
        v = int(raw)
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


class _Outgoing:
    """A batch of this replica's packed dispatches waiting for Redis to confirm it. Its ``seq``
    never changes once it has been sent (Redis may have stored a send that timed out), so
    readers can tell a re-send from a new batch; rows are only added before its first send.
    ``key``: the routing options its rows' chains were hashed under (``RoutingState.key`` when
    they left the journal), what it is framed with: a reload that changes the key meanwhile
    must not pass them off as hashed under the new one (peers would record meaningless chains).
    A batch never mixes keys. ``models``: likewise, the models keyed by tokens when its rows were
    packed (None: not known here). ``urls``: the URL of each worker its rows are about, when
    they were packed; a batch never names two for one worker (a reload moved it between two
    packs), so a reader can take each row into its own worker of that name and URL alone."""

    __slots__ = ("key", "models", "rows", "sent", "seq", "size", "urls")

    def __init__(self, seq: int, key: tuple[int, ...], models: frozenset[str] | None) -> None:
        self.seq = seq
        self.key = key
        self.models = models
        self.urls: dict[str, str] = {}
        self.rows: list[bytes] = []
        self.size = 0
        self.sent = False


class ClusterSync:
    """This replica's side of the shared load view: publish, read, merge, apply; see the module
    docstring. ``sync_once`` is one round trip (tests drive it directly); ``start`` runs it
    every ``publish_interval_s`` in a background task."""

    def __init__(
        self,
        cfg: ClusterSettings,
        registry: Registry,
        *,
        redis_url: str,
        replica_id: str | None = None,
        on_freed: Callable[[], None] | None = None,
        metrics: CollectorRegistry | None = None,
        client: Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        state: RoutingState | None = None,
        retired: Callable[[], Iterable[Worker]] | None = None,
        token_models: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.registry = registry
        # The served models this replica keys in token mode now (`[routing.token_mode]`): its
        # batches say which, and a peer's chains about a model keyed the other way are not
        # recorded (they can never match). None: not known, batches go out without it, and
        # peers' chains are taken as an older version took them.
        self.token_models = token_models
        # Worker records this replica's fleet no longer holds (a reload or /admin/workers removed
        # the worker, or pointed its name at a new URL) whose requests still run on that server:
        # their load is published too (`local_loads`).
        self.retired = retired
        self.replica_id = replica_id or make_replica_id()
        self.url = redis_url
        self.key = cfg.key_prefix + "load"
        self.interval_s = cfg.publish_interval_s
        self.op_timeout_s = cfg.op_timeout_s
        self.clock = clock
        self.view = LoadView(self.replica_id, cfg.expiry_s, clock=clock)
        # Called when a peer's load on some worker went down: admission may admit now.
        self.on_freed = on_freed
        self.client = client if client is not None else make_client(redis_url, cfg.op_timeout_s)
        # The op timeout the client's sockets were built with; None: the caller's client, which
        # this replica does not rebuild.
        self._client_timeout_s: float | None = None if client is not None else cfg.op_timeout_s
        self.state: State = "starting"
        self.seq = 0
        self.last_ok_at: float | None = None
        # When the last successful round trip was sent, on this clock: what it read was Redis'
        # state at that time or later (`_sync_load` judges peers' expiry as of it).
        self._read_sent_at: float | None = None
        # Redis' clock (its TIME, ms) as of the last successful round trip, and when that was on
        # this clock: a snapshot's write time on Redis' clock (`_redis_ms`).
        self._redis_ms_read: int | None = None
        self._redis_ms_read_at = 0.0
        self.down_since = 0.0
        self.failures = 0
        self.outages = 0
        # Fields of the last read, by the name the view knows them by: the field's own bytes go
        # back to HDEL (a name that is not UTF-8 reads back altered, and would delete nothing).
        self._in_store: dict[str, bytes] = {}
        self._task: asyncio.Task[None] | None = None
        # Learned routing state (prefix index entries, sessions): this replica's dispatches go
        # out through a stream, everyone else's come in and are replayed (scoring.learned).
        self.routing = state if cfg.share_learned else None
        self.learn_key = cfg.key_prefix + "learned"
        self.learn_maxlen = cfg.learned_stream_maxlen
        self.learn_last_id = b"0-0"  # the first read takes the stream's history: a warm start
        self.learned_published = 0
        self.learned_applied = 0
        self.learned_malformed = 0
        self.learned_dropped = 0  # packed dispatches the outbox dropped (beyond its budget)
        self.learned_duplicates = 0  # peer batches skipped: a re-send of one already taken
        self.learned_failures = 0  # learned round trips that failed (the heartbeat's apart)
        self.backlog_max = cfg.learned_journal_max
        # Publishing: packed batches, oldest first, until Redis confirms them.
        self._outbox: deque[_Outgoing] = deque()
        self.outbox_bytes = 0
        self._outbox_rows = 0
        self._batch_seq = 0
        # Reading: stream payloads read, with when each was published on this replica's clock,
        # waiting to be replayed; the batch being replayed, where it stands, and its chains' use.
        # (payload, published on this clock, its stream id's epoch seconds, this replica's own)
        self._inbox: deque[tuple[bytes, float, float, bool]] = deque()
        self._replaying: list[Learned] = []
        self._replayed = 0
        self._replay_chains = True
        # The batch's worker URLs and token-mode models (None: an older publisher's batch).
        self._replay_urls: dict[str, str] | None = None
        self._replay_models: frozenset[str] | None = None
        # Token-mode models when the journal was last packed: a change means a reload.
        self._packed_models = self._keyed_models()
        self._replay_own = False  # the batch being replayed is this replica's own, read back
        self._replay_epoch = 0.0  # its notes' epoch seconds less their time on this clock
        # Worker -> the epoch time of the earliest note applied while its process start was
        # unknown: once known, were any of them about an earlier process?
        self._unverified: dict[str, float] = {}
        # Set by start(): no warm-start read before the workers' first probes (or this time).
        self._probe_wait_until: float | None = None
        self.learned_stale = 0  # peer notes skipped: about a process or state forgotten since
        self._row_error_logged_at = float("-inf")
        self.concurrent_s = max(LEARNED_CONCURRENT_S, 4 * cfg.publish_interval_s)
        self._read_count = LEARNED_READ_START
        self._seen: dict[bytes, int] = {}  # publisher -> the last batch sequence taken from it
        self._learn_streak = 0  # learned round trips failed in a row
        self._learn_failing = False  # ... and logged as such
        self._learn_error = ""
        if self.routing is not None:
            self.routing.journal = Journal(cfg.learned_journal_max)
        self.learned_lag = Histogram(
            "kvgate_cluster_learned_lag_seconds",
            "From another replica's dispatch to this replica learning it (prefix index entries "
            "and sessions), per batch: its oldest entry",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0),
            registry=None,
        )
        self.round_trip = Histogram(
            "kvgate_cluster_sync_seconds",
            "One cluster sync round trip (write this replica's load, read every replica's)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=None,
        )
        if metrics is not None:
            metrics.register(self.round_trip)
            if self.routing is not None:
                metrics.register(self.learned_lag)
            metrics.register(ClusterCollector(self))

    @property
    def expiry_s(self) -> float:
        return self.view.expiry_s

    def configure(self, cfg: ClusterSettings) -> None:
        """Live changes from a config reload; Redis URL, key prefix and `enabled` need a restart.
        A new ``op_timeout_s`` reaches the client's sockets at the next sync (`_rebuild_client`)."""
        self.interval_s = cfg.publish_interval_s
        self.op_timeout_s = cfg.op_timeout_s
        self.view.expiry_s = cfg.expiry_s
        self.learn_maxlen = cfg.learned_stream_maxlen
        self.backlog_max = cfg.learned_journal_max
        self.concurrent_s = max(LEARNED_CONCURRENT_S, 4 * cfg.publish_interval_s)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Returns at once: the first sync runs in the task, so a Redis that is down at start
        delays nothing (the replica starts degraded, on its local view)."""
        if self._task is None:
            if self.learn_last_id == b"0-0":
                self._probe_wait_until = self.clock() + LEARNED_PROBE_WAIT_S
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-cluster")

    async def stop(self) -> None:
        """Stop syncing; a last write of an empty snapshot tells peers at once that this
        replica's load is gone (they then expire it like any silent peer), and a last publish
        shares the dispatches made since the last sync."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Bounded: a Redis call that swallowed its cancellation must not hold up a shutdown
            # (the process is going; the task dies with the loop).
            await asyncio.wait({task}, timeout=self.op_timeout_s + 1.0)
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a failure here was logged by the loop already
        if self.state == "ok":
            with contextlib.suppress(Exception):
                self.seq += 1
                async with asyncio.timeout(self.op_timeout_s):
                    await self.client.hset(self.key, self.replica_id, encode_snapshot(self.seq, {}))
            state = self.routing
            if state is not None:
                # The dispatches since the last sync: peers keep routing on what this replica
                # learned, so they are published too (bounded like any sync; lost on failure).
                with contextlib.suppress(Exception):
                    await self._pack_journal(state)
                    batches = self._to_send()
                    if batches:
                        await self._learn_round_trip(state, batches, read=False)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.op_timeout_s + 1.0):
                await self.client.aclose()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                await self.sync_once()
            except Exception:  # a bug here must not end the heartbeat for good
                log.exception("cluster: sync failed inside the gateway")
            due += self.interval_s
            now = loop.time()
            if due < now:  # a slow round trip: carry on from now, no burst to catch up
                due = now
            await asyncio.sleep(due - now)

    # -- one round trip ----------------------------------------------------------------------
    def local_loads(self) -> dict[tuple[str, str], Load]:
        """This replica's load per worker (name, URL): the fleet's records, and the retired
        records still running somewhere. Before, only the fleet's: a replica that dropped a
        worker (or moved its name to a new URL) while its requests ran there published none of
        them at once, and a replica that still routed there saw the server empty and filled it
        past its cap (cap 4: 8 ran)."""
        out: dict[tuple[str, str], Load] = {}
        workers: Iterable[Worker] = self.registry.workers.values()
        gone = self.retired() if self.retired is not None else ()
        for group in (workers, gone):
            for w in group:
                if w.in_flight > 0 or w.prefill_tokens > 0:
                    key = (w.name, w.url)
                    i, t = out.get(key, (0, 0))
                    out[key] = (i + w.in_flight, t + w.prefill_tokens)
        return out

    async def sync_once(self) -> bool:
        """Write this replica's snapshot (and its new dispatches), read everyone's, apply. False
        when Redis did not answer the heartbeat (the local view then ages as usual); the
        learned traffic runs beside it, on its own timeout, and its failures count apart."""
        if self._client_timeout_s is not None and self._client_timeout_s != self.op_timeout_s:
            await self._rebuild_client()
        state = self.routing
        if state is None:
            return await self._sync_load()
        ok, learned = await asyncio.gather(
            self._sync_load(), self._sync_learned(state), return_exceptions=True
        )
        for r in (ok, learned):
            if isinstance(r, BaseException):
                raise r
        if learned is False and ok and not self._learn_failing:
            self._learn_failing = True
            log.warning(
                "cluster: sharing learned state through %s failed (%s); load sharing goes on, "
                "retrying with one batch and one stream entry a sync",
                redact_url(self.url),
                self._learn_error,
            )
        elif learned is True and self._learn_failing:
            self._learn_failing = False
            log.warning("cluster: sharing learned state works again")
        return ok is True

    async def _sync_load(self) -> bool:
        self.seq += 1
        blob = encode_snapshot(self.seq, self.local_loads(), at_ms=self._redis_ms(self.clock()))
        # Peers this replica saw go quiet while it was reading Redis: expired as of its last
        # successful read, not as of now. After a gap in its own reads, every peer looks expired
        # to a view that could not read: a replica whose link was down past expiry_s, or whose
        # process was paused as long (SIGSTOP, a long GC, a starved container) with Redis fine,
        # deleted every live peer's snapshot on its first sync back, and a replica starting then
        # counted none of their load (review findings). As of the last read's send, a peer
        # looks expired only if that read, too, found its heartbeat still: it stood still for
        # expiry_s of the time this replica was reading, pauses in between or not.
        read_at = self._read_sent_at
        gone: list[str] = []
        if self.state == "ok" and read_at is not None:
            gone = [r for r in self.view.expired(read_at) if r in self._in_store]
        keep_ms = self._keep_ms()
        sent = self.clock()
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.op_timeout_s):
                pipe = self.client.pipeline(transaction=False)
                pipe.hset(self.key, self.replica_id, blob)
                pipe.pexpire(self.key, keep_ms)
                pipe.hgetall(self.key)
                pipe.time()
                if gone:
                    pipe.hdel(self.key, *(self._in_store[r] for r in gone))
                res = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            self._down(e)
            self.apply()
            return False
        self.round_trip.observe(time.perf_counter() - t0)
        fields = {k.decode(errors="replace"): k for k in res[2]}
        raw = {name: res[2][k] for name, k in fields.items()}
        now = self.clock()
        # TIME ran between the send and the reply: placed at their midpoint on this clock.
        redis_ms = int(res[3][0]) * 1000 + int(res[3][1]) // 1000
        self._redis_ms_read, self._redis_ms_read_at = redis_ms, (sent + now) / 2
        self.view.observe(raw, now, redis_ms=self._redis_ms(now))
        for r in gone:
            fields.pop(r, None)
        self._in_store = fields
        self._read_sent_at = sent
        self._up(now)
        self.apply(now)
        return True

    async def _rebuild_client(self) -> None:
        """A new client for a reloaded ``op_timeout_s``: the sockets' timeouts are fixed when a
        client is built, and a raised op timeout still failed a round trip at the old socket
        timeout (a 1.5 s stall failed at 1 s with 0.5 -> 5.0). Between two syncs, so no call of
        this task is on the old client; it is closed, bounded, whatever happens to it."""
        old = self.client
        self.client = make_client(self.url, self.op_timeout_s)
        self._client_timeout_s = self.op_timeout_s
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.op_timeout_s + 1.0):
                await old.aclose()

    def _redis_ms(self, t: float) -> int | None:
        """Redis' clock at ``t`` of this clock: the last TIME read, carried forward by this clock's
        seconds since. None before the first read, or past ``expiry_s`` since it: over a long
        outage the two clocks may drift apart or Redis may fail over to another host's, and a
        wrong date costs more than none (a live peer taken for dead by a starting replica)."""
        base = self._redis_ms_read
        elapsed = t - self._redis_ms_read_at
        if base is None or elapsed > self.view.expiry_s:
            return None
        return base + round(max(0.0, elapsed) * 1000)

    def _keep_ms(self) -> int:
        return max(60_000, int(self.view.expiry_s * 10_000))

    async def _sync_learned(self, state: RoutingState) -> bool:
        """Publish part of the outbox, read the peers' new batches when the last read is
        replayed, then replay a bounded share. False when the round trip failed."""
        await self._pack_journal(state)
        batches = self._to_send()
        read = not self._inbox and self._replayed >= len(self._replaying) and self._starts_known()
        ok = True
        if batches or read:
            ok = await self._learn_round_trip(state, batches, read)
        await self._replay(state)
        return ok

    async def _pack_journal(self, state: RoutingState) -> None:
        """Move the journal's notes into the outbox as rows. Every sync, Redis up or down: the
        journal's tuples (~40 bytes a block) then live one sync, the rows (8 bytes a block)
        as long as Redis needs, within the outbox's budget. Newest first, so that notes the
        budget would drop at once are never packed.

        Each batch names the URL of its rows' workers as this replica's fleet has them now, so
        a note older than this replica's forgetting of its worker (a reload moved the name to
        a new server, or the worker left or restarted, since the dispatch) is not packed: it
        would go out under the new URL about the old server's cache. And notes packed just
        after a reload changed which models are keyed by tokens may have been keyed either
        way: their batch goes out under no key, which every reader (older ones too) takes for
        sessions only."""
        journal = state.journal
        models = self._keyed_models()
        rekeyed = models != self._packed_models
        self._packed_models = models
        if journal is None or not journal:
            return
        # The key the notes were made under: `RoutingState.configure` empties the journal when
        # it changes, and nothing can between these two lines.
        key = () if rekeyed else state.key
        entries = journal.take(len(journal))
        budget = self.backlog_max * LEARNED_BACKLOG_BYTES_PER_ENTRY
        forgot = state.forgot_at
        rows: list[bytes] = []
        names: list[str] = []
        size = packed = taken = 0
        for e in reversed(entries):
            if rows and (size >= budget or len(rows) >= self.backlog_max):
                break
            taken += 1
            if forgot:
                f = forgot.get(e.worker)
                if f is not None and e.at < f:
                    continue
            row = pack_entry(e)
            rows.append(row)
            names.append(e.worker)
            size += len(row)
            packed += len(row)
            if packed >= LEARNED_BATCH_BYTES:  # a backlog of MBs: let requests in between
                packed = 0
                await asyncio.sleep(0)
        self.learned_dropped += len(entries) - taken
        del entries
        out = self._outbox
        tail = out[-1] if out else None
        if tail is not None and (tail.sent or tail.key != key or tail.models != models):
            tail = None
        workers = self.registry.workers
        for name, row in zip(reversed(names), reversed(rows), strict=True):
            w = workers.get(name)
            url = None if w is None else w.url
            if (
                tail is None
                or (tail.rows and tail.size + len(row) > LEARNED_BATCH_BYTES)
                or (url is not None and tail.urls.get(name, url) != url)
            ):
                self._batch_seq += 1
                tail = _Outgoing(self._batch_seq, key, models)
                out.append(tail)
            if url is not None:
                tail.urls[name] = url
            tail.rows.append(row)
            tail.size += len(row)
        self.outbox_bytes += size
        self._outbox_rows += len(rows)
        while len(out) > 1 and (self.outbox_bytes > budget or self._outbox_rows > self.backlog_max):
            b = out.popleft()
            self.outbox_bytes -= b.size
            self._outbox_rows -= len(b.rows)
            self.learned_dropped += len(b.rows)

    def _keyed_models(self) -> frozenset[str] | None:
        return None if self.token_models is None else frozenset(self.token_models())

    def _to_send(self) -> list[_Outgoing]:
        """The oldest batches, up to LEARNED_SEND_BYTES (at least one); only one while the
        learned round trip keeps failing, so it gets through on a slow link too."""
        limit = 0 if self._learn_streak else LEARNED_SEND_BYTES
        out: list[_Outgoing] = []
        size = 0
        for b in self._outbox:
            if out and size + b.size > limit:
                break
            out.append(b)
            size += b.size
        return out

    async def _learn_round_trip(
        self, state: RoutingState, batches: list[_Outgoing], read: bool
    ) -> bool:
        sent = self.clock()  # the policies' clock: entries' `at` are on it
        # Each batch under its own rows' key (`_Outgoing.key`), not the state's now.
        frames = [  # before the timeout
            frame_batch(b.key, b.rows, sent, b.urls, b.models) for b in batches
        ]
        count = self._read_count
        for b in batches:
            b.sent = True
        try:
            async with asyncio.timeout(self.op_timeout_s):
                pipe = self.client.pipeline(transaction=False)
                for b, frame in zip(batches, frames, strict=True):
                    pipe.xadd(
                        self.learn_key,
                        {"r": self.replica_id, "s": b.seq, "b": frame},
                        maxlen=self.learn_maxlen,
                        approximate=True,
                    )
                if batches:
                    pipe.pexpire(self.learn_key, self._keep_ms())
                if read:
                    pipe.xread({self.learn_key: self.learn_last_id}, count=count)
                    pipe.time()
                t_send = self.clock()
                res = await pipe.execute()
                t_recv = self.clock()
        except (RedisError, OSError, TimeoutError) as e:
            # The batches stay, under their seq: sent again, skipped by whoever has them.
            self.learned_failures += 1
            self._learn_streak += 1
            self._learn_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self._read_count = 1
            return False
        self._learn_streak = 0
        for b in batches:  # the outbox's head: only _pack_journal changes it, and it ran before
            self._outbox.popleft()
            self.outbox_bytes -= b.size
            self._outbox_rows -= len(b.rows)
            self.learned_published += len(b.rows)
        if read:
            i = len(batches) + (1 if batches else 0)
            # TIME ran somewhere between the send and the reply: their midpoint, so that a peer's
            # turn is placed neither always late nor always early on this clock.
            self._take_read(res[i], res[i + 1], count, (t_send + t_recv) / 2)
        return True

    def _starts_known(self) -> bool:
        """Whether a started replica may read the stream's history: every worker probed once
        (its process start known, or known to be unknowable), or LEARNED_PROBE_WAIT_S spent.
        Gateway.start starts the probes and this task together, and Redis answers before the
        workers do: a warm start replayed before the first probes credited a restarted worker
        with its earlier process's cache, notes that no later probe would make it forget."""
        until = self._probe_wait_until
        if until is None:
            return True
        if self.clock() < until and any(
            w.last_probe_at <= 0 and w.metrics.process_start is None
            for w in self.registry.workers.values()
        ):
            return False
        self._probe_wait_until = None
        return True

    def _take_read(self, read: Any, redis_time: Any, count: int, now: float) -> None:
        """Queue the batches just read for replay (this replica's own too, for their session
        notes: `SessionTable.learn`; not a re-send of a batch already taken), with when each
        was published on this clock (``now``: when Redis' ``TIME`` ran), and size the next read
        from this one."""
        if not read:
            self._read_count = min(LEARNED_READ_MAX, max(count, LEARNED_READ_START))
            return
        redis_ms = int(redis_time[0]) * 1000 + int(redis_time[1]) // 1000
        me = self.replica_id.encode()
        seen = self._seen
        n = size = 0
        for _stream, entries in read:
            for entry_id, fields in entries:
                self.learn_last_id = entry_id
                payload = fields.get(b"b", b"")
                n += 1
                size += len(payload)
                who = fields.get(b"r")
                seq = _seq(fields.get(b"s"))
                if who is not None and seq is not None:
                    if seq <= seen.get(who, 0):
                        self.learned_duplicates += 1
                        continue
                    seen.pop(who, None)  # most recent last: the oldest publisher goes first
                    seen[who] = seq
                    if len(seen) > LEARNED_SEEN_MAX:
                        del seen[next(iter(seen))]
                entry_ms = int(entry_id.split(b"-", 1)[0])
                age_s = max(0, redis_ms - entry_ms) / 1000
                self._inbox.append((payload, now - age_s, entry_ms / 1000, who == me))
        if size > LEARNED_READ_BYTES:
            self._read_count = max(1, count // 2)
        elif n >= count and size * 2 <= LEARNED_READ_BYTES:
            self._read_count = min(LEARNED_READ_MAX, count * 2)

    async def _replay(self, state: RoutingState) -> None:
        """Replay up to LEARNED_APPLY_MAX queued dispatches (LEARNED_APPLY_KEYS keys) into this
        replica's state, yielding the event loop after every LEARNED_APPLY_CHUNK dispatches or
        LEARNED_CHUNK_KEYS keys, within a stream entry too; the rest waits for the next sync.
        Bounded by keys, not dispatches alone: a KV-event mode dispatch of a 32k-token prompt
        carries 2048 worker-block keys, and one 1 MB entry of them (~125k keys) held the loop
        for ~0.2 s, 512 of them ~1 s."""
        self._verify_starts(state)
        budget, keys_left = LEARNED_APPLY_MAX, LEARNED_APPLY_KEYS
        while budget > 0 and keys_left > 0:
            rows = self._replaying
            if self._replayed >= len(rows):
                if not self._inbox:
                    self._replaying, self._replayed = [], 0
                    return
                raw, published, epoch, own = self._inbox.popleft()
                got = decode_frame(raw, None if own else published)
                if got is None:
                    self.learned_malformed += 1
                    continue
                learned = got.entries
                self._replaying, self._replayed = learned, 0
                self._replay_chains = got.key == state.key
                self._replay_urls = got.urls
                self._replay_models = got.token_models
                self._replay_own = own
                self._replay_epoch = epoch - published
                if learned and not own:
                    self.learned_lag.observe(self.clock() - min(e.at for e in learned))
                continue
            i = j = self._replayed
            end = min(len(rows), i + min(budget, LEARNED_APPLY_CHUNK))
            limit = min(keys_left, LEARNED_CHUNK_KEYS)
            keys = 0
            while j < end and keys < limit:  # at least one row, however large
                e = rows[j]
                if not self._replay_own:  # own rows: their session notes only
                    keys += len(e.chain) + len(e.block_chain)
                j += 1
            self._replayed = j
            budget -= j - i
            keys_left -= keys
            self._apply(state, rows[i:j])
            if budget > 0 and keys_left > 0 and (j < len(rows) or self._inbox):
                await asyncio.sleep(0)

    def _restart_slack_s(self) -> float:
        return LEARNED_RESTART_SLACK_S + self.op_timeout_s

    def _apply(self, state: RoutingState, chunk: list[Learned]) -> None:
        """One chunk of the batch being replayed. A worker whose process start is known takes
        only notes from after it (on this clock: ``start - epoch offset``); the notes a worker
        with none known yet takes are remembered (`_verify_starts`). A worker the batch names
        at another URL than this replica's fleet does is another server under the same name
        (a rollout moving it): its notes are skipped like an unknown worker's."""
        workers = self.registry.workers
        known: Container[str] = workers
        urls = self._replay_urls
        if urls:
            moved = {n for n, u in urls.items() if (w := workers.get(n)) is not None and w.url != u}
            if moved:
                known = workers.keys() - moved
        own = self._replay_own
        offset = self._replay_epoch
        slack = self._restart_slack_s()
        not_before: dict[str, float] = {}
        unknown: set[str] = set()
        for name, w in workers.items():
            started = w.metrics.process_start
            if started is None:
                unknown.add(name)
            else:
                not_before[name] = started + slack - offset
        n = apply_learned(
            state,
            chunk,
            known=known,
            with_chains=self._replay_chains,
            chainless=() if own else self._chainless(),
            not_before=not_before,
            own=own,
            concurrent_s=self.concurrent_s,
            on_error=self._row_failed,
        )
        if own:
            return
        self.learned_applied += n
        considered = 0
        forgot = state.forgot_at
        unverified = self._unverified
        for e in chunk:
            if e.worker not in known:
                continue
            considered += 1
            if unknown and e.worker in unknown and not e.done:
                if e.at < forgot.get(e.worker, float("-inf")):
                    continue
                t = e.at + offset
                if t < unverified.get(e.worker, float("inf")):
                    unverified[e.worker] = t
        self.learned_stale += considered - n

    def _chainless(self) -> frozenset[str]:
        """Workers whose notes' chains in the batch being replayed can mean nothing here: they
        serve a model that the publisher keys in token mode and this replica in text mode, or
        the reverse (a rollout of `[routing.token_mode]`). Per worker, since a note does not
        name its model: a worker serving such a model among others loses the others' chains
        too, and one whose models are not known yet (no probe answered) is left out as well,
        for as long as the two replicas disagree."""
        theirs = self._replay_models
        if theirs is None:
            return frozenset()
        mine = self._keyed_models()
        if mine is None or mine == theirs:
            return frozenset()
        differ = theirs ^ mine
        return frozenset(
            n for n, w in self.registry.workers.items() if not w.models or w.models & differ
        )

    def _row_failed(self, e: Learned, err: Exception) -> None:
        """A peer's note that decoded but could not be replayed: skipped and counted, the rest of
        its batch still applied. Before, it raised out of the sync, which lost the rest of the
        chunk and, from a peer that keeps writing such notes, logged a traceback a sync. Logged
        once a minute at most."""
        self.learned_malformed += 1
        now = self.clock()
        if now - self._row_error_logged_at < 60.0:
            return
        self._row_error_logged_at = now
        log.warning(
            "cluster: skipped another replica's note about worker %s that could not be "
            "replayed (%s: %s); kvgate_cluster_learned_malformed counts them",
            e.worker,
            type(err).__name__,
            err,
        )

    def _verify_starts(self, state: RoutingState) -> None:
        """Notes applied for a worker before its process start was known (a warm start that
        outran the first probe, a worker down since this replica started): once the start is
        known, if any of them is from before it, what peers taught of that worker goes (their
        share cannot be told from the rest; later notes are judged by the start), or a
        restarted worker would keep its earlier process's cache on this replica alone."""
        if not self._unverified:
            return
        workers = self.registry.workers
        slack = self._restart_slack_s()
        for name, earliest in list(self._unverified.items()):
            w = workers.get(name)
            if w is None:
                del self._unverified[name]
                continue
            started = w.metrics.process_start
            if started is None:
                continue
            del self._unverified[name]
            if earliest < started + slack:
                log.info(
                    "cluster: notes learned for worker %s predate its process start: "
                    "forgetting what they taught",
                    name,
                )
                state.forget_learned(name)

    def apply(self, now: float | None = None) -> None:
        """Set every worker's remote load from the live peers' sums (zero for the rest): what
        they run at this worker's name and URL, and what an older peer, which names no URL,
        runs under its name."""
        totals = self.view.site_totals(now)
        freed = False
        for w in self.registry.workers.values():
            i, t = totals.get((w.name, w.url), (0, 0))
            old = totals.get((w.name, None))
            if old is not None:
                i, t = i + old[0], t + old[1]
            if w.remote_in_flight != i or w.remote_prefill_tokens != t:
                freed |= i < w.remote_in_flight
                w.remote_in_flight, w.remote_prefill_tokens = i, t
        if freed and self.on_freed is not None:
            self.on_freed()

    def _down(self, e: BaseException) -> None:
        self.failures += 1
        if self.state == "degraded":
            return
        self.state = "degraded"
        self.outages += 1
        self.down_since = self.clock()
        log.warning(
            "cluster: Redis at %s unreachable (%s): routing on this replica's own load; other "
            "replicas' load lapses after %gs",
            redact_url(self.url),
            f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
            self.view.expiry_s,
        )

    def _up(self, now: float) -> None:
        was = self.state
        self.state = "ok"
        self.last_ok_at = now
        if was == "degraded":
            log.warning(
                "cluster: Redis at %s answers again after %.1fs; live peers: %d",
                redact_url(self.url),
                now - self.down_since,
                len(self.view.live(now)),
            )

    def sync_age_s(self) -> float | None:
        """Seconds since the last successful round trip (None before the first)."""
        return None if self.last_ok_at is None else self.clock() - self.last_ok_at


class ClusterCollector(Collector):
    """The cluster view, computed at scrape time (nothing per request or per tick)."""

    def __init__(self, sync: ClusterSync) -> None:
        self.sync = sync

    def collect(self) -> Iterator[Metric]:
        s = self.sync
        now = s.clock()
        info = GaugeMetricFamily(
            "kvgate_cluster_replica", "This gateway replica's id in the shared state", labels=["id"]
        )
        info.add_metric([s.replica_id], 1.0)
        yield info
        g = GaugeMetricFamily(
            "kvgate_cluster_state",
            "Shared load view: ok, degraded (Redis unreachable: local view only), starting",
            labels=["state"],
        )
        for st in STATES:
            g.add_metric([st], 1.0 if s.state == st else 0.0)
        yield g
        yield GaugeMetricFamily(
            "kvgate_cluster_replicas",
            "Gateway replicas in the shared load view, this one included (live heartbeats)",
            value=float(1 + len(s.view.live(now))),
        )
        age = s.sync_age_s()
        if age is not None:
            yield GaugeMetricFamily(
                "kvgate_cluster_sync_age_seconds",
                "Seconds since the last successful sync with Redis",
                value=age,
            )
        c = CounterMetricFamily(
            "kvgate_cluster_sync_failures", "Cluster syncs that Redis did not answer"
        )
        c.add_metric([], float(s.failures))
        yield c
        c = CounterMetricFamily(
            "kvgate_cluster_outages", "Times the shared load view went degraded (Redis down)"
        )
        c.add_metric([], float(s.outages))
        yield c
        if s.routing is not None:
            for name, doc, v in (
                (
                    "kvgate_cluster_learned_published",
                    "Dispatches this replica shared (prefix index entries, sessions)",
                    s.learned_published,
                ),
                (
                    "kvgate_cluster_learned_applied",
                    "Other replicas' dispatches learned by this replica",
                    s.learned_applied,
                ),
                (
                    "kvgate_cluster_learned_dropped",
                    "Dispatches never shared: the journal or its outbox was full (Redis down "
                    "for long)",
                    s.learned_dropped + (s.routing.journal.dropped if s.routing.journal else 0),
                ),
                (
                    "kvgate_cluster_learned_stale",
                    "Other replicas' dispatches skipped as about what routing forgot since: an "
                    "earlier process of a worker that restarted, or one removed",
                    s.learned_stale,
                ),
                (
                    "kvgate_cluster_learned_malformed",
                    "Peer batches skipped because they did not decode, and single notes of "
                    "theirs that could not be replayed",
                    s.learned_malformed,
                ),
                (
                    "kvgate_cluster_learned_duplicates",
                    "Peer batches skipped as re-sends of one already learned (a publish that "
                    "timed out after Redis stored it)",
                    s.learned_duplicates,
                ),
                (
                    "kvgate_cluster_learned_sync_failures",
                    "Learned-state round trips (publish, read) that Redis did not answer in time",
                    s.learned_failures,
                ),
            ):
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(v))
                yield c
            yield GaugeMetricFamily(
                "kvgate_cluster_learned_backlog_bytes",
                "This replica's packed dispatches waiting to be published (Redis down or slow)",
                value=float(s.outbox_bytes),
            )
        c = CounterMetricFamily(
            "kvgate_cluster_malformed_snapshots",
            "Peer snapshot fields that did not decode (another version, or garbage), each "
            "counted once",
        )
        c.add_metric([], float(s.view.malformed))
        yield c
        ifl = GaugeMetricFamily(
            "kvgate_cluster_remote_in_flight",
            "Requests other replicas have in flight on the worker",
            labels=["worker"],
        )
        pre = GaugeMetricFamily(
            "kvgate_cluster_remote_prefill_tokens",
            "Queued-prefill tokens of other replicas' requests on the worker",
            labels=["worker"],
        )
        for w in s.registry.workers.values():
            ifl.add_metric([w.name], float(w.remote_in_flight))
            pre.add_metric([w.name], float(w.remote_prefill_tokens))
        yield ifl
        yield pre
