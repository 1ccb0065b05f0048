"""Bounds of the precise index (`scoring.precise.PreciseIndex`) that reloads, finished requests
and overflows must not break (review 57): a reload lowering the staleness knobs takes effect,
pending memory follows the keys still pending rather than every request of the last
``pending_ttl_s``, a worker over its bound loses cold / offloaded blocks before the hot prefix
every request routes on, and clearing a full worker keeps the index consistent."""

from __future__ import annotations

import random

from scoring.precise import OFFLOAD_SLACK, PreciseIndex
from scoring.prefix import chain_hashes_tokens, seed_for

BS = 4
SEED = seed_for("m")
_MASK64 = (1 << 64) - 1


def _keys(tokens: list[int], seed: int = SEED) -> list[int]:
    return chain_hashes_tokens(tokens, block_size=BS, seed=seed, max_blocks=100_000)


def _consistent(idx: PreciseIndex) -> None:
    """Every derived structure agrees with the per-worker engine-hash maps."""
    holders: dict[int, int] = {}
    offl = 0
    for slot, name in enumerate(idx._names):
        if name is None:
            continue
        refs: dict[int, int] = {}
        for v in idx._e2k[slot].values():
            k, t = v & _MASK64, (v >> 64) + 1
            refs[k] = refs.get(k, 0) + (1 if t & 1 else 0) + ((1 << 20) if t & 2 else 0)
        assert refs == idx._refs[slot]
        even = 1 << (2 * slot)
        for k, r in refs.items():
            gpu = r & ((1 << 20) - 1)
            holders[k] = holders.get(k, 0) | (even if gpu else even | even << 1)
            offl += not gpu
        # what _trim drops first: exactly the engine hashes held off GPU only
        offq = {eh for eh, v in idx._e2k[slot].items() if v >> 64 == 1}
        assert set(idx._offq[slot]) == offq and len(idx._offq[slot]) == len(offq)
    assert holders == idx._holders and offl == idx._offl
    pend: dict[int, int] = {}
    in_heap = {(slot, k, e) for e, _seq, slot, keys in idx._pq for k in keys}
    for slot, pexp in enumerate(idx._pexp):
        for k, e in pexp.items():
            pend[k] = pend.get(k, 0) | 1 << (2 * slot)
            assert (slot, k, e) in in_heap  # the sweep will see it expire
    assert pend == idx._pending
    assert idx._plive == idx.pending_size()
    assert idx._pq_keys == _heap_keys(idx)


def _heap_keys(idx: PreciseIndex) -> int:
    """Keys the pending heap keeps referenced."""
    return sum(len(e[3]) for e in idx._pq)


# -------------------------------------------------------------- 1. reloaded staleness knobs


def test_lowering_the_dispatch_threshold_on_a_reload_takes_effect() -> None:
    idx = PreciseIndex(stale_after_s=10.0, stale_after_dispatches=20)
    idx.set_live("w0", True, 0.0)
    assert idx.trusted(1.0) == {"w0"}
    for t in range(10):
        idx.note_dispatch("w0", [], 1.0 + t)  # 10 dispatches, the publisher silent
    idx.stale_after_dispatches = 5  # what Gateway.apply does on a reload
    for t in range(50):
        idx.note_dispatch("w0", [], 20.0 + t)
    assert idx.trusted(500.0) == frozenset()


def test_lowering_the_threshold_below_the_count_takes_effect_without_another_dispatch() -> None:
    idx = PreciseIndex(stale_after_s=10.0, stale_after_dispatches=20)
    idx.set_live("w0", True, 0.0)
    for t in range(10):
        idx.note_dispatch("w0", [], 1.0 + t)
    assert idx.trusted(100.0) == {"w0"}  # cached: 10 < 20
    idx.stale_after_dispatches = 5
    assert idx.trusted(100.0) == frozenset()
    idx.stale_after_dispatches = 50  # raised again: trusted again
    assert idx.trusted(100.0) == {"w0"}


def test_lowering_the_silence_on_a_reload_takes_effect() -> None:
    idx = PreciseIndex(stale_after_s=100.0, stale_after_dispatches=2)
    idx.set_live("w0", True, 0.0)
    for t in range(3):
        idx.note_dispatch("w0", [], 1.0 + t)
    assert idx.trusted(50.0) == {"w0"}  # cached until t=100
    idx.stale_after_s = 10.0
    assert idx.trusted(50.0) == frozenset()
    idx.stale_after_s = 100.0
    assert idx.trusted(50.0) == {"w0"}


