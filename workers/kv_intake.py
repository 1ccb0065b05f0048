"""KV events into the precise index: one subscriber per worker that publishes them.

`workers.kv_wire` (msgpack) and `workers.kv_events` (ZMQ, sequences, replay) speak the wire;
`scoring.precise` keeps the truth. This module is the seam between them: it turns a decoded
``BlockStored`` into the index's terms (the root seed of a chain is the model or LoRA the blocks
belong to plus the request's ``cache_salt``, exactly what the gateway seeds a token-mode request
with), and it keeps the set of subscribers equal to the set of configured workers across config
reloads.

Why the root seed is rebuilt from the event and not remembered per request: events arrive for
traffic this replica never routed (other replicas, direct clients), and every replica must key
them alike without talking to the others.

Why a health flap is not a reset. The prober sees a worker go from healthy to not healthy for
many reasons besides a restart: a TTFT outlier or the breaker ejecting it, one slow probe. The
same engine and the same event stream carry on meanwhile, and vLLM announces a block only once,
when it is computed (``kv_cache_report_mode="incremental"``): an index cleared then could only be
rebuilt from the publisher's replay buffer, and every hot prefix stored before it would be gone
for as long as it stays hot. So a flap only stops trusting the worker's events (``PreciseSink.
hold``; they are still applied); on its recovery the stream's continuity is checked as after a
reconnect (our last batch still in the replay, byte for byte, or else the next batch's sequence
number), which resets only on a gap or a new publisher. A new process start time (a restart the
probes saw) still resets at once.

Why the block size each worker's events are keyed at is kept (``scoring.precise.KeyedBlockSizes``):
a request's block chain is cut at one block size, and a worker keyed at another one cannot match
it; routing then uses the approximate index's figure for it instead.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from scoring.precise import PreciseIndex
from scoring.prefix import seed_for
from workers.kv_events import KVEventStats, KVEventSubscriber
from workers.kv_wire import (
    UNKEYABLE_LORA_NAME,
    UNKEYABLE_SALT,
    UNKEYABLE_SALT_UNKNOWN,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

__all__ = ["SKIP_REASONS", "SKIP_REASONS_RARE", "KVEndpoint", "KVEventFleet", "PreciseSink"]

log = logging.getLogger("kvgate.kv_events")

# What a worker's removals are filtered by until one of its stores names a full-attention group:
# a plain decoder has one group, 0, and releases before group_idx send none (decoded as 0).
_PLAIN_GROUPS: frozenset[int] = frozenset({0})

# Why a stored block was left out of the index; a fixed set, so a per-reason series per worker
# stays bounded (`kvgate_kv_events_skipped_total`).
SKIP_NOT_FULL_ATTENTION = "not_full_attention"  # a hybrid model's sliding-window/mamba group
SKIP_LORA_ID_ONLY = "lora_id_only"  # vLLM 0.11: an adapter by id, no name to seed its chain with
SKIP_UNKNOWN_MODEL = "unknown_model"  # the worker's served model is not known (yet)
SKIP_UNKNOWN_BLOCK_SIZE = "unknown_block_size"  # neither the event nor the worker's metrics say
SKIP_REASONS: tuple[str, ...] = (
    SKIP_NOT_FULL_ATTENTION,
    SKIP_LORA_ID_ONLY,
    SKIP_UNKNOWN_MODEL,
    SKIP_UNKNOWN_BLOCK_SIZE,
)
# Reasons a healthy, current vLLM never gives: exported once they happen, not as zeros from the
# start, so that every worker does not carry a series per reason that never moves.
SKIP_BAD_GROUP = "bad_group"  # a group_idx out of range, or more groups than an engine has
SKIP_SALT_UNKNOWN = UNKEYABLE_SALT_UNKNOWN  # vLLM 0.11: a first block whose salt is not sent
SKIP_SALT_TOO_LONG = UNKEYABLE_SALT  # longer than any salt vLLM accepts
SKIP_LORA_NAME_TOO_LONG = UNKEYABLE_LORA_NAME
SKIP_REASONS_RARE: tuple[str, ...] = (
    SKIP_BAD_GROUP,
    SKIP_SALT_UNKNOWN,
    SKIP_SALT_TOO_LONG,
    SKIP_LORA_NAME_TOO_LONG,
)
# vLLM has a KV-cache group per attention kind and layer pattern: a handful, never dozens. A
# group_idx past _MAX_GROUP_IDX, or a worker naming more than _MAX_GROUPS full-attention groups, is
# not an engine's layout; and every group learned rebuilds the worker's set, so an unbounded set
# made a batch of stores with distinct groups quadratic (40,000 of them held the loop for 44 s).
_MAX_GROUP_IDX = 63
_MAX_GROUPS = 16
# A batch is applied in steps of about this many blocks (events count one block at least), the
# event loop getting a turn in between (``PreciseSink.apply_steps``): a 4 MiB batch can carry
# 650,000 blocks of one token, ~1.5 s of keying and indexing in one piece.
APPLY_STEP_BLOCKS = 2048


@dataclass(frozen=True, slots=True)
class KVEndpoint:
    """Where a worker publishes its KV events (vLLM `--kv-events-config`)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class PreciseSink:
    """Applies a worker's decoded events to the precise index.

    ``model_of(worker)`` names the base model the worker serves (the seed of unsalted, non-LoRA
    chains); ``block_size_of(worker)`` is the fallback when an event carries no block size;
    ``capacity_of(worker)``, the KV blocks it reports (vLLM's num_gpu_blocks, 0 when unknown),
    bounds what its events may claim (``PreciseIndex.set_capacity``).
    """

    def __init__(
        self,
        index: PreciseIndex,
        model_of: Callable[[str], str | None],
        block_size_of: Callable[[str], int] = lambda _w: 0,
        clock: Callable[[], float] = time.monotonic,
        capacity_of: Callable[[str], int | None] = lambda _w: 0,
    ) -> None:
        self.index = index
        self.model_of = model_of
        self.block_size_of = block_size_of
        self.capacity_of = capacity_of
        self.clock = clock
        self.resets: Counter[tuple[str, str]] = Counter()  # (worker, reason)
        # (worker, one of SKIP_REASONS or SKIP_REASONS_RARE): stores that could not be indexed.
        # Exported, because a worker whose every store is skipped looks, from routing alone,
        # like a cold cache.
        self.skips: Counter[tuple[str, str]] = Counter()
        # worker -> the KV-cache groups its indexed stores came from (none yet: _PLAIN_GROUPS)
        self._groups: dict[str, frozenset[int]] = {}
        # Workers whose events do not say which salt a chain starts with (vLLM 0.11): nothing
        # they start can be keyed, so their precise state is empty and must not be trusted over
        # the gateway's own guess (`set_live`). _want_live: what their subscriber last said.
        self._saltless: set[str] = set()
        self._want_live: dict[str, bool] = {}
        # Workers whose events are not trusted whatever their subscriber says: held by the
        # fleet while the prober finds them not healthy (`KVEventFleet.note_probe`).
        self._held: set[str] = set()
        # Worker -> the block size its stores are keyed at, read by routing (`RoutingState`).
        self.block_sizes = index.keyed_sizes

    def apply(self, worker: str, events: Sequence[KVEvent]) -> None:
        for _ in self.apply_steps(worker, events):
            pass

    def apply_steps(self, worker: str, events: Sequence[KVEvent]) -> Iterator[None]:
        """``apply``, pausing (a ``yield``) after every ``APPLY_STEP_BLOCKS`` blocks or so, for a
        caller on the event loop to let others run: the subscriber (``workers.kv_events``) gives
        the loop a turn at each pause. The index may be read between steps: it then shows part
        of the batch, which is what it would show had the batch come in several."""
        idx = self.index
        now = self.clock()
        idx.touch(worker, now)
        cap = self.capacity_of(worker)
        if cap:
            idx.set_capacity(worker, cap)
        groups = self._groups.get(worker, _PLAIN_GROUPS)
        keyed_at = self.block_sizes.of.get(worker)
        step = APPLY_STEP_BLOCKS
        done = 0  # blocks (or events) since the last pause
        for ev in events:
            if done >= step:
                yield
                done = 0
            if isinstance(ev, BlockStored):
                n = len(ev.engine_hashes)
                done += n or 1
                if not ev.block_size and not ev.token_ids:
                    # vLLM's offload placeholder (OffloadingConnector with its default
                    # self_describing_kv_events off): a block the worker stored on GPU now also
                    # in ``medium``, by engine hash alone. It only adds a tier to a block already
                    # indexed, so it needs no model or block size; and it names no cache kind, so
                    # its group decides, as for a removal (the same hash is in every group).
                    if ev.group_idx in groups:
                        hashes = ev.engine_hashes
                        for i in range(0, n, step):
                            if i:
                                yield
                            idx.stored(worker, hashes[i : i + step], None, (), 0, 0, ev.medium, now)
                    continue
                if not ev.is_full_attention:
                    # hybrid models: only full attention is prefix KV
                    self.skips[(worker, SKIP_NOT_FULL_ATTENTION)] += 1
                    continue
                # The default is replaced by the first store even of group 0, so that a later
                # full-attention group adds to 0 rather than taking its place.
                if groups is _PLAIN_GROUPS or ev.group_idx not in groups:
                    learned = self._learn_group(worker, ev.group_idx)
                    if learned is None:
                        self.skips[(worker, SKIP_BAD_GROUP)] += 1
                        continue
                    groups = learned
                if ev.lora_id is not None and ev.lora_name is None and ev.unkeyable is None:
                    # vLLM 0.11 names the adapter by id only, and the id cannot be mapped to
                    # the name requests are seeded with: not the base model's blocks either.
                    self.skips[(worker, SKIP_LORA_ID_ONLY)] += 1
                    continue
                model = ev.lora_name or self.model_of(worker)
                bs = ev.block_size or self.block_size_of(worker)
                if model is None or bs <= 0:
                    why = SKIP_UNKNOWN_MODEL if model is None else SKIP_UNKNOWN_BLOCK_SIZE
                    self.skips[(worker, why)] += 1
                    continue
                if bs != keyed_at:
                    self.block_sizes.set(worker, bs)
                    keyed_at = bs
                seed: int | None
                if ev.unkeyable is None:
                    seed = seed_for(model, "", ev.cache_salt or "")
                    if ev.parent is None and worker in self._saltless:
                        self._salt_known(worker, now)
                else:
                    # Blocks this worker already holds keep their keys (a tier added, a run
                    # chained from them); the rest cannot be keyed by anyone's request.
                    seed = None
                    if ev.unkeyable == UNKEYABLE_SALT_UNKNOWN:
                        self._salt_unknown(worker, now)
                kept = 0
                parent = ev.parent
                hashes, tokens = ev.engine_hashes, ev.token_ids
                for i in range(0, n, step):
                    if i:
                        yield
                        parent = hashes[i - 1]
                    span = tokens[i * bs : (i + step) * bs] if n > step else tokens
                    kept += idx.stored(
                        worker, hashes[i : i + step], parent, span, bs, seed, ev.medium, now
                    )
                if ev.unkeyable is not None and kept < n:
                    self.skips[(worker, ev.unkeyable)] += 1
            elif isinstance(ev, BlockRemoved):
                # Only the groups indexed: vLLM reports an eviction per group, with the same
                # engine hash in every group that held the block.
                # In slices, as stores are: one event can name millions of hashes.
                hashes = ev.engine_hashes
                n = len(hashes)
                done += n or 1
                if ev.group_idx in groups:
                    for i in range(0, n or 1, step):
                        if i:
                            yield
                        idx.removed(worker, hashes[i : i + step], ev.medium, now)
            elif isinstance(ev, AllBlocksCleared):
                done += 1
                self.resets[(worker, "cleared")] += 1
                idx.clear(worker)

    def skip_counts(self, worker: str) -> dict[str, int]:
        """The worker's skipped stores by reason, every reason present (0 until one happens),
        so its series exist from the first scrape and the first skip shows as an increase; the
        rare reasons once they happened."""
        out = {why: self.skips[(worker, why)] for why in SKIP_REASONS}
        for why in SKIP_REASONS_RARE:
            n = self.skips.get((worker, why), 0)
            if n:
                out[why] = n
        return out

    @property
    def skipped(self) -> Counter[str]:
        """Stores skipped per worker, whatever the reason (`skips` has the reasons)."""
        out: Counter[str] = Counter()
        for (worker, _why), n in self.skips.items():
            out[worker] += n
        return out

    def _learn_group(self, worker: str, group: int) -> frozenset[int] | None:
        """Evictions are reported per KV-cache group, and in a hybrid model the full-attention
        group need not be group 0; only a store tells which groups hold prefix KV (vLLM puts
        the spec kind on stores, never on removals). None: not a group an engine has."""
        known = self._groups.get(worker)
        if not 0 <= group <= _MAX_GROUP_IDX or (known is not None and len(known) >= _MAX_GROUPS):
            return None
        groups = frozenset((group,)) if known is None else known | {group}
        self._groups[worker] = groups
        return groups

    def _salt_unknown(self, worker: str, now: float) -> None:
        if worker not in self._saltless:
            self._saltless.add(worker)
            log.warning(
                "kv events %s: stores carry no extra_keys (vLLM 0.11?): their salt is unknown, "
                "so the worker's chains are not indexed and its KV events not trusted",
                worker,
            )
            self.index.set_live(worker, False, now)

    def _salt_known(self, worker: str, now: float) -> None:
        """A chain's first blocks came with their extra keys: the worker (a newer engine after a
        restart, say) can be keyed again."""
        self._saltless.discard(worker)
        self.index.set_live(worker, self._live_now(worker), now)

    def forget(self, worker: str) -> None:
        """The worker's groups and block size describe one engine: a restart (or another
        server behind the name) may bring another layout, learned anew from its stores."""
        self._groups.pop(worker, None)
        self.block_sizes.drop(worker)

    def remove(self, worker: str) -> None:
        """The worker is no longer subscribed: its skip and reset counts go with it (its other
        per-worker series, read from its subscriber, go too), so names that come and go cannot
        pile up."""
        self.forget(worker)
        self._saltless.discard(worker)
        self._want_live.pop(worker, None)
        self._held.discard(worker)
        for counts in (self.skips, self.resets):
            for key in [k for k in counts if k[0] == worker]:
                del counts[key]

    def reset(self, worker: str, reason: str) -> None:
        self.resets[(worker, reason)] += 1
        self.index.clear(worker)
        self.forget(worker)

    def set_live(self, worker: str, live: bool) -> None:
        self._want_live[worker] = live
        self.index.set_live(worker, self._live_now(worker), self.clock())

    def hold(self, worker: str) -> None:
        """Do not trust the worker's events until ``release`` (they are still applied)."""
        if worker not in self._held:
            self._held.add(worker)
            self.index.set_live(worker, False, self.clock())

    def release(self, worker: str) -> None:
        """End a ``hold``: the worker is live again if its subscriber says it is."""
        if worker in self._held:
            self._held.discard(worker)
            self.index.set_live(worker, self._live_now(worker), self.clock())

    def held(self, worker: str) -> bool:
        return worker in self._held

    def _live_now(self, worker: str) -> bool:
        return (
            self._want_live.get(worker, False)
            and worker not in self._saltless
            and worker not in self._held
        )


