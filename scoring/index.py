"""Which worker holds which prefix blocks: the approximate index (what the gateway sent where).

Shape: ``hash -> bitmask of worker slots`` for lookups, plus one LRU (an ``OrderedDict``) per
worker sized to what that worker's KV cache can hold, so the index never claims more than a worker
can keep. ``match`` answers, for every worker at once, how many leading blocks of a chain it holds.

The invariant that makes ``match`` cheap: every worker's set of blocks is *prefix-closed* (if it
holds block i of a chain it holds blocks 0..i-1). ``record`` keeps it by touching a chain tail
first, so a parent is always more recently used than any of its children and LRU eviction removes
children before parents (vLLM frees a finished request's blocks tail first for the same reason).
Along any chain the holder masks are then monotone (each a subset of the previous one), and
``match`` finds each worker's first miss by galloping + binary search instead of walking every
block: ~2*log2(n) lookups per distinct match length instead of n (3 us for a 256-entry chain over
64 workers). A KV-event fed ("precise") index may lack the property and would walk the chain; it
only has to offer the same ``match``.

Time: recording a prompt no worker holds (the overhead ladder's unique ~4,000-character
prompts: 62 entries, and as many evicted once the worker is full) is 35-60 us per request with one
worker and 72-92 us with six at 16,384 blocks each (2-core VM, 2026-11-25): cold dict and
OrderedDict entries, so memory-bound and growing with the fleet's total index. A mypyc-compiled
build of this module measured the same; fewer entries per request is the lever, not bytecode.

Memory, measured with tracemalloc on CPython 3.11 (tests/scoring/test_index.py keeps it honest):
~190 bytes per (worker, block) entry when no other worker holds the block (OrderedDict node and
slot, holders-dict slot and mask, the 64-bit hash int), ~117 bytes when the block is shared. The
index is bounded by ``BYTES_PER_ENTRY * sum(capacities)``; ``max_capacity`` caps each worker
whatever it reports: 64 workers at the default 32,768-block cap (512k tokens each) is at most
~400 MB, at the 16,384-block default for workers that report nothing ~200 MB.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Sequence

__all__ = ["BYTES_PER_ENTRY", "PrefixIndex"]

BYTES_PER_ENTRY = 200
"""Upper bound on memory per (worker, block) entry (measured ~190 B unshared, ~117 B shared)."""


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
        self._lru: list[OrderedDict[int, int] | None] = []  # hash -> weight in blocks
        self._used: list[int] = []  # blocks held per slot (sum of its LRU's weights)
        self._cap: dict[str, int] = {}
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
                self._used[slot] = 0
            except ValueError:
                slot = len(self._names)
                self._names.append(worker)
                self._lru.append(OrderedDict())
                self._used.append(0)
            self._slot[worker] = slot
        return slot

    def workers(self) -> list[str]:
        return [n for n in self._names if n is not None]

    def capacity(self, worker: str) -> int:
        return min(self._cap.get(worker, self.default_capacity), self.max_capacity)

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
        lru = None if slot is None else self._lru[slot]
        return 0 if lru is None else len(lru)

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

    # -- updates -----------------------------------------------------------------------------
    def record(
        self, worker: str, chain: Sequence[int], *, dense: int = 0, tail_ends: Sequence[int] = ()
    ) -> int:
        """The gateway sent ``chain`` to ``worker``: it holds (or will hold) those blocks now.

        With ``tail_ends`` (``scoring.prefix.tail_layout``) entries from index ``dense`` on are
        tail spans weighing the blocks they cover; without it every entry is one block. Touched tail
        first so that the chain's head ends up most recently used (see the module docstring); a
        chain heavier than the worker's capacity keeps its head, the part other requests share.

        Returns how many leading entries the worker held already (``unrecord`` takes it back).
        """
        cap = self.capacity(worker)
        if cap <= 0 or not chain:
            return len(chain)
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
        assert lru is not None
        # Prefix-closed: this worker holds exactly a leading run chain[:k] and none of chain[k:].
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) >> 1
            if chain[mid] in lru:
                lo = mid + 1
            else:
                hi = mid
        k = lo
        if k < n:  # new entries, tail first
            bit = 1 << slot
            holders = self._holders
            hget = holders.get
            added = 0
            for i in range(n - 1, max(k, dense) - 1, -1):  # tail spans, weighed in blocks
                h = chain[i]
                j = i - dense
                lru[h] = w = tail_ends[j] - (tail_ends[j - 1] if j else dense)
                holders[h] = hget(h, 0) | bit
                added += w
            if k < dense:
                for h in reversed(chain[k:dense]):
                    lru[h] = 1
                    holders[h] = hget(h, 0) | bit
                added += dense - k
            self._used[slot] += added
        if k:  # then the held head, so it ends up most recent; a C-level loop (hot prefixes)
            deque(map(lru.move_to_end, reversed(chain[:k])), 0)
        if self._used[slot] > cap:
            self._evict_to(slot, cap)
        self.fill[worker] = self._used[slot] / cap
        return k

    def unrecord(self, worker: str, chain: Sequence[int], held: int) -> None:
        """Take back a ``record`` whose request the worker refused (a 4xx, or a 5xx before any
        work): the entries past the ``held`` head it returned go, so the index does not credit
        the worker with a prompt it never computed. What that record evicted stays evicted; an
        entry another request sharing the chain recorded meanwhile goes too (it is back at that
        request's next turn)."""
        slot = self._slot.get(worker)
        lru = None if slot is None else self._lru[slot]
        if lru is None or held >= len(chain):
            return
        assert slot is not None
        keep = ~(1 << slot)
        holders = self._holders
        pop = lru.pop
        used = self._used[slot]
        for h in chain[held:]:
            w = pop(h, None)
            if w is None:
                continue
            used -= w
            m = holders.get(h, 0) & keep
            if m:
                holders[h] = m
            else:
                holders.pop(h, None)
        self._used[slot] = used
        self._evict_to(slot, self.capacity(worker))  # nothing to evict: it restates the fill

    def _evict_to(self, slot: int, cap: int) -> None:
        lru = self._lru[slot]
        assert lru is not None
        used = self._used[slot]
        keep = ~(1 << slot)
        holders = self._holders
        pop = lru.popitem
        while used > cap and lru:
            h, w = pop(last=False)
            used -= w
            m = holders[h] & keep
            if m:
                holders[h] = m
            else:
                del holders[h]
        self._used[slot] = used = used if lru else 0
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
