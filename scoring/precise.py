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
bound the blocks it stored first are dropped, so a worker that over-claims is under-credited.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence

from scoring.prefix import chain_hashes_tokens

__all__ = ["MAX_WORKER_BLOCKS", "OFFLOAD_SLACK", "PreciseIndex"]

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
        self.offload_weight = float(offload_weight)
        self.pending_ttl_s = float(pending_ttl_s)
        self.settle_s = float(settle_s)
        self.stale_after_s = float(stale_after_s)
        self.stale_after_dispatches = int(stale_after_dispatches)
        self.unkeyed: dict[str, int] = {}
        # key -> holder mask, two bits per slot: 2s = held (any tier), 2s+1 = held off-GPU only.
        self._holders: dict[int, int] = {}
        self._offl = 0  # (worker, key) pairs held off-GPU only: match skips the check when 0
        # key -> mask of slots (bit 2s) with an unexpired dispatch of that key.
        self._pending: dict[int, int] = {}
        # (expiry, seq, slot, keys): a heap, since dispatch_done moves expiries earlier.
        self._pq: list[tuple[float, int, int, Sequence[int]]] = []
        self._pseq = 0
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
        self._live: list[bool] = []
        self._last: list[float] = []  # time of the last event batch (or of going live)
        self._disp: list[int] = []  # dispatches since then
        # trusted() cache: valid while lo < now <= hi and nothing it depends on changed.
        self._trust: frozenset[str] | None = None
        self._tmask = 0
        self._trust_lo = float("-inf")
        self._trust_hi = float("inf")

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
            self._live.append(False)
            self._last.append(now)
            self._disp.append(0)
        self._names[slot] = worker
        self._cap[slot] = self.max_worker_blocks
        self._trimmed[slot] = 0
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
        """Forget every block (and pending dispatch) of ``worker``; liveness state is kept."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        both = 3 << (2 * slot)
        holders = self._holders
        refs = self._refs[slot]
        self._offl -= sum(1 for r in refs.values() if not r & _GPU_REFS)
        for key in refs:
            m = holders.get(key, 0) & ~both
            if m:
                holders[key] = m
            else:
                holders.pop(key, None)
        self._refs[slot] = {}
        self._e2k[slot] = {}
        self._drop_pending(slot, list(self._pexp[slot]))

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` entirely (blocks, pending, liveness, counters) and free its slot."""
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
        """Down to the slot's bound, first stored first out. A dict iterates in insertion order,
        so the oldest engine hashes are its first ones (a block gaining a tier keeps its place)."""
        e2k = self._e2k[slot]
        over = len(e2k) - self._cap[slot]
        if over <= 0:
            return
        name = self._names[slot]
        assert name is not None
        self.overflow[name] = self.overflow.get(name, 0) + over
        self._drop(slot, list(itertools.islice(e2k, over)), 3)
        # A dict iterates from its first slot, over every deleted entry: once the front is
        # mostly holes each trim would scan them all (3 ms per 2,048 blocks at 524,288), so
        # the dict is rebuilt, in order, every so often (~20 ms at that size).
        t = self._trimmed[slot] + over
        if t > max(4096, len(e2k) >> 3):
            self._e2k[slot] = dict(e2k)
            t = 0
        self._trimmed[slot] = t

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
        if self._disp[slot] >= self.stale_after_dispatches:
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
        need = self.stale_after_dispatches
        after = self.stale_after_s
        for slot, name in enumerate(self._names):
            if name is None or not self._live[slot]:
                continue
            if self._disp[slot] >= need:
                at = self._last[slot] + after
                if now > at:  # stale until an event batch arrives (or `now` runs backwards)
                    lo = max(lo, at)
                    continue
                hi = min(hi, at)
            names.append(name)
            mask |= 1 << (2 * slot)
        self._trust = t = frozenset(names)
        self._tmask = mask
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
            else:
                del e2k[eh]
                gone += 1
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
        for k in keys:
            pn.pop(k, None)
            if pexp.pop(k, None) is not None:
                m = pend[k] & keep
                if m:
                    pend[k] = m
                else:
                    del pend[k]

    def _sweep(self, now: float) -> None:
        q = self._pq
        pend = self._pending
        while q and q[0][0] <= now:
            _, _, slot, keys = heapq.heappop(q)
            pexp = self._pexp[slot]
            if not pexp:
                continue
            keep = ~(1 << (2 * slot))
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
        if d == self.stale_after_dispatches:
            self._invalidate()
        n = len(chain)
        if not n or self.pending_ttl_s <= 0:
            return
        even = 1 << (2 * slot)
        both = even | (even << 1)
        hget = self._holders.get
        i = 0
        while i < n and hget(chain[i], 0) & both == even:
            i += 1
        if i == n:
            return
        rest = chain[i:]  # a copy: the sweep must see the keys noted, whatever the caller does
        exp = now + self.pending_ttl_s
        pexp = self._pexp[slot]
        pn = self._pn[slot]
        pend = self._pending
        pget = pend.get
        nget = pn.get
        for k in rest:
            pexp[k] = exp
            pend[k] = pget(k, 0) | even
            pn[k] = nget(k, 0) + 1
        self._pseq += 1
        heapq.heappush(self._pq, (exp, self._pseq, slot, rest))

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
        exp = now + self.settle_s
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
            for k in moved:
                pexp[k] = exp
            self._pseq += 1
            heapq.heappush(self._pq, (exp, self._pseq, slot, moved))

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