class KVEventFleet:
    """The subscribers of every worker with a KV-events endpoint, kept in step with config."""

    def __init__(self, sink: PreciseSink) -> None:
        self.sink = sink
        self._subs: dict[str, tuple[KVEndpoint, KVEventSubscriber]] = {}
        # worker -> (was it healthy, its process start time) at the previous probe
        self._seen: dict[str, tuple[bool, float | None]] = {}

    @property
    def index(self) -> PreciseIndex:
        return self.sink.index

    def subscribed(self, worker: str) -> bool:
        return worker in self._subs

    @property
    def active(self) -> bool:
        """Any worker publishes events: requests need their per-block keys."""
        return bool(self._subs)

    async def sync(self, endpoints: Mapping[str, KVEndpoint]) -> None:
        """Start, restart (endpoint changed) or stop subscribers to match ``endpoints``."""
        for name in list(self._subs):
            ep, sub = self._subs[name]
            if endpoints.get(name) != ep:
                del self._subs[name]
                await sub.stop()
                self.sink.index.remove_worker(name)
                self.sink.remove(name)
        for name, ep in endpoints.items():
            if name in self._subs:
                continue
            sub = KVEventSubscriber(
                name,
                ep.endpoint,
                self.sink,
                replay_endpoint=ep.replay_endpoint,
                topic=ep.topic,
            )
            self._subs[name] = (ep, sub)
            await sub.start()
            log.info("kv events: subscribed to %s for %s", ep.endpoint, name)
        # Probe memory goes with the worker (probed workers not subscribed yet too), or every
        # name that ever came and went would stay.
        for name in [n for n in self._seen if n not in endpoints]:
            del self._seen[name]

    def note_probe(self, worker: str, healthy: bool, process_start: float | None) -> None:
        """A probe's outcome. A new process start time voids what the worker's events told us
        (a restarted engine's cache is empty). A health flap does not (module docstring): the
        worker's events are not trusted while it is not healthy, and its stream's continuity is
        checked when it is again (`_recovered`). A probe without the start time keeps the last
        one known, so that a later restart is still seen."""
        seen = self._seen.get(worker)
        if seen is None:
            self._seen[worker] = (healthy, process_start)
            return
        was_healthy, was_start = seen
        self._seen[worker] = (healthy, was_start if process_start is None else process_start)
        if was_start is not None and process_start is not None and was_start != process_start:
            self.sink.release(worker)  # reset: nothing left to verify
            self.resync(worker, "restart")
        elif was_healthy and not healthy:
            if worker in self._subs:
                self.sink.hold(worker)
        elif healthy and not was_healthy:
            self._recovered(worker)

    def resync(self, worker: str, reason: str) -> None:
        """The prober saw the worker restart: what we knew of its cache is void."""
        entry = self._subs.get(worker)
        if entry is not None:
            entry[1].resync(reason)

    def _recovered(self, worker: str) -> None:
        """Healthy again after a flap: its events are trusted again once its subscriber has
        checked that the stream went on (`KVEventSubscriber.verify_continuity`)."""
        if not self.sink.held(worker):
            return
        entry = self._subs.get(worker)
        if entry is not None:
            entry[1].verify_continuity()
        self.sink.release(worker)

    def stats(self) -> dict[str, KVEventStats]:
        return {name: sub.stats for name, (_ep, sub) in self._subs.items()}

    async def close(self) -> None:
        self._seen.clear()
        subs, self._subs = self._subs, {}
        for _ep, sub in subs.values():
            await sub.stop()