def test_reload_values_are_coerced_like_the_constructor() -> None:
    idx = PreciseIndex()
    idx.stale_after_s = 3  # type: ignore[assignment]
    idx.stale_after_dispatches = 4.0  # type: ignore[assignment]
    idx.pending_ttl_s = 5  # type: ignore[assignment]
    idx.settle_s = 1  # type: ignore[assignment]
    assert (idx.stale_after_s, idx.stale_after_dispatches) == (3.0, 4)
    assert type(idx.stale_after_s) is float and type(idx.stale_after_dispatches) is int
    assert (idx.pending_ttl_s, idx.settle_s) == (5.0, 1.0)


def test_lowering_the_pending_ttl_on_a_reload_bounds_what_is_already_pending() -> None:
    idx = PreciseIndex(pending_ttl_s=300.0, settle_s=30.0)
    idx.set_live("w0", True, 0.0)
    c = _keys(list(range(1000, 1000 + 6 * BS)))
    idx.note_dispatch("w0", c, 0.0)  # its first token never comes
    d = _keys(list(range(5000, 5000 + 3 * BS)))
    idx.note_dispatch("w0", d, 0.0)
    idx.dispatch_done("w0", d, 1.0)  # settles until 31
    assert idx.match(c, 10.0) == {"w0": 6} and idx.match(d, 10.0) == {"w0": 3}
    idx.pending_ttl_s = 2.0
    idx.settle_s = 1.0
    # Applied at the next query (11.0): pending at most 2 s from then, settling at most 1 s.
    assert idx.match(c, 11.0) == {"w0": 6} and idx.match(d, 11.0) == {"w0": 3}
    assert idx.match(d, 11.9) == {"w0": 3}
    assert idx.match(d, 12.0) == {}
    assert idx.match(c, 12.9) == {"w0": 6}
    assert idx.match(c, 13.0) == {}
    assert idx.pending_size() == 0 and not idx._pending
    idx.pending_ttl_s = 0.0  # pending off: nothing new is noted
    idx.note_dispatch("w0", c, 20.0)
    assert idx.match(c, 20.0) == {}
    _consistent(idx)


# -------------------------------------------------------------- 2. pending memory


def test_finished_requests_do_not_keep_their_keys_referenced() -> None:
    # 300 requests of 2,048 uncached blocks: each dispatched, first token back 5 ms later,
    # over 3 s. Their settle expiries pass; their 300 s pending_ttl_s entries must not keep
    # the key lists alive (they held 298 MiB for 3,000 requests).
    idx = PreciseIndex()
    idx.set_live("w0", True, 0.0)
    rng = random.Random(1)
    n, b = 300, 2048
    peak = 0
    for i in range(n):
        t = i * 0.01
        c = [rng.getrandbits(64) for _ in range(b)]
        idx.note_dispatch("w0", c, t)
        idx.dispatch_done("w0", c, t + 0.005)
        peak = max(peak, _heap_keys(idx))
    live_peak = 101 * b  # what may be pending at once: 1 s of settle at 100 requests/s
    assert peak <= 3 * live_peak + 8192
    idx.match([1], n * 0.01 + 5)  # every settle expiry has passed
    assert idx.pending_size() == 0
    # Compacted a slice a query (no pause): what is left goes within the queries that follow.
    for q in range(64):
        idx.match([1], n * 0.01 + 5 + q * 0.01)
    assert _heap_keys(idx) <= 8192
    assert sum(1 for e in idx._pq if e[3]) <= 8192 // b + 2  # emptied entries hold no key
    _consistent(idx)


def test_stored_blocks_do_not_keep_their_dispatch_referenced() -> None:
    # BlockStored supersedes pending; the dispatch's 300 s heap entry must follow.
    idx = PreciseIndex()
    idx.set_live("w0", True, 0.0)
    b = 512
    for i in range(100):
        toks = list(range(i * 10_000, i * 10_000 + b * BS))
        c = _keys(toks)
        idx.note_dispatch("w0", c, float(i))
        hashes = list(range(i * 10_000, i * 10_000 + b))
        idx.stored("w0", hashes, None, toks, BS, SEED, "GPU", float(i) + 0.5)
        idx.removed("w0", hashes, None, float(i) + 0.6)  # evicted again: index stays small
    assert idx.pending_size() == 0
    assert _heap_keys(idx) <= 2 * 8192
    _consistent(idx)


