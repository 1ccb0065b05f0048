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
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from scoring.precise import PreciseIndex
from scoring.prefix import seed_for
from workers.kv_events import KVEventStats, KVEventSubscriber
from workers.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["SKIP_REASONS", "KVEndpoint", "KVEventFleet", "PreciseSink"]

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


@dataclass(frozen=True, slots=True)
class KVEndpoint:
    """Where a worker publishes its KV events (vLLM `--kv-events-config`)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class PreciseSink:
    """Applies a worker's decoded events to the precise index.

    ``model_of(worker)`` names the base model the worker serves (the seed of unsalted, non-LoRA
    chains); ``block_size_of(worker)`` is the fallback when an event carries no block size.
    """

    def __init__(
        self,
        index: PreciseIndex,
        model_of: Callable[[str], str | None],
        block_size_of: Callable[[str], int] = lambda _w: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.model_of = model_of
        self.block_size_of = block_size_of
        self.clock = clock
        self.resets: Counter[tuple[str, str]] = Counter()  # (worker, reason)
        # (worker, one of SKIP_REASONS): stores that could not be indexed. Exported, because a
        # worker whose every store is skipped looks, from routing alone, like a cold cache.
        self.skips: Counter[tuple[str, str]] = Counter()
        # worker -> the KV-cache groups its indexed stores came from (none yet: _PLAIN_GROUPS)
        self._groups: dict[str, frozenset[int]] = {}

    def apply(self, worker: str, events: Sequence[KVEvent]) -> None:
        idx = self.index
        now = self.clock()
        idx.touch(worker, now)
        groups = self._groups.get(worker, _PLAIN_GROUPS)
        for ev in events:
            if isinstance(ev, BlockStored):
                if not ev.block_size and not ev.token_ids:
                    # vLLM's offload placeholder (OffloadingConnector with its default
                    # self_describing_kv_events off): a block the worker stored on GPU now also
                    # in ``medium``, by engine hash alone. It only adds a tier to a block already
                    # indexed, so it needs no model or block size; and it names no cache kind, so
                    # its group decides, as for a removal (the same hash is in every group).
                    if ev.group_idx in groups:
                        idx.stored(worker, ev.engine_hashes, None, (), 0, 0, ev.medium, now)
                    continue
                if not ev.is_full_attention:
                    # hybrid models: only full attention is prefix KV
                    self.skips[(worker, SKIP_NOT_FULL_ATTENTION)] += 1
                    continue
                # The default is replaced by the first store even of group 0, so that a later
                # full-attention group adds to 0 rather than taking its place.
                if groups is _PLAIN_GROUPS or ev.group_idx not in groups:
                    groups = self._learn_group(worker, ev.group_idx)
                if ev.lora_id is not None and ev.lora_name is None:
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
                idx.stored(
                    worker,
                    ev.engine_hashes,
                    ev.parent,
                    ev.token_ids,
                    bs,
                    seed_for(model, "", ev.cache_salt or ""),
                    ev.medium,
                    now,
                )
            elif isinstance(ev, BlockRemoved):
                # Only the groups indexed: vLLM reports an eviction per group, with the same
                # engine hash in every group that held the block.
                if ev.group_idx in groups:
                    idx.removed(worker, ev.engine_hashes, ev.medium, now)
            elif isinstance(ev, AllBlocksCleared):
                self.resets[(worker, "cleared")] += 1
                idx.clear(worker)

    def skip_counts(self, worker: str) -> dict[str, int]:
        """The worker's skipped stores by reason, every reason present (0 until one happens),
        so its series exist from the first scrape and the first skip shows as an increase."""
        return {why: self.skips[(worker, why)] for why in SKIP_REASONS}

    @property
    def skipped(self) -> Counter[str]:
        """Stores skipped per worker, whatever the reason (`skips` has the reasons)."""
        out: Counter[str] = Counter()
        for (worker, _why), n in self.skips.items():
            out[worker] += n
        return out

    def _learn_group(self, worker: str, group: int) -> frozenset[int]:
        """Evictions are reported per KV-cache group, and in a hybrid model the full-attention
        group need not be group 0; only a store tells which groups hold prefix KV (vLLM puts
        the spec kind on stores, never on removals)."""
        known = self._groups.get(worker)
        groups = frozenset((group,)) if known is None else known | {group}
        self._groups[worker] = groups
        return groups

    def forget(self, worker: str) -> None:
        """The worker's groups describe one engine: a restart (or another server behind the
        name) may bring another layout, learned anew from its stores."""
        self._groups.pop(worker, None)

    def remove(self, worker: str) -> None:
        """The worker is no longer subscribed: its skip and reset counts go with it (its other
        per-worker series, read from its subscriber, go too), so names that come and go cannot
        pile up."""
        self.forget(worker)
        for counts in (self.skips, self.resets):
            for key in [k for k in counts if k[0] == worker]:
                del counts[key]

    def reset(self, worker: str, reason: str) -> None:
        self.resets[(worker, reason)] += 1
        self.index.clear(worker)
        self.forget(worker)

    def set_live(self, worker: str, live: bool) -> None:
        self.index.set_live(worker, live, self.clock())


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

    def note_probe(self, worker: str, healthy: bool, process_start: float | None) -> None:
        """A probe's outcome: a health flap or a new process start time voids what the worker's
        events told us (a restarted engine's cache is empty; a flap may have lost events)."""
        seen = self._seen.get(worker)
        self._seen[worker] = (healthy, process_start)
        if seen is None:
            return
        if seen[0] and not healthy:
            self.resync(worker, "health")
        elif seen[1] is not None and process_start is not None and seen[1] != process_start:
            self.resync(worker, "restart")

    def resync(self, worker: str, reason: str) -> None:
        """The prober saw the worker restart or flap: what we knew of its cache is void."""
        entry = self._subs.get(worker)
        if entry is not None:
            entry[1].resync(reason)

    def stats(self) -> dict[str, KVEventStats]:
        return {name: sub.stats for name, (_ep, sub) in self._subs.items()}

    async def close(self) -> None:
        subs, self._subs = self._subs, {}
        for _ep, sub in subs.values():
            await sub.stop()
