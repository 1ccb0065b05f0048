"""What each worker really holds, from its KV events: the *precise* prefix index.

Why a second index. The approximate index (``scoring.index``) records what the gateway *sent*
where and guesses eviction with an LRU sized to the worker's capacity. It is blind to what the
worker really did: evictions under memory pressure, a ``reset_prefix_cache``, a restart, blocks
offloaded to CPU, requests that reached the worker some other way. vLLM publishes exactly that as
KV events (BlockStored / BlockRemoved / AllBlocksCleared), so for a worker whose event stream is
connected and in sync this index is the truth and the policy should prefer it; for the others it
falls back to the guess (``trusted``).

Why our own keys. vLLM names a block by a hash whose function (sha256, sha256_cbor, xxhash, ...),
root seed (``PYTHONHASHSEED`` in older versions) and extra keys (LoRA, multimodal ids, salt) are
configuration and version dependent; reproducing it on the request path would break on the next
upgrade. Instead each event block is keyed the way the gateway keys a request: its token ids
chained from the parent's key (``chain_hashes_tokens`` seeded by the parent block's key, or by the
caller's root seed, which carries model, namespace and ``cache_salt``, for a first block). A prefix
then has the same key whether it came from a request or from an event, and the engine hash is only
ever used to find a block's key (its own, or its parent's) in a per-worker map.

Why pending. vLLM publishes BlockStored only after a request's prefill; until then the precise
index says the worker does not hold the prompt it is computing. Without a correction a burst of
requests sharing a new prefix would each look uncached everywhere and scatter over the fleet, each
worker computing the same prefix. ``note_dispatch`` counts a dispatched chain as held until the
real BlockStored arrives; ``dispatch_done`` (the first token came back, so the prefill's events are
out) cuts what is left to ``settle_s``, and ``pending_ttl_s`` bounds a dispatch whose first token
never comes. A fixed short TTL is wrong under load: a prefill queued behind others for 20 s would
lose its pending entry long before its events exist, and the next same-prefix requests scatter
(measured on the Mooncake replay at 5x rate: a 2 s TTL cut the hit rate from 11.4% to 6.7%).

Why the staleness rule. A connected subscriber can still be fed nothing: a publisher that stopped,
a filter or topic mismatch, a dropped socket that ZMQ does not report. Silence alone proves nothing
(an idle worker publishes nothing), and traffic alone proves nothing (short gaps between dispatch
and prefill). A worker that was sent ``stale_after_dispatches`` requests *and* published nothing for
``stale_after_s`` is not reporting, and its (frozen) precise state would mislead the policy more
than the guess would.

Why a walk. Unlike the approximate index, a worker's held set here is not prefix-closed (vLLM may
evict a parent before its child, and offloading moves blocks between tiers independently), so the
holder masks along a chain are not monotone and ``match`` walks the chain position by position,
stopping each worker at its first miss and the walk when no worker is left. Holder masks
interleave two bits per worker slot (bit ``2s``: held in some tier; bit ``2s+1``: held only in a
non-GPU tier), so a position costs one dict lookup, two with live pending entries.

Measured (CPython 3.11.7, shared 2-core machine, timeit best of 7): ``match`` over a 2,000-block
chain with 16 trusted workers, one holding its first 1,500 blocks and the others 25-375: ~100 us
(~145 us with pending entries live, ~210 us when 750 of the 1,500 are held off-GPU only: the walk
does only the bookkeeping that exists). ``stored`` of a 2,000-token event at block size 16 (125
blocks, hashing included): ~75 us. ``note_dispatch`` of a 2,000-block chain the worker does not
hold: ~150 us. A cached ``trusted``: ~0.07 us.

Memory (tracemalloc, 50k-block events at block size 16; ``tests/scoring/test_precise.py`` keeps it
honest): ~270 bytes per (worker, block) entry when no other worker holds the key, ~205 when two
workers share it, ~185 when 16 do, counting the engine-hash ints the index keeps alive (one above
2^63 is a 36-byte int) and each worker's own copy of the key int. 16 workers holding 100k blocks
each (1.6M tokens apiece) is ~300-430 MB; pending adds ~50-75 bytes per (worker, key) dispatched in
the last ``pending_ttl_s``. What a worker's events may make it hold is bounded (``set_capacity``:
its reported KV blocks times ``OFFLOAD_SLACK``, at most ``MAX_WORKER_BLOCKS``, ~140 MB); past the
bound blocks are dropped (``_trim``: those held only off GPU first, then first stored first out,
with a second chance for blocks dispatches were routed on), so a worker that over-claims is
under-credited. The pending heap is compacted, a slice at a time, while it references more than
twice the keys still pending (``_compact_some``), so its memory follows what is pending, not
every dispatch of the last ``pending_ttl_s``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence
from operator import and_, countOf, eq, not_, rshift, sub

from scoring.prefix import chain_hashes_tokens

__all__ = ["MAX_WORKER_BLOCKS", "OFFLOAD_SLACK", "KeyedBlockSizes", "PreciseIndex"]

# What one worker's events may make the index hold: they come from the worker, and nothing else
# bounds them (one 4 MiB batch can name 650,000 blocks of one token, ~270 bytes each here). An
# engine holds at most its GPU blocks plus what its offload tiers keep; with that unknown, the
# bound is the approximate index's largest capacity (32,768 blocks) times OFFLOAD_SLACK.
OFFLOAD_SLACK = 16
MAX_WORKER_BLOCKS = 32_768 * OFFLOAD_SLACK  # ~140 MiB of entries per worker at most

_MASK64 = (1 << 64) - 1
# Per-(worker, key) reference counts, packed in one int: engine hashes of this worker that map to
# the key and are held on GPU (low bits), or in another tier (from bit _OTHER_SHIFT on). The usual
# value (one engine hash, GPU) is 1, a cached small int.
_OTHER_SHIFT = 20
_OTHER = 1 << _OTHER_SHIFT
_GPU_REFS = _OTHER - 1
_GPU_MEDIA = frozenset({"GPU", "gpu"})


def _tier_bit(medium: str | None) -> int:
    """1 for the GPU tier (or an unnamed one), 2 for any other (CPU, disk, remote)."""
    return 1 if medium is None or medium in _GPU_MEDIA else 2


def _chain(token_ids: Sequence[int], block_size: int, seed: int, n: int) -> list[int] | None:
    """Keys of the ``n`` blocks of ``token_ids`` chained from ``seed``, or None if the ids do not
    cover them (or do not pack as uint32)."""
    if block_size <= 0 or len(token_ids) < n * block_size:
        return None
    try:
        keys = chain_hashes_tokens(token_ids, block_size=block_size, seed=seed, max_blocks=n)
    except (OverflowError, TypeError, ValueError):  # ids that do not pack as uint32
        return None
    return keys if len(keys) == n else None


def _key_tiers(refs: int) -> int:
    return (1 if refs & _GPU_REFS else 0) | (2 if refs >> _OTHER_SHIFT else 0)


# What dropping an engine hash in every tier takes from its key's refcounts, by ``value >> 64``
# of its e2k entry (0: GPU only, 1: another tier only, 2: both).
_DEC = (1, _OTHER, _OTHER + 1)
# Slack of the structures compacted from time to time (heap entries, second-chance keys).
_SLACK = 4096


def _consume(it: Iterable[object]) -> None:
    """Run an iterator of C-level calls (``map`` of a bound method) to its end."""
    deque(it, maxlen=0)


def _unmask(d: dict[int, int], keys: list[int], keep: int, every: bool) -> dict[int, int]:
    """``d[k] &= keep`` for every k of ``keys`` (all in ``d``), deleting the entries left 0;
    returns the dict to use from now on (``d`` or a new one).

    In bulk C-level calls, and touching each key twice at most: on dicts of 500k entries the
    cost is cache misses (~100-200 ns a lookup), not the interpreter. ``every``: ``keys`` are
    all the keys of ``d`` with bits outside ``keep``; when they are most of ``d`` a new dict is
    then built in one sequential pass instead (3x less than the lookups)."""
    rep = itertools.repeat
    if every and 2 * len(keys) >= len(d):
        masks = list(map(and_, d.values(), rep(keep)))
        return dict(itertools.compress(zip(d, masks, strict=True), masks))
    masks = list(map(and_, map(d.__getitem__, keys), rep(keep)))
    d.update(zip(itertools.compress(keys, masks), itertools.compress(masks, masks), strict=True))
    _consume(map(d.__delitem__, itertools.compress(keys, map(not_, masks))))
    return d


class KeyedBlockSizes:
    """The block size each worker's KV events are keyed at, for one precise index.

    A request's ``block_chain`` is cut at one block size (``RouteRequest.block_tokens``: the
    first candidate's in token mode, ``token_block_size`` for token-id prompts), while every
    worker's events are keyed at its own (``workers.kv_intake.PreciseSink``). A worker at another
    size can never match the chain; trusting its (empty) precise figure would also throw away
    what the approximate index learned of it, so ``RoutingState.matches`` leaves it out of
    ``trusted`` for that request. ``uniform`` makes that free for the usual fleet: the one size
    every known worker is keyed at (0: none known yet, -1: mixed sizes).
    """

    __slots__ = ("_count", "of", "uniform")

    def __init__(self) -> None:
        self.of: dict[str, int] = {}  # worker -> block size of its last keyed store
        self._count: Counter[int] = Counter()  # block size -> workers keyed at it
        self.uniform = 0

    def set(self, worker: str, block_size: int) -> None:
        old = self.of.get(worker)
        if old == block_size:
            return
        if old is not None:
            self._drop_count(old)
        self.of[worker] = block_size
        self._count[block_size] += 1
        self._settle()

    def drop(self, worker: str) -> None:
        old = self.of.pop(worker, None)
        if old is not None:
            self._drop_count(old)
            self._settle()

    def left_out(self, trusted: frozenset[str], block_size: float) -> frozenset[str]:
        """The ``trusted`` workers whose events are keyed at another block size than
        ``block_size`` (those not known yet are taken to be keyed at it)."""
        of = self.of
        return frozenset(w for w in trusted if of.get(w, block_size) != block_size)

    def _drop_count(self, size: int) -> None:
        n = self._count[size] - 1
        if n > 0:
            self._count[size] = n
        else:
            del self._count[size]

    def _settle(self) -> None:
        c = self._count
        self.uniform = next(iter(c)) if len(c) == 1 else (-1 if c else 0)


class PreciseIndex:
    """Per-worker blocks as reported by KV events, keyed by the gateway's own chained block keys.

    ``now`` is a monotonic clock in seconds supplied by the caller (pending entries expire in the
    order they were noted, so it must not run backwards).
    """

    def __init__(
        self,
        *,
        offload_weight: float = 0.5,
        pending_ttl_s: float = 300.0,
        settle_s: float = 1.0,
        stale_after_s: float = 10.0,
        stale_after_dispatches: int = 20,
        max_worker_blocks: int | None = None,
    ) -> None:
        self.max_worker_blocks = int(
            MAX_WORKER_BLOCKS if max_worker_blocks is None else max_worker_blocks
        )
        # Blocks dropped because a worker claimed more than its bound (`set_capacity`).
        self.overflow: dict[str, int] = {}
        # trusted() cache: valid while lo < now <= hi and nothing it depends on changed.
        self._trust: frozenset[str] | None = None
        self._tmask = 0
        self._tover = 0  # slots (bit s) that had reached stale_after_dispatches in the cache
        self._trust_lo = float("-inf")
        self._trust_hi = float("inf")
        # Read on every match, feeds no cached state: a plain attribute.
        self.offload_weight = float(offload_weight)
        # The other knobs are properties: a reload assigns them on the live index (Gateway.apply)
        # and what they decided already (the trusted() cache, the expiry of what is pending)
        # must follow.
        self._ttl = float(pending_ttl_s)
        self._settle = float(settle_s)
        self._recap_due = False  # pending_ttl_s or settle_s lowered: cap expiries at next sweep
        self._stale_s = float(stale_after_s)
        self._stale_n = int(stale_after_dispatches)
        self.unkeyed: dict[str, int] = {}
        # key -> holder mask, two bits per slot: 2s = held (any tier), 2s+1 = held off-GPU only.
        self._holders: dict[int, int] = {}
        # Worker -> the block size its events are keyed at (the sink sets it; routing reads it).
        self.keyed_sizes = KeyedBlockSizes()
        self._offl = 0  # (worker, key) pairs held off-GPU only: match skips the check when 0
        # key -> mask of slots (bit 2s) with an unexpired dispatch of that key.
        self._pending: dict[int, int] = {}
        # (expiry, seq, slot, keys): a heap, since dispatch_done moves expiries earlier. An entry
        # keeps its keys referenced after they stopped being pending (settled, stored, noted
        # again): _pq_keys counts the keys entries reference, _plive the (slot, key) entries
        # pending, and the heap is compacted when the first outgrows the second (_compact_some).
        self._pq: list[tuple[float, int, int, Sequence[int]]] = []
        self._pseq = 0
        self._pq_keys = 0
        self._pq_cur = 0  # where `_compact_some` goes on
        self._pq_empty = 0  # entries it left with no key (popped or rebuilt away)
        self._plive = 0
        self._slot: dict[str, int] = {}
        self._names: list[str | None] = []
        # Per slot. engine hash -> key, with the engine hash's tiers above bit 64 when it is not
        # GPU-only (value = key | (tiers - 1) << 64), so one dict entry serves both.
        self._e2k: list[dict[Hashable, int]] = []
        self._refs: list[dict[int, int]] = []  # key -> packed refcounts (see _OTHER_SHIFT)
        self._pexp: list[dict[int, float]] = []  # key -> pending expiry
        # key -> dispatches that noted it and are not done: one done (or refused) dispatch cuts
        # a key's expiry to settle_s only when no other is still waiting to prefill it.
        self._pn: list[dict[int, int]] = []
        self._cap: list[int] = []  # engine hashes the slot may hold (`set_capacity`)
        self._trimmed: list[int] = []  # engine hashes trimmed since its e2k was last compacted
        # Engine hashes held only off GPU, in the order they got so (stored off GPU, or evicted
        # from GPU while kept in another tier): what _trim drops first (dict as ordered set).
        self._offq: list[dict[Hashable, None]] = []
        self._offgone: list[int] = []  # deleted from _offq since it was last compacted
        # Keys of leading runs that dispatches were routed on (note_dispatch) since _trim last
        # passed them: an entry of such a key gets a second chance (moved to the back).
        self._used: list[set[int]] = []
        self._live: list[bool] = []
        self._last: list[float] = []  # time of the last event batch (or of going live)
        self._disp: list[int] = []  # dispatches since then

    # -- knobs (reloadable) ------------------------------------------------------------------
    @property
    def stale_after_s(self) -> float:
        return self._stale_s

    @stale_after_s.setter
    def stale_after_s(self, value: float) -> None:
        self._stale_s = float(value)
        self._invalidate()

    @property
    def stale_after_dispatches(self) -> int:
        return self._stale_n

    @stale_after_dispatches.setter
    def stale_after_dispatches(self, value: int) -> None:
        self._stale_n = int(value)
        self._invalidate()

    @property
    def pending_ttl_s(self) -> float:
        return self._ttl

    @pending_ttl_s.setter
    def pending_ttl_s(self, value: float) -> None:
        """Lowered: what is pending and not done expires at most this long after the next
        sweep (the expiries were set with the old TTL). Raised: only later dispatches get it."""
        value = float(value)
        if value < self._ttl:
            self._recap_due = True
        self._ttl = value

    @property
    def settle_s(self) -> float:
        return self._settle

    @settle_s.setter
    def settle_s(self, value: float) -> None:
        """As ``pending_ttl_s``, for what is settling (its dispatch is done)."""
        value = float(value)
        if value < self._settle:
            self._recap_due = True
        self._settle = value

    # -- membership --------------------------------------------------------------------------
    def _slot_of(self, worker: str, now: float = 0.0) -> int:
        slot = self._slot.get(worker)
        if slot is not None:
            return slot
        try:  # reuse a freed slot so masks stay small as workers come and go
            slot = self._names.index(None)
        except ValueError:
            slot = len(self._names)
            self._names.append(None)
            self._e2k.append({})
            self._refs.append({})
            self._pexp.append({})
            self._pn.append({})
            self._cap.append(0)
            self._trimmed.append(0)
            self._offq.append({})
            self._offgone.append(0)
            self._used.append(set())
            self._live.append(False)
            self._last.append(now)
            self._disp.append(0)
        self._names[slot] = worker
        self._cap[slot] = self.max_worker_blocks
        self._trimmed[slot] = 0
        self._offq[slot] = {}
        self._offgone[slot] = 0
        self._used[slot] = set()
        self._e2k[slot] = {}
        self._refs[slot] = {}
        self._pexp[slot] = {}
        self._pn[slot] = {}
        self._live[slot] = False
        self._last[slot] = now
        self._disp[slot] = 0
        self._slot[worker] = slot
        return slot

    def workers(self) -> list[str]:
        return [n for n in self._names if n is not None]

    def _invalidate(self) -> None:
        self._trust = None

    def clear(self, worker: str) -> None:
        """Forget every block (and pending dispatch) of ``worker``; liveness state is kept.

        In bulk C-level calls (``_unmask``): a Python loop per key held the event loop ~200 ms
        for a full worker (524,288 blocks); this takes a fraction of that."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        self._clear_held(slot)
        pexp = self._pexp[slot]
        if pexp:
            self._pending = _unmask(self._pending, list(pexp), ~(1 << (2 * slot)), True)
            self._plive -= len(pexp)
            self._pexp[slot] = {}
        self._pn[slot] = {}

    def _clear_held(self, slot: int) -> None:
        """``clear`` of the blocks (not the pending dispatches)."""
        refs = self._refs[slot]
        if refs:
            # keys held off-GPU only: no GPU refcount
            gpu = map(and_, refs.values(), itertools.repeat(_GPU_REFS))
            self._offl -= countOf(gpu, 0)
            self._holders = _unmask(self._holders, list(refs), ~(3 << (2 * slot)), True)
        self._refs[slot] = {}
        self._e2k[slot] = {}
        self._offq[slot] = {}
        self._offgone[slot] = 0
        self._trimmed[slot] = 0
        self._used[slot] = set()

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` entirely (blocks, pending, liveness, counters) and free its slot
        (its entries in the pending heap go at the next compaction)."""
        self.clear(worker)
        slot = self._slot.pop(worker, None)
        self.unkeyed.pop(worker, None)
        self.overflow.pop(worker, None)
        if slot is None:
            return
        self._names[slot] = None
        self._e2k[slot] = {}
        self._refs[slot] = {}
        self._pexp[slot] = {}
        self._pn[slot] = {}
        self._live[slot] = False
        self._disp[slot] = 0
        self._invalidate()

    def set_capacity(self, worker: str, num_blocks: int) -> None:
        """The KV blocks ``worker`` reports (vLLM's num_gpu_blocks; 0: unknown): its events may
        make the index hold ``num_blocks * OFFLOAD_SLACK`` blocks (GPU plus offload tiers), never
        more than ``max_worker_blocks``. Past it the blocks it stored first are dropped, as if
        evicted: an engine that claims more than it can hold is under-claimed, never trusted
        with more memory here."""
        slot = self._slot_of(worker)
        cap = self.max_worker_blocks
        if num_blocks > 0:
            cap = min(cap, num_blocks * OFFLOAD_SLACK)
        if cap != self._cap[slot]:
            self._cap[slot] = cap
            self._trim(slot)

    def capacity(self, worker: str) -> int:
        """Blocks the index will hold for ``worker`` at most."""
        slot = self._slot.get(worker)
        return self.max_worker_blocks if slot is None else self._cap[slot]

    def _trim(self, slot: int) -> None:
        """Down to the slot's bound. vLLM announces a block once (a hit, or a duplicate store,
        sends nothing that moves it), so first stored first out alone dropped the roots of the
        hottest chains first, and every request sharing one then matched nothing. The order:

        1. engine hashes held only off GPU (offload tiers), in the order they left the GPU (or
           were stored off it): the engine's own LRU evicted them from GPU first;
        2. the others first stored first out (a dict iterates in insertion order; a block
           gaining a tier keeps its place), except that an entry whose key a dispatch was routed
           on since (``note_dispatch``: the leading run the worker held on GPU) gets a second
           chance: it moves to the back once and its mark is used up (CLOCK). A prefix
           requests keep routing on stays; one nobody routes on goes in stored order.

        Amortised O(1) per entry: each move is paid by the dispatch that marked the key."""
        e2k = self._e2k[slot]
        over = len(e2k) - self._cap[slot]
        if over <= 0:
            return
        name = self._names[slot]
        assert name is not None
        self.overflow[name] = self.overflow.get(name, 0) + over
        if 2 * over > len(e2k):  # most of it goes (a smaller capacity): rebuild from the rest
            self._trim_rebuild(slot, over)
            return
        offq = self._offq[slot]
        if offq:
            victims = list(itertools.islice(offq, over))
            self._drop_all(slot, victims)
            over -= len(victims)
            gone = self._offgone[slot]
            if gone > max(_SLACK, len(offq) >> 3):  # holes at its front: as for e2k below
                self._offq[slot] = dict(offq)
                gone = 0
            self._offgone[slot] = gone
        used = self._used[slot]
        moved = 0
        dropped = 0
        while over > 0:
            batch = list(itertools.islice(e2k, over))
            if used:
                keys = list(map(and_, map(e2k.__getitem__, batch), itertools.repeat(_MASK64)))
                hot = list(map(used.__contains__, keys))
                if any(hot):
                    spared = list(itertools.compress(batch, hot))
                    for eh in spared:
                        e2k[eh] = e2k.pop(eh)  # to the back
                    used.difference_update(itertools.compress(keys, hot))
                    moved += len(spared)
                    batch = list(itertools.compress(batch, map(not_, hot)))
            self._drop_all(slot, batch)
            over -= len(batch)
            dropped += len(batch)
        # A dict iterates from its first slot, over every deleted entry: once the front is
        # mostly holes each trim would scan them all (3 ms per 2,048 blocks at 524,288), so
        # the dict is rebuilt, in order, every so often (~20 ms at that size).
        t = self._trimmed[slot] + dropped + moved
        if t > max(_SLACK, len(e2k) >> 3):
            self._e2k[slot] = dict(e2k)
            t = 0
        self._trimmed[slot] = t

    def _trim_rebuild(self, slot: int, over: int) -> None:
        """``_trim`` of more than half the slot (``set_capacity`` lowered: 508k of 524k entries
        took ~1 s one by one): clear it and record again what stays, the ``len(e2k) - over``
        last in trim order (off-GPU-only first, then stored order; second chances are not
        given here: the marks are dropped with the rest)."""
        e2k = self._e2k[slot]
        first = set(itertools.islice(self._offq[slot], over))
        order = itertools.filterfalse(first.__contains__, e2k) if first else iter(e2k)
        kept = list(itertools.islice(order, over - len(first), None))
        vals = list(map(e2k.__getitem__, kept))
        self._clear_held(slot)
        self._e2k[slot] = dict(zip(kept, vals, strict=True))
        self._offq[slot] = offq = {}
        refs = self._refs[slot]
        for eh, v in zip(kept, vals, strict=True):
            k, t = v & _MASK64, v >> 64
            refs[k] = refs.get(k, 0) + _DEC[t]
            if t == 1:
                offq[eh] = None
        even = 1 << (2 * slot)
        both = even | (even << 1)
        holders = self._holders
        hget = holders.get
        off = 0
        for k, r in refs.items():
            if r & _GPU_REFS:
                holders[k] = hget(k, 0) | even
            else:
                holders[k] = hget(k, 0) | both
                off += 1
        self._offl += off

    def _drop_all(self, slot: int, victims: list[Hashable]) -> None:
        """``_drop(slot, victims, 3)`` of engine hashes all mapped, in bulk C-level calls when
        their keys are distinct (the usual case: one engine hash per block)."""
        if not victims:
            return
        e2k = self._e2k[slot]
        vals = list(map(e2k.pop, victims))
        keys = list(map(and_, vals, itertools.repeat(_MASK64)))
        if len(set(keys)) != len(keys):  # several engine hashes of one key: one by one
            # put back (their place in e2k no longer matters) and dropped one by one
            e2k.update(zip(victims, vals, strict=True))
            self._drop(slot, victims, 3)
            return
        tiers = list(map(rshift, vals, itertools.repeat(64)))  # 0: GPU, 1: other, 2: both
        if 1 in tiers:
            offq = self._offq[slot]
            n0 = len(offq)
            _consume(
                map(
                    offq.pop,
                    itertools.compress(victims, map(eq, tiers, itertools.repeat(1))),
                    itertools.repeat(None),
                )
            )
            self._offgone[slot] += n0 - len(offq)
        refs = self._refs[slot]
        r0 = list(map(refs.__getitem__, keys))
        r1 = list(map(sub, r0, map(_DEC.__getitem__, tiers)))
        left = list(map(not_, r1))  # the key left the worker
        gone = list(itertools.compress(keys, left))
        if len(gone) < len(keys):
            stay = itertools.compress(keys, r1)
            refs.update(zip(stay, itertools.compress(r1, r1), strict=True))
        if gone:
            _consume(map(refs.__delitem__, gone))
            was_off = itertools.compress(r0, left)
            self._offl -= countOf(map(and_, was_off, itertools.repeat(_GPU_REFS)), 0)
            self._holders = _unmask(self._holders, gone, ~(3 << (2 * slot)), False)
        if len(gone) < len(keys):  # keys still held through another engine hash: rare
            even = 1 << (2 * slot)
            both = even | (even << 1)
            holders = self._holders
            for k, a, b in zip(keys, r0, r1, strict=True):
                if not b:
                    continue
                kt, kt0 = _key_tiers(b), _key_tiers(a)
                if kt != kt0:
                    self._offl += (kt == 2) - (kt0 == 2)
                    holders[k] = (holders.get(k, 0) & ~both) | (even if kt & 1 else both)

    # -- liveness ----------------------------------------------------------------------------
    def set_live(self, worker: str, live: bool, now: float = 0.0) -> None:
        """The worker's event intake is connected and in sync (True), or not (False).

        Going live restarts the staleness clock: the intake has just (re)synced.
        """
        slot = self._slot_of(worker, now)
        live = bool(live)
        if live and not self._live[slot]:
            self._last[slot] = now
            self._disp[slot] = 0
        if live != self._live[slot]:
            self._live[slot] = live
            self._invalidate()

    def touch(self, worker: str, now: float) -> None:
        """An event batch from ``worker`` arrived: it is reporting."""
        slot = self._slot_of(worker, now)
        if self._disp[slot] >= self._stale_n:
            self._invalidate()
        self._last[slot] = now
        self._disp[slot] = 0

    def trusted(self, now: float) -> frozenset[str]:
        """Workers whose precise state should be used: live, and not stale (module docstring)."""
        t = self._trust
        if t is not None and self._trust_lo < now <= self._trust_hi:
            return t
        lo, hi = float("-inf"), float("inf")
        names: list[str] = []
        mask = 0
        over = 0
        need = self._stale_n
        after = self._stale_s
        for slot, name in enumerate(self._names):
            if name is None or not self._live[slot]:
                continue
            if self._disp[slot] >= need:
                over |= 1 << slot
                at = self._last[slot] + after
                if now > at:  # stale until an event batch arrives (or `now` runs backwards)
                    lo = max(lo, at)
                    continue
                hi = min(hi, at)
            names.append(name)
            mask |= 1 << (2 * slot)
        self._trust = t = frozenset(names)
        self._tmask = mask
        self._tover = over
        self._trust_lo, self._trust_hi = lo, hi
        return t

    # -- events ------------------------------------------------------------------------------
    def stored(
        self,
        worker: str,
        engine_hashes: Sequence[Hashable],
        parent: Hashable | None,
        token_ids: Sequence[int],
        block_size: int,
        root_seed: int | None,
        medium: str | None = "GPU",
        now: float = 0.0,
    ) -> int:
        """BlockStored: key the blocks from their tokens and record them; returns blocks recorded.

        ``root_seed`` None: the chain's root cannot be keyed (the event does not say its salt),
        so a first block is recorded only if this worker's engine hash for it is mapped already.

        An engine hash already mapped keeps its key and only gains the tier, so it needs no
        tokens: vLLM's CPU-offload stores are by default placeholders (the hash, no token ids,
        block size 0, no parent) of blocks the worker stored on GPU first. Blocks that cannot be
        keyed (neither mapped nor keyable: parent engine hash unknown to this worker and no
        mapped block before them in the event, too few token ids, ids that are not uint32) are
        skipped and counted in ``unkeyed``.
        """
        slot = self._slot_of(worker, now)
        self.touch(worker, now)
        n = len(engine_hashes)
        if n == 0:
            return 0
        e2k = self._e2k[slot]
        keys = None
        if parent is None:
            seed = root_seed
        else:
            pv = e2k.get(parent)
            seed = None if pv is None else pv & _MASK64
        if seed is not None:
            keys = _chain(token_ids, block_size, seed, n)
        if keys is None:
            hashes, keys = self._known_run(e2k, engine_hashes, token_ids, block_size)
            if len(keys) < n:
                self.unkeyed[worker] = self.unkeyed.get(worker, 0) + n - len(keys)
            if not keys:
                return 0
            engine_hashes = hashes
        tb = _tier_bit(medium)
        inc = 1 if tb == 1 else _OTHER
        refs = self._refs[slot]
        even = 1 << (2 * slot)
        both = even | (even << 1)
        holders = self._holders
        hget = holders.get
        offq = self._offq[slot]
        for eh, key in zip(engine_hashes, keys, strict=True):
            v = e2k.get(eh)
            if v is None:
                k, t = key, 0
            else:
                k, t = v & _MASK64, (v >> 64) + 1
                if t & tb:
                    continue  # duplicate: already held in this tier
            t |= tb
            e2k[eh] = k if t == 1 else k | ((t - 1) << 64)
            if t == 2:  # stored off GPU only: first to trim
                offq[eh] = None
            elif t == 3 and tb == 1:  # back on GPU
                del offq[eh]
                self._offgone[slot] += 1
            r0 = refs.get(k, 0)
            refs[k] = r1 = r0 + inc
            kt = _key_tiers(r1)
            kt0 = _key_tiers(r0)
            if kt != kt0:
                self._offl += (kt == 2) - (kt0 == 2)
                m = (hget(k, 0) & ~both) | (even if kt & 1 else both)
                holders[k] = m
        if self._pending:
            self._drop_pending(slot, keys)
        if len(e2k) > self._cap[slot]:
            self._trim(slot)
        return len(keys)

    @staticmethod
    def _known_run(
        e2k: dict[Hashable, int],
        engine_hashes: Sequence[Hashable],
        token_ids: Sequence[int],
        block_size: int,
    ) -> tuple[list[Hashable], list[int]]:
        """The blocks of an event that cannot be keyed from its parent: those already mapped
        (their keys), and after a leading run of them the rest, keyed from the run's last block
        as their parent. (hashes, keys) of the blocks that can be recorded."""
        hashes: list[Hashable] = []
        keys: list[int] = []
        n = len(engine_hashes)
        i = 0
        while i < n:
            v = e2k.get(engine_hashes[i])
            if v is None:
                break
            hashes.append(engine_hashes[i])
            keys.append(v & _MASK64)
            i += 1
        if 0 < i < n and len(token_ids) >= n * block_size:
            rest = _chain(token_ids[i * block_size :], block_size, keys[-1], n - i)
            if rest is not None:
                return [*hashes, *engine_hashes[i:]], keys + rest
        for eh in engine_hashes[i:]:
            v = e2k.get(eh)
            if v is not None:
                hashes.append(eh)
                keys.append(v & _MASK64)
        return hashes, keys

    def removed(
        self,
        worker: str,
        engine_hashes: Sequence[Hashable],
        medium: str | None = None,
        now: float = 0.0,
    ) -> int:
        """BlockRemoved from ``medium`` (None: every tier); returns blocks that left the worker.

        A block leaves when no tier holds it any more; its engine hash is forgotten then, and its
        key when no other engine hash of this worker maps to it. Unknown hashes are ignored.
        """
        slot = self._slot_of(worker, now)
        self.touch(worker, now)
        return self._drop(slot, engine_hashes, 3 if medium is None else _tier_bit(medium))

    def _drop(self, slot: int, engine_hashes: Sequence[Hashable], rm: int) -> int:
        """``removed`` of the tiers in ``rm`` (bit 1: GPU, bit 2: any other)."""
        e2k = self._e2k[slot]
        refs = self._refs[slot]
        even = 1 << (2 * slot)
        both = even | (even << 1)
        holders = self._holders
        offq = self._offq[slot]
        gone = 0
        for eh in engine_hashes:
            v = e2k.get(eh)
            if v is None:
                continue
            k, t = v & _MASK64, (v >> 64) + 1
            drop = t & rm
            if not drop:
                continue
            t &= ~drop
            if t:
                e2k[eh] = k if t == 1 else k | ((t - 1) << 64)
                if t == 2:  # evicted from GPU, kept in another tier
                    offq[eh] = None
            else:
                del e2k[eh]
                gone += 1
                if drop == 2:  # was held off GPU only
                    del offq[eh]
                    self._offgone[slot] += 1
            r0 = refs[k]
            r1 = r0 - (1 if drop & 1 else 0) - (_OTHER if drop & 2 else 0)
            if r1:
                refs[k] = r1
            else:
                del refs[k]
            kt = _key_tiers(r1)
            kt0 = _key_tiers(r0)
            if kt != kt0:
                self._offl += (kt == 2) - (kt0 == 2)
                m = holders.get(k, 0) & ~both
                if kt:
                    m |= even if kt & 1 else both
                if m:
                    holders[k] = m
                else:
                    holders.pop(k, None)
        return gone

    # -- pending -----------------------------------------------------------------------------
    def _drop_pending(self, slot: int, keys: Sequence[int]) -> None:
        pexp = self._pexp[slot]
        if not pexp:
            return
        keep = ~(1 << (2 * slot))
        pend = self._pending
        pn = self._pn[slot]
        n0 = len(pexp)
        for k in keys:
            pn.pop(k, None)
            if pexp.pop(k, None) is not None:
                m = pend[k] & keep
                if m:
                    pend[k] = m
                else:
                    del pend[k]
        self._plive -= n0 - len(pexp)

    def _sweep(self, now: float) -> None:
        if self._recap_due:
            self._recap(now)
        q = self._pq
        if self._pq_keys > 2 * self._plive + _SLACK:  # a slice a query: drained while queried
            self._compact_some(_SLACK)
        if not q or q[0][0] > now:
            return
        pend = self._pending
        while q and q[0][0] <= now:
            _, _, slot, keys = heapq.heappop(q)
            if not keys:
                self._pq_empty -= 1
                continue
            self._pq_keys -= len(keys)
            pexp = self._pexp[slot]
            if not pexp:
                continue
            keep = ~(1 << (2 * slot))
            n0 = len(pexp)
            for k in keys:
                e = pexp.get(k)
                if e is not None and e <= now:  # a later dispatch of k may have extended it
                    del pexp[k]
                    self._pn[slot].pop(k, None)
                    m = pend[k] & keep
                    if m:
                        pend[k] = m
                    else:
                        del pend[k]
            self._plive -= n0 - len(pexp)

    def _push(self, exp: float, slot: int, keys: Sequence[int]) -> None:
        if type(keys) is not list:
            keys = list(keys)  # the heap's own: `_compact_some` filters it in place
        self._pseq += 1
        heapq.heappush(self._pq, (exp, self._pseq, slot, keys))
        n = len(keys)
        self._pq_keys += n
        if self._pq_keys > 2 * self._plive + _SLACK:
            self._compact_some(4 * n + _SLACK)

    def _compact_some(self, budget: int) -> None:
        """Filter, in place, the key lists of heap entries from a cursor on, each to the keys
        whose pending expiry is still its own (entries otherwise keep keys referenced long
        after they stopped pending: a dispatch's until its pending_ttl_s, 300 s, passed, even
        once done and settled or stored; 3,000 finished requests of 2,048 blocks held 298 MiB).
        At most ``budget`` keys looked at a call: the whole heap at once held the loop ~150 ms
        at 600k keys. Each push pays for four times its own keys, so the pass keeps up with
        what is pushed (amortised O(1) a key), and the heap references about twice the live
        keys at most, plus slack. Entries left empty stay until popped, unless they outnumber
        the rest: then the heap is rebuilt without them (O(entries), not keys)."""
        q = self._pq
        n = len(q)
        if not n:
            return
        i = self._pq_cur
        pexps = self._pexp
        rep = itertools.repeat
        removed = seen = 0
        while budget > 0 and seen < n:
            if i >= n:
                i = 0
            e, _seq, slot, keys = q[i]
            i += 1
            seen += 1
            m = len(keys)
            if not m:
                continue
            budget -= m
            pexp = pexps[slot]
            if not pexp:
                keys.clear()  # type: ignore[attr-defined]
                removed += m
                self._pq_empty += 1
                continue
            ok = list(map(eq, map(pexp.get, keys), rep(e)))  # its expiry is this entry's
            k = countOf(ok, True)
            if k != m:
                keys[:] = itertools.compress(keys, ok)  # type: ignore[index]
                removed += m - k
                self._pq_empty += not k
        self._pq_cur = i
        self._pq_keys -= removed
        if self._pq_empty > (n >> 1) + 64:
            q[:] = [x for x in q if x[3]]
            heapq.heapify(q)
            self._pq_empty = 0
            self._pq_cur = 0

    def _recap(self, now: float) -> None:
        """pending_ttl_s or settle_s was lowered: nothing pending expires later than it from
        now (still waiting for its first token: the TTL; done: settle_s)."""
        self._recap_due = False
        wait, done = now + self._ttl, now + self._settle
        for slot, pexp in enumerate(self._pexp):
            if not pexp:
                continue
            pn = self._pn[slot]
            a: list[int] = []
            b: list[int] = []
            for k, e in pexp.items():
                if k in pn:
                    if e > wait:
                        a.append(k)
                elif e > done:
                    b.append(k)
            for keys, exp in ((a, wait), (b, done)):
                if keys:
                    pexp.update(zip(keys, itertools.repeat(exp)))
                    self._push(exp, slot, keys)

    def pending_size(self) -> int:
        """(worker, key) pending entries alive now (before the next sweep): for tests, metrics."""
        return sum(len(p) for p in self._pexp)

    def note_dispatch(self, worker: str, chain: Sequence[int], now: float) -> None:
        """The gateway sent ``chain`` to ``worker``: count its blocks as held (see the module
        docstring: until BlockStored, ``dispatch_done`` + ``settle_s``, or ``pending_ttl_s``).

        The leading run the worker already holds on GPU is skipped (the worker reuses those blocks
        and publishes no BlockStored for them): only the part it will compute becomes pending.
        """
        slot = self._slot_of(worker, now)
        self._sweep(now)
        d = self._disp[slot] = self._disp[slot] + 1
        # >=, not ==: the threshold may have been lowered past the count (a reload); once the
        # cache accounts for the slot being past it, later dispatches change nothing in it.
        if d >= self._stale_n and not (self._tover >> slot) & 1:
            self._invalidate()
        n = len(chain)
        if not n:
            return
        even = 1 << (2 * slot)
        both = even | (even << 1)
        hget = self._holders.get
        i = 0
        while i < n and hget(chain[i], 0) & both == even:
            i += 1
        if i and 2 * len(self._e2k[slot]) > self._cap[slot]:
            # The run is routed on: second chance at the next trim (only marked once the
            # worker is half way to its bound; until then nothing is trimmed).
            used = self._used[slot]
            used.update(itertools.islice(chain, i))
            if len(used) > len(self._refs[slot]) + _SLACK:  # keys evicted since they were used
                used.intersection_update(self._refs[slot])
        if i == n or self._ttl <= 0:
            return
        rest = chain[i:]  # a copy: the sweep must see the keys noted, whatever the caller does
        exp = now + self._ttl
        pexp = self._pexp[slot]
        pn = self._pn[slot]
        pend = self._pending
        pget = pend.get
        nget = pn.get
        n0 = len(pexp)
        for k in rest:
            pexp[k] = exp
            pend[k] = pget(k, 0) | even
            pn[k] = nget(k, 0) + 1
        self._plive += len(pexp) - n0
        self._push(exp, slot, rest)

    def dispatch_done(self, worker: str, chain: Sequence[int], now: float) -> None:
        """The dispatch of ``chain`` produced its first token (or failed): its prefill's events
        are out, so what is still pending of it expires ``settle_s`` from now (their delivery),
        unless another dispatch of the same key to the same worker still waits to prefill it (a
        refused call had cut a concurrent one's pending to 1 s, and the prefix looked cold)."""
        slot = self._slot.get(worker)
        if slot is None or not chain:
            return
        pexp = self._pexp[slot]
        if not pexp:
            return
        exp = now + self._settle
        pn = self._pn[slot]
        moved = []
        for k in chain:
            c = pn.get(k, 0)
            if c > 1:  # another dispatch of it still waits to prefill: its pending stands
                pn[k] = c - 1
                continue
            if c:
                del pn[k]
            if pexp.get(k, exp) > exp:
                moved.append(k)
        if moved:
            pexp.update(zip(moved, itertools.repeat(exp)))
            self._push(exp, slot, moved)

    # -- queries -----------------------------------------------------------------------------
    def match(self, chain: Sequence[int], now: float) -> dict[str, int]:
        """Trusted worker -> effective number of leading blocks of ``chain`` it holds.

        Held in any tier or pending counts; a block held only off-GPU (and not pending) counts
        ``offload_weight``. Rounded down; workers with 0 omitted.
        """
        self._sweep(now)
        self.trusted(now)
        cur = self._tmask
        if not cur or not chain:
            return {}
        hget = self._holders.get
        pend = self._pending
        # off-GPU-only mask -> positions of the walk with that mask: a worker's deficit (blocks of
        # its run held off-GPU only) is the sum over the masks holding its bit; few distinct masks.
        deficit: dict[int, int] = {}
        out: dict[str, int] = {}
        # Three copies of one loop: the checks a position needs cost ~35% of the walk each, so
        # pending and off-GPU bookkeeping are only done while some exist.
        if not pend and not self._offl:
            for i, k in enumerate(chain):
                nxt = hget(k, 0) & cur
                if nxt != cur:
                    self._emit(out, cur & ~nxt, i, deficit)
                    if not nxt:
                        return out
                    cur = nxt
        elif not self._offl:
            pget = pend.get
            for i, k in enumerate(chain):
                nxt = (hget(k, 0) | pget(k, 0)) & cur
                if nxt != cur:
                    self._emit(out, cur & ~nxt, i, deficit)
                    if not nxt:
                        return out
                    cur = nxt
        else:
            pget = pend.get
            dget = deficit.get
            for i, k in enumerate(chain):
                v = hget(k, 0)
                p = pget(k, 0)
                nxt = (v | p) & cur
                if nxt != cur:
                    self._emit(out, cur & ~nxt, i, deficit)
                    if not nxt:
                        return out
                    cur = nxt
                off = (v >> 1) & cur & ~p
                if off:
                    deficit[off] = dget(off, 0) + 1
        self._emit(out, cur, len(chain), deficit)
        return out

    def _emit(self, out: dict[str, int], gone: int, run: int, deficit: dict[int, int]) -> None:
        names = self._names
        w = self.offload_weight
        while gone:
            low = gone & -gone
            s = low.bit_length() >> 1
            gone ^= low
            name = names[s]
            if name is None:
                continue
            d = sum(c for m, c in deficit.items() if m & low) if deficit else 0
            eff = run - d + int(d * w + 1e-9) if d else run
            if eff > 0:
                out[name] = eff

    # -- inspection --------------------------------------------------------------------------
    def blocks(self, worker: str) -> set[int]:
        """Keys ``worker`` holds in any tier (pending dispatches excluded)."""
        slot = self._slot.get(worker)
        return set() if slot is None else set(self._refs[slot])

    def size(self, worker: str) -> int:
        slot = self._slot.get(worker)
        return 0 if slot is None else len(self._refs[slot])

    def key_of(self, worker: str, engine_hash: Hashable) -> int | None:
        slot = self._slot.get(worker)
        if slot is None:
            return None
        v = self._e2k[slot].get(engine_hash)
        return None if v is None else v & _MASK64