def test_compacting_the_heap_keeps_every_expiry() -> None:
    idx = PreciseIndex(pending_ttl_s=100.0, settle_s=1.0)
    idx.set_live("w0", True, 0.0)
    idx.set_live("w1", True, 0.0)
    rng = random.Random(3)
    keep = [rng.getrandbits(64) for _ in range(50)]
    idx.note_dispatch("w1", keep, 0.0)  # never done: pending until 100
    for i in range(200):  # many finished requests force compactions
        c = [rng.getrandbits(64) for _ in range(256)]
        idx.note_dispatch("w0", c, 1.0 + i * 0.01)
        idx.dispatch_done("w0", c, 1.0 + i * 0.01)
    assert idx.match(keep, 50.0) == {"w1": 50}
    assert idx.match(keep, 99.9) == {"w1": 50}
    assert idx.match(keep, 100.0) == {}
    assert idx.pending_size() == 0
    for _ in range(16):  # compacted a slice a query
        idx.match(keep, 100.0)
    assert _heap_keys(idx) <= 4096 + 256
    _consistent(idx)


# -------------------------------------------------------------- 3. trimming order


def test_an_overflow_of_offloaded_blocks_keeps_the_hot_prefix_on_gpu() -> None:
    idx = PreciseIndex()
    idx.set_live("w0", True, 0.0)
    idx.set_capacity("w0", 10)  # bound: 10 * OFFLOAD_SLACK entries
    toks = list(range(8))
    hot = _keys(toks)
    idx.stored("w0", [1, 2], None, toks, BS, SEED, "GPU", 1.0)  # announced once, never again
    for i in range(200):  # cold blocks offloaded to CPU
        ids = list(range(1000 + 4 * i, 1004 + 4 * i))
        idx.stored("w0", [10_000 + i], None, ids, BS, SEED, "CPU", 3.0)
    assert idx.match(hot, 4.0) == {"w0": 2}
    assert len(idx._e2k[idx._slot["w0"]]) == 10 * OFFLOAD_SLACK
    assert idx.overflow == {"w0": 202 - 10 * OFFLOAD_SLACK}
    _consistent(idx)


def test_blocks_evicted_from_gpu_go_before_blocks_still_on_gpu() -> None:
    idx = PreciseIndex(max_worker_blocks=100)
    idx.set_live("w0", True, 0.0)
    toks = list(range(100_000, 100_000 + 40 * BS))
    hot = _keys(toks)
    idx.stored("w0", list(range(1, 41)), None, toks, BS, SEED, "GPU")
    # 60 blocks stored on GPU, offloaded to CPU, then evicted from GPU (offload placeholders).
    cold = list(range(1_000, 1_060))
    idx.stored("w0", cold, None, list(range(60 * BS)), BS, SEED, "GPU")
    idx.stored("w0", cold, None, (), 0, 0, "CPU")
    idx.removed("w0", cold, "GPU")
    # 30 new GPU blocks: 30 entries over the bound, all taken from the offloaded ones.
    idx.stored("w0", list(range(5_000, 5_030)), None, list(range(7_000, 7_000 + 30 * BS)), BS, SEED)
    assert idx.match(hot, 0.0) == {"w0": 40}
    assert idx.key_of("w0", 1_000) is None and idx.key_of("w0", 1_029) is None
    assert idx.key_of("w0", 1_030) is not None
    assert len(idx._e2k[idx._slot["w0"]]) == 100 and idx.overflow == {"w0": 30}
    # A block back on GPU is not off-GPU only any more: it goes in stored order.
    idx.stored("w0", [1_030], None, (), 0, 0, "GPU")
    idx.stored("w0", list(range(6_000, 6_029)), None, list(range(9_000, 9_000 + 29 * BS)), BS, SEED)
    assert idx.key_of("w0", 1_030) is not None and idx.key_of("w0", 1_059) is None
    _consistent(idx)


def test_a_prefix_routed_on_survives_an_overflow_of_gpu_blocks() -> None:
    # Stale GPU entries (an undecodable batch lost their removal) fill the bound; the hot
    # prefix, stored first and never re-announced, is what requests keep routing on.
    idx = PreciseIndex(max_worker_blocks=1_000)
    idx.set_live("w0", True, 0.0)
    toks = list(range(100_000, 100_000 + 50 * BS))
    hot = _keys(toks)
    idx.stored("w0", list(range(1, 51)), None, toks, BS, SEED)
    for j in range(40):  # 40 x 100 blocks: 3,050 over the bound
        base = 1_000_000 * (j + 1)
        ids = list(range(base, base + 100 * BS))
        idx.stored("w0", list(range(base, base + 100)), None, ids, BS, SEED, "GPU", float(j))
        idx.note_dispatch("w0", hot, float(j))  # every request shares the hot prefix
        idx.dispatch_done("w0", hot, float(j))
    assert idx.match(hot, 50.0) == {"w0": 50}
    assert len(idx._e2k[idx._slot["w0"]]) == 1_000 and idx.overflow == {"w0": 3_050}
    _consistent(idx)


