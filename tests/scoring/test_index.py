from __future__ import annotations

import gc
import random
import tracemalloc
from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scoring.index import BYTES_PER_ENTRY, PrefixIndex
from scoring.prefix import chain_hashes_tokens, seed_for, tail_layout

SEED = seed_for("m")


def ids_chain(*segments: int, block: int = 4) -> list[int]:
    """A chain whose blocks are the given segment ids (equal leading ids -> shared prefix)."""
    tokens = [t for s in segments for t in [s] * block]
    return chain_hashes_tokens(tokens, block_size=block, seed=SEED, max_blocks=10_000)


def test_match_returns_each_workers_longest_leading_run() -> None:
    idx = PrefixIndex()
    full = ids_chain(1, 2, 3, 4, 5, 6)
    idx.record("a", full[:2])
    idx.record("b", full)
    idx.record("c", ids_chain(1, 2, 3, 9))  # shares 3 blocks, then diverges
    idx.record("d", ids_chain(7, 2, 3))  # nothing in common: a different first block
    assert idx.match(full) == {"a": 2, "b": 6, "c": 3}
    assert idx.match(ids_chain(1, 2, 3, 4, 5, 6, 7, 8)) == {"a": 2, "b": 6, "c": 3}
    assert idx.match(ids_chain(8)) == {}
    assert idx.match([]) == {}


def test_match_stops_at_the_first_miss_even_if_later_blocks_are_held() -> None:
    idx = PrefixIndex()
    c = ids_chain(1, 2, 3, 4)
    # A hole can only come from outside the index's own bookkeeping; match must still stop there.
    idx.record("a", c)
    idx.record("b", c[:1])
    assert idx.match(c) == {"a": 4, "b": 1}
    assert idx.match([c[0], 12345, c[2], c[3]]) == {"a": 1, "b": 1}


def test_eviction_keeps_each_worker_within_capacity_and_drops_least_recent_first() -> None:
    idx = PrefixIndex(default_capacity=6)
    old, mid, new = ids_chain(1, 2, 3), ids_chain(4, 5, 6), ids_chain(7, 8, 9)
    idx.record("a", old)
    idx.record("a", mid)
    idx.record("a", old)  # touch: `old` is now more recent than `mid`
    idx.record("a", new)
    assert idx.size("a") == 6
    m = idx.match
    assert m(old) == {"a": 3} and m(new) == {"a": 3} and m(mid) == {}
    assert len(idx) == 6


def test_partial_eviction_removes_a_chains_tail_before_its_head() -> None:
    idx = PrefixIndex(default_capacity=5)
    first = ids_chain(1, 2, 3, 4)
    idx.record("a", first)
    idx.record("a", ids_chain(9, 8))  # needs 2 blocks: 1 must go
    assert idx.match(first) == {"a": 3}  # the tail went, the head still matches


def test_a_chain_longer_than_capacity_keeps_its_head() -> None:
    idx = PrefixIndex(default_capacity=3)
    c = ids_chain(1, 2, 3, 4, 5)
    idx.record("a", c)
    assert idx.size("a") == 3 and idx.match(c) == {"a": 3}


def test_unrecord_takes_back_what_a_refused_record_added_and_keeps_the_held_head() -> None:
    idx = PrefixIndex(default_capacity=100)
    shared = ids_chain(1, 2)
    idx.record("a", shared)
    idx.record("b", shared)
    long = ids_chain(1, 2, 3, 4, 5)
    receipt = idx.record("a", long)
    assert receipt[0] == 2 and idx.match(long) == {"a": 5, "b": 2} and idx.size("a") == 5
    idx.unrecord("a", long, receipt)  # the worker refused it: only the new tail goes
    assert idx.match(long) == {"a": 2, "b": 2} and idx.size("a") == 2
    assert idx.fill["a"] == 2 / 100 and idx.holders(long[4]) == []
    assert idx.record("a", long)[0] == 2  # and it can be learned again
    assert idx.record("c", [])[0] == 0 and idx.record("c", long)[0] == 0
    idx.unrecord("never-seen", long, (0, 1))  # a worker it knows nothing of: nothing to take back


def test_unrecord_keeps_what_a_later_request_shares_so_no_block_loses_its_parent() -> None:
    # B is sent first and refused only after A, sharing B's first two blocks, went to the same
    # worker: A computes those two itself, so they stay; only B's own third block goes. Taking
    # all three back left A's blocks 3-4 without their parents, and A's next record raised.
    idx = PrefixIndex(default_capacity=100)
    b, a = ids_chain(1, 2, 5), ids_chain(1, 2, 3, 4)
    receipt_b = idx.record("w", b)
    assert idx.record("w", a)[0] == 2
    idx.unrecord("w", b, receipt_b)
    assert idx.match(a) == {"w": 4} and idx.match(b) == {"w": 2} and idx.size("w") == 4
    assert idx.record("w", a)[0] == 4 and idx.entries("w") == 4
    # a record that touched the refused one's blocks since (a retry of the same prompt) keeps them
    receipt = idx.record("w", b)
    idx.record("w", b)
    idx.unrecord("w", b, receipt)
    assert idx.match(b) == {"w": 3}


