"""Which worker holds which prefix blocks: the approximate index (what the gateway sent where).

Shape: ``hash -> bitmask of worker slots`` for lookups, plus one LRU per worker sized to what that
worker's KV cache can hold, so the index never claims more than a worker can keep. ``match``
answers, for every worker at once, how many leading blocks of a chain it holds.

The invariant that makes ``match`` cheap: every worker's set of blocks is *prefix-closed* (if it
holds block i of a chain it holds blocks 0..i-1). ``record`` keeps it by touching a chain tail
first, so a parent is always more recently used than any of its children and LRU eviction removes
children before parents (vLLM frees a finished request's blocks tail first for the same reason).
Along any chain the holder masks are then monotone (each a subset of the previous one), and
``match`` finds each worker's first miss by galloping + binary search instead of walking every
block: ~2*log2(n) lookups per distinct match length instead of n (3 us for a 256-entry chain over
64 workers). A KV-event fed ("precise") index may lack the property and would walk the chain; it
only has to offer the same ``match``.

Runs. A worker's LRU orders *runs*, not blocks: a run is a stretch of one chain recorded (touched)
together, its blocks in chain order, the deepest the least recent. That is the order a per-block
LRU would have, so eviction trims the oldest run from its deep end and the index holds exactly
what a block LRU would; but a prompt no worker holds costs one LRU entry instead of one per block
(the overhead ladder's unique ~4,000-character prompts: 62). A chain that shares only part of a
run splits it where they part: the shared head moves to the recent end as a run of its own, the
rest stays where it was. Each run carries the stamp of the record that last touched it, which is
what lets ``unrecord`` take back exactly what a refused request added and nobody has used since.

Time, recording a unique 62-block prompt at steady state (it evicts as much), quiet 2-core VM,
2026-11-25: 20 us with one worker and 35 us with six of 16,384 blocks, against 35 and 72 us with
an ``OrderedDict`` entry per block. The holder masks are still a dict entry per block, set and
cleared in one C-level pass (``map`` of ``setdefault`` / ``pop``; bytecode only for blocks another
worker also holds): callgrind counts ~106k instructions for that record and its eviction, ~122k
with a Python loop. What is left is memory-bound (cold dict entries) and grows with the fleet's
total index; a mypyc build of the per-block index measured the same as interpreted.

Memory, measured with tracemalloc on CPython 3.11 (tests/scoring/test_index.py keeps it honest):
at most ~190 bytes per (worker, block) entry when no other worker holds the block (holders-dict
slot and mask, the 64-bit hash int, its slot in its run), ~117 bytes when the block is shared. The
index is bounded by ``BYTES_PER_ENTRY * sum(capacities)``; ``max_capacity`` caps each worker
whatever it reports: 64 workers at the default 32,768-block cap (512k tokens each) is at most
~400 MB, at the 16,384-block default for workers that report nothing ~200 MB.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat

__all__ = ["BYTES_PER_ENTRY", "PrefixIndex"]

BYTES_PER_ENTRY = 200
"""Upper bound on memory per (worker, block) entry (measured ~190 B unshared, ~117 B shared)."""

# Record stamps, unique across every index of the process: a receipt from an index that a config
# reload replaced (``RoutingState.configure``) can never match a run of its successor.
_STAMPS = itertools.count(1)


def _let_go(holders: dict[int, int], hashes: list[int], bit: int) -> None:
    """A worker (``bit``) let go of ``hashes``: its bit leaves their holder masks. All popped in
    one C-level pass, and put back only where another worker still holds one: a block no one
    else holds (a prompt sent to one worker, the common case) costs one hash and lookup and no
    bytecode."""
    masks = list(map(holders.pop, hashes))
    if masks.count(bit) != len(masks):
        keep = ~bit
        for h, m in zip(hashes, masks, strict=True):
            if m != bit:
                holders[h] = m & keep


def _along(
    starts: dict[int, _Run], chain: Sequence[int], i: int, limit: int
) -> tuple[_Run | None, int]:
    """The run that starts at ``chain[i]`` and where, up to ``limit``, the chain stops agreeing
    with it: a block where one run ends, or where the chain parts from it, starts another, since
    each block lives in one run and a run is a stretch of a chain. Chained hashes make one
    compare of the run's last block enough when the whole run is shared."""
    run = starts.get(chain[i])
    if run is None:
        return None, i
    hs = run.hashes
    end = i + len(hs)
    if end <= limit and hs[-1] == chain[end - 1]:
        return run, end
    lo, hi = i + 1, end if end < limit else limit  # the last j with hs[:j - i] == chain[i:j]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if hs[mid - 1 - i] == chain[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return run, lo