def test_without_routing_the_gpu_order_stays_first_stored_first_out() -> None:
    idx = PreciseIndex(max_worker_blocks=1_000)
    idx.set_live("w0", True, 0.0)
    toks = list(range(100_000, 100_000 + 50 * BS))
    hot = _keys(toks)
    idx.stored("w0", list(range(1, 51)), None, toks, BS, SEED)
    idx.note_dispatch("w0", hot, 0.0)  # routed on once: one second chance, not forever
    for j in range(40):
        base = 1_000_000 * (j + 1)
        ids = list(range(base, base + 100 * BS))
        idx.stored("w0", list(range(base, base + 100)), None, ids, BS, SEED, "GPU", float(j))
    assert idx.match(hot, 50.0) == {}
    assert len(idx._e2k[idx._slot["w0"]]) == 1_000
    _consistent(idx)


def test_second_chances_stay_bounded() -> None:
    idx = PreciseIndex(max_worker_blocks=2_000)
    idx.set_live("w0", True, 0.0)
    rng = random.Random(5)
    for j in range(1_000):
        base = 1_000_000 * (j + 1)
        ids = list(range(base, base + 20 * BS))
        idx.stored("w0", list(range(base, base + 20)), None, ids, BS, SEED, "GPU", float(j))
        c = _keys(ids)
        idx.note_dispatch("w0", c, float(j))
        idx.removed("w0", list(range(base, base + rng.randint(0, 20))), None, float(j))
    slot = idx._slot["w0"]
    assert len(idx._used[slot]) <= len(idx._refs[slot]) + 4096
    _consistent(idx)


# -------------------------------------------------------------- 4. clearing a full worker


def _fill(idx: PreciseIndex, w: str, n: int, base: int, medium: str = "GPU") -> list[int]:
    ids = list(range(base, base + n * BS))
    idx.stored(w, list(range(base, base + n)), None, ids, BS, SEED, medium)
    return _keys(ids)


def test_clearing_and_removing_workers_keeps_shared_keys_consistent() -> None:
    idx = PreciseIndex()
    for w in ("a", "b", "c"):
        idx.set_live(w, True, 0.0)
    ka = _fill(idx, "a", 300, 1)
    _fill(idx, "b", 300, 1)  # the same blocks
    _fill(idx, "b", 100, 50_000, "CPU")
    _fill(idx, "c", 100, 50_000, "CPU")
    _fill(idx, "a", 100, 90_000, "CPU")
    idx.note_dispatch("a", [7, 8, 9], 0.0)
    idx.note_dispatch("b", [8, 9], 0.0)
    _consistent(idx)
    idx.clear("a")
    _consistent(idx)
    assert idx.size("a") == 0 and idx.match(ka, 0.0) == {"b": 300}
    assert idx.match([8, 9], 0.0) == {"b": 2} and idx.match([7], 0.0) == {}
    idx.remove_worker("b")
    _consistent(idx)
    assert idx.match(ka, 0.0) == {} and idx._offl == 100
    idx.set_capacity("c", 2)  # trims 100 CPU blocks to 2 * OFFLOAD_SLACK
    assert idx.size("c") == 2 * OFFLOAD_SLACK
    _consistent(idx)
    idx.remove_worker("c")
    assert not idx._holders and not idx._pending and idx._offl == 0