def test_a_run_split_where_two_chains_part_keeps_block_lru_order() -> None:
    idx = PrefixIndex(default_capacity=6)
    x, y = ids_chain(1, 2, 3, 4), ids_chain(1, 2, 9)
    idx.record("a", x)  # one run: 1 2 3 4
    idx.record("a", y)  # splits it: [1 2] recent, [3 4] stays older than y's [9]
    assert idx.entries("a") == 5 and idx.match(x) == {"a": 4}
    idx.record("a", ids_chain(7, 7, 7))  # needs 3 blocks, 2 must go: 4 and 3 (the oldest)
    assert idx.match(x) == {"a": 2} and idx.match(y) == {"a": 3} and idx.size("a") == 6
    idx.record("a", ids_chain(8))  # then 9, before the shared 1 2 touched after it
    assert idx.match(y) == {"a": 2} and idx.entries("a") == 6


def test_capacity_per_worker_and_shrinking_evicts_at_once() -> None:
    idx = PrefixIndex(default_capacity=100, max_capacity=50)
    c = ids_chain(*range(80))
    idx.record("a", c)
    assert idx.size("a") == 50  # max_capacity caps even the default
    idx.set_capacity("b", 10)
    idx.record("b", c)
    assert idx.match(c) == {"a": 50, "b": 10}
    idx.set_capacity("a", 4)
    assert idx.size("a") == 4 and idx.match(c) == {"a": 4, "b": 10}
    idx.set_capacity("c", 0)
    idx.record("c", c)
    assert idx.size("c") == 0


def test_remove_and_clear_forget_a_workers_blocks_and_slots_are_reused_cleanly() -> None:
    idx = PrefixIndex()
    c = ids_chain(1, 2, 3)
    for w in "abc":
        idx.record(w, c)
    idx.set_capacity("b", 7)
    idx.clear("b")
    assert idx.match(c) == {"a": 3, "c": 3} and idx.size("b") == 0
    assert idx.capacity("b") == 7  # clear keeps the budget (same worker, emptied cache)
    idx.remove_worker("a")
    assert idx.match(c) == {"c": 3} and "a" not in idx.workers()
    idx.record("z", c[:1])  # takes a's freed slot; must not inherit anything
    assert idx.match(c) == {"c": 3, "z": 1}
    idx.remove_worker("c")
    idx.remove_worker("z")
    idx.remove_worker("never-seen")
    assert len(idx) == 0 and idx.match(c) == {}


def test_tail_entries_weigh_their_span_against_capacity() -> None:
    idx = PrefixIndex(default_capacity=20)
    c = ids_chain(*range(7))
    ends = (6, 10, 16)  # after 4 dense blocks: spans of 2, 4 and 6 blocks
    idx.record("a", c, dense=4, tail_ends=ends)  # 4 + 2 + 4 + 6 = 16 blocks
    assert idx.size("a") == 16 and idx.entries("a") == 7 and idx.match(c) == {"a": 7}
    idx.record("a", ids_chain(9, 8, 7, 6, 5))  # 5 more blocks: the last span (6) must go
    assert idx.size("a") == 15 and idx.match(c) == {"a": 6}
    idx.set_capacity("b", 9)
    idx.record("b", c, dense=4, tail_ends=ends)  # 9 blocks: the dense head and one span
    assert idx.size("b") == 6 and idx.match(c)["b"] == 5


def test_holders_lists_workers_of_a_block() -> None:
    idx = PrefixIndex()
    c = ids_chain(1, 2)
    idx.record("a", c)
    idx.record("b", c[:1])
    assert sorted(idx.holders(c[0])) == ["a", "b"] and idx.holders(c[1]) == ["a"]


def test_memory_per_entry_stays_within_the_documented_bound() -> None:
    rng = random.Random(0)
    idx = PrefixIndex(default_capacity=100_000)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(300):
            chain = [rng.getrandbits(64) | 1 << 63 for _ in range(100)]
            idx.record(f"w{i % 4}", chain)
        del chain
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    entries = sum(idx.size(w) for w in idx.workers())
    assert entries == 30_000
    assert used / entries <= BYTES_PER_ENTRY