class _Run:
    """A stretch of one chain a worker holds, touched together: ``hashes`` in chain order (the
    last is the least recently used), ``weights`` per entry in blocks or None when all are 1,
    ``weight`` their sum, ``stamp`` the record that last touched it."""

    __slots__ = ("hashes", "rid", "stamp", "weight", "weights")

    def __init__(
        self, rid: int, hashes: list[int], weights: list[int] | None, weight: int, stamp: int
    ) -> None:
        self.rid = rid
        self.hashes = hashes
        self.weights = weights
        self.weight = weight
        self.stamp = stamp


class PrefixIndex:
    """Approximate prefix index: hash -> workers; per-worker LRU bounded by KV capacity (blocks).

    Capacity is counted in blocks, not entries: an entry of a chain's tail (see
    ``scoring.prefix.tail_layout``) stands for the blocks of KV it spans and weighs that much.
    """

    def __init__(self, default_capacity: int = 16_384, max_capacity: int = 32_768) -> None:
        if default_capacity < 0 or max_capacity < 0:
            raise ValueError("capacities must be >= 0")
        self.default_capacity = default_capacity
        self.max_capacity = max_capacity
        self._holders: dict[int, int] = {}
        self._slot: dict[str, int] = {}
        self._names: list[str | None] = []
        self._lru: list[OrderedDict[int, _Run] | None] = []  # run id -> run, least recent first
        self._starts: list[dict[int, _Run] | None] = []  # a run's first hash -> the run
        self._used: list[int] = []  # blocks held per slot (sum of its runs' weights)
        self._count: list[int] = []  # entries held per slot
        self._cap: dict[str, int] = {}
        self._ids = itertools.count(1)  # run ids
        # Share of each worker's capacity in use, kept current for the scorer, which reads it for
        # every candidate of every decision (a dict read, not a method call).
        self.fill: dict[str, float] = {}

    # -- membership --------------------------------------------------------------------------
    def _slot_of(self, worker: str) -> int:
        slot = self._slot.get(worker)
        if slot is None:
            try:  # reuse a freed bit so masks stay small as workers come and go
                slot = self._names.index(None)
                self._names[slot] = worker
                self._lru[slot] = OrderedDict()
                self._starts[slot] = {}
                self._used[slot] = self._count[slot] = 0
            except ValueError:
                slot = len(self._names)
                self._names.append(worker)
                self._lru.append(OrderedDict())
                self._starts.append({})
                self._used.append(0)
                self._count.append(0)
            self._slot[worker] = slot
        return slot

    def workers(self) -> list[str]:
        return [n for n in self._names if n is not None]

    def capacity(self, worker: str) -> int:
        return min(self._cap.get(worker, self.default_capacity), self.max_capacity)

    def set_limits(self, default_capacity: int, max_capacity: int) -> None:
        """New budgets (a config reload): applied to every worker at once, its LRU trimmed and
        its ``fill`` restated, not at its next record (a worker that gets no traffic kept the old
        memory, and ``fill`` read against the old budget skewed the kv signal)."""
        self.default_capacity, self.max_capacity = default_capacity, max_capacity
        for name, slot in self._slot.items():
            self._evict_to(slot, self.capacity(name))

    def set_capacity(self, worker: str, blocks: int) -> None:
        """Resize a worker's budget; shrinking evicts its least recently used blocks at once."""
        self._cap[worker] = max(0, int(blocks))
        slot = self._slot.get(worker)
        if slot is not None:
            self._evict_to(slot, self.capacity(worker))

    def size(self, worker: str) -> int:
        """Blocks the index says ``worker`` holds (never more than its capacity)."""
        slot = self._slot.get(worker)
        return 0 if slot is None else self._used[slot]

    def entries(self, worker: str) -> int:
        slot = self._slot.get(worker)
        return 0 if slot is None else self._count[slot]

    def lru_entries(self, worker: str) -> list[tuple[int, int]]:
        """``(hash, weight)`` of every entry ``worker`` holds, least recently used first: what a
        per-block LRU would list, for comparing two indexes (replicas) by what they know."""
        slot = self._slot.get(worker)
        lru = None if slot is None else self._lru[slot]
        if not lru:
            return []
        out = []
        for run in lru.values():
            ws = run.weights
            hs = run.hashes
            out += [(hs[i], ws[i] if ws else 1) for i in range(len(hs) - 1, -1, -1)]
        return out

    def __len__(self) -> int:
        """Distinct entries held by any worker."""
        return len(self._holders)

    def clear(self, worker: str) -> None:
        """Forget what a worker holds (it restarted, or reset its prefix cache); keep capacity."""
        slot = self._slot.get(worker)
        if slot is not None:
            self._evict_to(slot, 0)

    def remove_worker(self, worker: str) -> None:
        """Forget a worker entirely and free its slot."""
        self.clear(worker)
        slot = self._slot.pop(worker, None)
        self._cap.pop(worker, None)
        self.fill.pop(worker, None)
        if slot is not None:
            self._names[slot] = None
            self._lru[slot] = None
            self._starts[slot] = None

    # -- updates -----------------------------------------------------------------------------
    def record(
        self, worker: str, chain: Sequence[int], *, dense: int = 0, tail_ends: Sequence[int] = ()
    ) -> tuple[int, int]:
        """The gateway sent ``chain`` to ``worker``: it holds (or will hold) those blocks now.

        With ``tail_ends`` (``scoring.prefix.tail_layout``) entries from index ``dense`` on are
        tail spans weighing the blocks they cover; without it every entry is one block. The new
        entries become one run, then the held head's runs are touched deepest first, so that the
        chain's head ends up most recently used (see the module docstring); a chain heavier than
        the worker's capacity keeps its head, the part other requests share.

        Returns the receipt ``(held, stamp)``: how many leading entries the worker held already,
        and this record's stamp (``unrecord`` takes it back with both).
        """
        cap = self.capacity(worker)
        if cap <= 0 or not chain:
            return len(chain), 0
        n = len(chain)
        if not tail_ends or n <= dense:
            dense, tail_ends = n, ()
        if (tail_ends[n - dense - 1] if tail_ends else n) > cap:
            n = cap if cap <= dense else dense + bisect.bisect_right(tail_ends, cap)
            chain = chain[:n]
            if n <= dense:
                dense, tail_ends = n, ()
        slot = self._slot_of(worker)
        lru = self._lru[slot]
        starts = self._starts[slot]
        assert lru is not None and starts is not None
        bit = 1 << slot
        holders = self._holders
        hget = holders.get
        # Prefix-closed: this worker holds exactly a leading run chain[:k] and none of chain[k:].
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) >> 1
            if hget(chain[mid], 0) & bit:
                lo = mid + 1
            else:
                hi = mid
        k = lo
        stamp = next(_STAMPS)
        if k < n:  # the new entries: one run, least recent of what this record touches
            hashes = chain[k:n]
            if type(hashes) is not list:
                hashes = list(hashes)
            weights: list[int] | None = None
            added = n - k
            if n > dense:  # tail spans, weighed in blocks
                weights = [1] * (dense - k) if k < dense else []
                for i in range(max(k, dense), n):
                    j = i - dense
                    weights.append(tail_ends[j] - (tail_ends[j - 1] if j else dense))
                added = sum(weights)
            # One C-level pass: a block no one else holds gets its mask (one hash and lookup);
            # the few held elsewhere get this worker's bit added after.
            masks = list(map(holders.setdefault, hashes, repeat(bit)))
            if masks.count(bit) != len(masks):
                for h, m in zip(hashes, masks, strict=True):
                    if m != bit:
                        holders[h] = m | bit
            run = _Run(next(self._ids), hashes, weights, added, stamp)
            lru[run.rid] = run
            starts[hashes[0]] = run
            self._used[slot] += added
            self._count[slot] += n - k
        if k:
            self._touch(lru, starts, chain, k, stamp)
        if self._used[slot] > cap:
            self._evict_to(slot, cap)
        self.fill[worker] = self._used[slot] / cap
        return k, stamp

    def _touch(
        self,
        lru: OrderedDict[int, _Run],
        starts: dict[int, _Run],
        chain: Sequence[int],
        k: int,
        stamp: int,
    ) -> None:
        """Make the held head ``chain[:k]`` the most recent runs, ``chain[0]``'s last: walked
        run by run (``_along``); a run the chain leaves inside (or whose held head ends inside
        it) is split there."""
        touched = []
        i = 0
        while i < k:
            run, j = _along(starts, chain, i, k)
            if run is None:  # cannot happen while the sets stay prefix-closed; never raise here
                break
            if j - i == len(run.hashes):
                run.stamp = stamp
                touched.append(run.rid)
            else:
                touched.append(self._split(lru, starts, run, j - i, stamp).rid)
            i = j
        move = lru.move_to_end
        for rid in reversed(touched):
            move(rid)

    def _split(
        self, lru: OrderedDict[int, _Run], starts: dict[int, _Run], run: _Run, m: int, stamp: int
    ) -> _Run:
        """Split ``run`` after its first ``m`` entries: the head becomes a new run (at the recent
        end, stamped ``stamp``); the rest keeps the run's place, id and stamp."""
        hs = run.hashes
        head_h, run.hashes = hs[:m], hs[m:]
        ws = run.weights
        if ws is None:
            head_w, weight = None, m
        else:
            head_w, run.weights = ws[:m], ws[m:]
            weight = sum(head_w)
        run.weight -= weight
        head = _Run(next(self._ids), head_h, head_w, weight, stamp)
        lru[head.rid] = head
        starts[head_h[0]] = head
        starts[run.hashes[0]] = run
        return head

    def unrecord(self, worker: str, chain: Sequence[int], receipt: tuple[int, int]) -> None:
        """Take back a ``record`` whose request the worker refused (a 4xx, or a 5xx before any
        work), given its receipt: the entries past the ``held`` head that the record added go,
        so the index does not credit the worker with a prompt it never computed, but only those
        no later record has touched since. A request that shared them (another turn on the same
        prefix) is computing them on that worker now, and taking them back from under it would
        leave its deeper blocks without their parents. What that record evicted stays evicted.
        """
        slot = self._slot.get(worker)
        held, stamp = receipt
        if slot is None or held >= len(chain):
            return
        lru = self._lru[slot]
        starts = self._starts[slot]
        assert lru is not None and starts is not None
        along: list[tuple[int, _Run]] = []  # (first position, run) along the chain's held head
        i, n = 0, len(chain)
        while i < n:
            run, j = _along(starts, chain, i, n)
            if run is None or j - i != len(run.hashes):
                break  # the chain leaves it inside: not this record's (it would have split it)
            along.append((i, run))
            i = j
        bit = 1 << slot
        holders = self._holders
        for i, run in reversed(along):
            if i < held or run.stamp != stamp:
                break  # touched since (so is all above it): another request holds it now
            del lru[run.rid]
            del starts[run.hashes[0]]
            self._used[slot] -= run.weight
            self._count[slot] -= len(run.hashes)
            _let_go(holders, run.hashes, bit)
        self._evict_to(slot, self.capacity(worker))  # nothing to evict: it restates the fill

    def _evict_to(self, slot: int, cap: int) -> None:
        """Drop least recently used entries until ``cap`` blocks are left: whole runs, then the
        deep end of the oldest one (its least recent entries)."""
        lru = self._lru[slot]
        starts = self._starts[slot]
        assert lru is not None and starts is not None
        used = self._used[slot]
        count = self._count[slot]
        bit = 1 << slot
        holders = self._holders
        while used > cap and lru:
            run = next(iter(lru.values()))
            hs = run.hashes
            ws = run.weights
            m = 0  # entries of it that stay: its head, when part of it fits
            if used - run.weight < cap:
                m = len(hs)
                if ws is None:
                    m -= used - cap
                else:
                    rest = used
                    while rest > cap:
                        m -= 1
                        rest -= ws[m]
            if m > 0:
                gone = hs[m:]
                del hs[m:]
                lost = len(gone) if ws is None else sum(ws[m:])
                if ws is not None:
                    del ws[m:]
                run.weight -= lost
            else:
                gone = hs
                lost = run.weight
                lru.popitem(last=False)
                del starts[hs[0]]
            used -= lost
            count -= len(gone)
            _let_go(holders, gone, bit)
        if not lru:
            used = count = 0
        self._used[slot] = used
        self._count[slot] = count
        name = self._names[slot]
        if name is not None:
            self.fill[name] = used / cap if cap else (1.0 if used else 0.0)

    # -- queries -----------------------------------------------------------------------------
    def holders(self, h: int) -> list[str]:
        m = self._holders.get(h, 0)
        names = self._names
        out = []
        while m:
            low = m & -m
            name = names[low.bit_length() - 1]
            if name is not None:
                out.append(name)
            m ^= low
        return out

    def match(self, chain: Sequence[int]) -> dict[str, int]:
        """Worker -> number of leading blocks of ``chain`` it holds (workers with none omitted).

        Galloping search over the monotone holder masks: for the set of workers still matching,
        find the last block they all hold, then split off the ones that miss the next block.
        """
        n = len(chain)
        if n == 0:
            return {}
        get = self._holders.get
        cur = get(chain[0], 0)
        if not cur:
            return {}
        out: dict[str, int] = {}
        names = self._names
        good = 0  # every worker in `cur` holds chain[0..good]
        while True:
            bad = n
            step = 1
            while good + step < n:
                probe = good + step
                if get(chain[probe], 0) & cur == cur:
                    good = probe
                    step <<= 1
                else:
                    bad = probe
                    break
            while bad - good > 1:
                mid = (good + bad) >> 1
                if get(chain[mid], 0) & cur == cur:
                    good = mid
                else:
                    bad = mid
            nxt = get(chain[bad], 0) & cur if bad < n else 0
            gone = cur & ~nxt
            while gone:
                low = gone & -gone
                name = names[low.bit_length() - 1]
                if name is not None:
                    out[name] = bad
                gone ^= low
            if not nxt:
                return out
            cur = nxt
            good = bad