def test_trimming_entries_of_several_tiers_and_shared_keys_stays_consistent() -> None:
    idx = PreciseIndex(max_worker_blocks=5_000)
    for w in ("a", "b"):
        idx.set_live(w, True, 0.0)
    rng = random.Random(9)
    for j in range(40):
        base = 10_000 * (j + 1)
        n = rng.randint(50, 300)
        medium = rng.choice(["GPU", "CPU", "disk"])
        _fill(idx, "a", n, base, medium)
        if j % 3 == 0:
            _fill(idx, "b", n, base)
        if j % 4 == 0:  # a second engine hash for the same blocks
            ids = list(range(base, base + n * BS))
            idx.stored("a", list(range(base + 5_000, base + 5_000 + n)), None, ids, BS, SEED)
        if j % 5 == 0:
            idx.removed("a", list(range(base, base + n // 2)), "GPU")
    _consistent(idx)
    idx.set_capacity("a", 50)  # 800 entries
    assert len(idx._e2k[idx._slot["a"]]) == 50 * OFFLOAD_SLACK
    _consistent(idx)
    idx.clear("a")
    _consistent(idx)
    assert idx.size("a") == 0 and idx._offl == 0


def _lines_run(fn: object, *args: object) -> int:
    """Python lines executed by ``fn(*args)`` in scoring/precise.py: a per-block loop in Python
    is what held the event loop (clear of 524,288 blocks: ~200 ms), bulk dict/set operations
    run in C and count here as one line each."""
    import sys

    count = 0

    def tracer(frame, event, _arg):  # type: ignore[no-untyped-def]
        nonlocal count
        if not frame.f_code.co_filename.endswith("precise.py"):
            return None
        if event == "line":
            count += 1
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn(*args)  # type: ignore[operator]
    finally:
        sys.settrace(old)
    return count


def test_clearing_a_full_worker_runs_no_python_loop_per_block() -> None:
    n = 20_000
    for how in ("clear", "remove_worker", "set_capacity"):
        idx = PreciseIndex()
        for w in ("a", "b"):
            idx.set_live(w, True, 0.0)
        _fill(idx, "a", n, 1)
        _fill(idx, "b", n // 2, 1)  # half the keys shared
        _fill(idx, "a", 1_000, 500_000, "CPU")
        idx.note_dispatch("a", list(range(3_000)), 0.0)
        if how == "set_capacity":
            lines = _lines_run(idx.set_capacity, "a", 10)  # trims ~20,800
            assert len(idx._e2k[idx._slot["a"]]) == 10 * OFFLOAD_SLACK
        else:
            lines = _lines_run(getattr(idx, how), "a")
            assert idx.size("a") == 0
        assert lines < 2_000, (how, lines)
        _consistent(idx)
        assert idx.match(_keys(list(range(1, 1 + n // 2 * BS))), 0.0)["b"] == n // 2


def test_random_operations_keep_every_structure_consistent() -> None:
    rng = random.Random(11)
    idx = PreciseIndex(max_worker_blocks=600, pending_ttl_s=5.0, settle_s=0.5)
    workers = ["a", "b", "c"]
    for w in workers:
        idx.set_live(w, True, 0.0)
    chains: list[tuple[list[int], list[int]]] = []  # (engine hashes, keys)
    now = 0.0
    for step in range(3_000):
        now += rng.random() * 0.05
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.3 or not chains:
            n = rng.randint(1, 40)
            base = rng.randint(1, 3_000) * 100
            ids = list(range(base, base + n * BS))
            hashes = list(range(base, base + n))
            idx.stored(w, hashes, None, ids, BS, SEED, rng.choice(["GPU", "CPU", "disk"]), now)
            chains.append((hashes, _keys(ids)))
        elif op < 0.45:
            hashes, _ = rng.choice(chains)
            tier = rng.choice([None, "GPU", "CPU"])
            idx.removed(w, hashes[rng.randint(0, len(hashes)) :], tier, now)
        elif op < 0.7:
            _, keys = rng.choice(chains)
            idx.note_dispatch(w, keys, now)
            if rng.random() < 0.7:
                idx.dispatch_done(w, keys, now + rng.random())
        elif op < 0.8:
            _, keys = rng.choice(chains)
            idx.match(keys, now)
        elif op < 0.85:
            idx.set_capacity(w, rng.choice([0, 5, 20, 40]))
        elif op < 0.87:
            idx.clear(w)
        elif op < 0.88:
            idx.remove_worker(w)
            idx.set_live(w, True, now)
        elif op < 0.89:
            idx.pending_ttl_s = rng.choice([0.0, 1.0, 5.0])
            idx.settle_s = rng.choice([0.1, 0.5, 2.0])
        else:
            hashes, _ = rng.choice(chains)
            idx.stored(w, hashes, None, (), 0, 0, rng.choice(["GPU", "CPU"]), now)
        if step % 50 == 0:
            _consistent(idx)
        for x in workers:
            assert len(idx._e2k[idx._slot[x]]) <= idx.capacity(x)
    _consistent(idx)
    idx.match([1], now + 100.0)
    assert idx.pending_size() == 0 and not idx._pending and not idx._pq