# -- properties: the index against a dumb reference model -------------------------------------------
class Reference:
    """Per-worker weighted LRU of whole-chain touches, matched by walking block by block."""

    def __init__(self, capacity: int, dense: int, ratio: int) -> None:
        self.capacity, self.dense = capacity, dense
        self.ends = tail_layout(dense, ratio, 64) if ratio else ()
        self.lru: dict[str, OrderedDict[int, int]] = {}
        self.stamps: dict[str, dict[int, int]] = {}  # the record that last touched each entry
        self.records = 0

    def weight(self, i: int) -> int:
        if i < self.dense or not self.ends:
            return 1
        j = i - self.dense
        return self.ends[j] - (self.ends[j - 1] if j else self.dense)

    def record(self, worker: str, chain: list[int]) -> int:
        lru = self.lru.setdefault(worker, OrderedDict())
        stamps = self.stamps.setdefault(worker, {})
        self.records += 1
        kept, total = [], 0
        for i, h in enumerate(chain):  # the heaviest head that fits
            if total + self.weight(i) > self.capacity:
                break
            kept.append((h, self.weight(i)))
            total += self.weight(i)
        for h, w in reversed(kept):
            lru[h] = w
            lru.move_to_end(h)
            stamps[h] = self.records
        while sum(lru.values()) > self.capacity:
            lru.popitem(last=False)
        return self.records

    def unrecord(self, worker: str, chain: list[int], held: int, stamp: int) -> None:
        """Deepest first: drop what that record touched last, stop at what another touched."""
        lru, stamps = self.lru.get(worker, OrderedDict()), self.stamps.get(worker, {})
        for h in reversed(chain[held:]):
            if h not in lru:
                continue
            if stamps[h] != stamp:
                break
            del lru[h]

    def size(self, worker: str) -> int:
        return sum(self.lru.get(worker, {}).values())

    def match(self, chain: list[int]) -> dict[str, int]:
        out = {}
        for w, lru in self.lru.items():
            n = 0
            while n < len(chain) and chain[n] in lru:
                n += 1
            if n:
                out[w] = n
        return out


WORKERS = ["a", "b", "c", "d"]
# Chains drawn from a small tree of segment ids, so they share prefixes the way prompts do.
chains = st.lists(st.integers(0, 3), min_size=1, max_size=12).map(lambda s: ids_chain(*s))


class IndexMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(1, 24),
        layout=st.sampled_from([(0, 0), (3, 1), (4, 2), (1, 1), (2, 4)]),
    )
    def setup(self, capacity: int, layout: tuple[int, int]) -> None:
        self.dense = layout[0]
        self.idx = PrefixIndex(default_capacity=capacity)
        self.ref = Reference(capacity, *layout)
        self.capacity = capacity

    def _record(self, worker: str, chain: list[int]) -> None:
        self.idx.record(worker, chain, dense=self.dense, tail_ends=self.ref.ends)

    @rule(worker=st.sampled_from(WORKERS), chain=chains)
    def record(self, worker: str, chain: list[int]) -> None:
        self._record(worker, chain)
        self.ref.record(worker, chain)
        got = self.idx.match(chain)
        # a just-recorded chain fully matches on that worker if it fits the capacity
        fits = sum(self.ref.weight(i) for i in range(len(chain))) <= self.capacity
        if fits:
            assert got.get(worker) == len(chain)
        else:
            assert 0 <= got.get(worker, 0) < len(chain)

    @rule(worker=st.sampled_from(WORKERS), chain=chains, later=st.lists(chains, max_size=3))
    def refused(self, worker: str, chain: list[int], later: list[list[int]]) -> None:
        """A record the worker refuses after `later` records (on any worker) came in between."""
        receipt = self.idx.record(worker, chain, dense=self.dense, tail_ends=self.ref.ends)
        stamp = self.ref.record(worker, chain)
        for i, other in enumerate(later):
            self.record(WORKERS[(WORKERS.index(worker) + i) % 2], other)
        self.idx.unrecord(worker, chain, receipt)
        self.ref.unrecord(worker, chain, receipt[0], stamp)

    @rule(chain=chains)
    def match(self, chain: list[int]) -> None:
        got = self.idx.match(chain)
        assert got == self.ref.match(chain)
        assert all(0 < n <= len(chain) for n in got.values())

    @rule(worker=st.sampled_from(WORKERS))
    def remove(self, worker: str) -> None:
        self.idx.remove_worker(worker)
        self.ref.lru.pop(worker, None)
        assert (
            self.idx.size(worker) == 0 and self.idx.match(ids_chain(0, 1, 2, 3)).get(worker) is None
        )

    @rule(worker=st.sampled_from(WORKERS))
    def clear(self, worker: str) -> None:
        self.idx.clear(worker)
        self.ref.lru.pop(worker, None)

    @invariant()
    def within_capacity(self) -> None:
        if hasattr(self, "idx"):
            for w in WORKERS:
                assert self.idx.size(w) <= self.capacity
                assert self.idx.size(w) == self.ref.size(w)
                assert self.idx.entries(w) == len(self.ref.lru.get(w, ()))
                # the very order a per-block LRU keeps, weights included
                assert self.idx.lru_entries(w) == list(self.ref.lru.get(w, {}).items())
            # no entry is claimed by nobody, none outlives every holder
            distinct = set().union(*(set(lru) for lru in self.ref.lru.values()))
            assert len(self.idx) == len(distinct)


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_index_matches_reference_model = IndexMachine.TestCase


def test_a_receipt_from_a_replaced_index_takes_nothing_back_from_its_successor() -> None:
    # A config reload rebuilds the index while requests are in flight; one of them refused later
    # hands its old receipt to the new index, which must not read it as one of its own records.
    old, new = PrefixIndex(default_capacity=100), PrefixIndex(default_capacity=100)
    c = ids_chain(1, 2, 3)
    receipt = old.record("w", c)
    new.record("w", c)
    new.unrecord("w", c, receipt)
    assert new.match(c) == {"w": 3}
