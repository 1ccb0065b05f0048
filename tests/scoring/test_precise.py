from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Hashable

from scoring.precise import PreciseIndex
from scoring.prefix import chain_hashes_tokens, seed_for

BS = 4
SEED = seed_for("m")


def prompt(n_blocks: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def chain(tokens: list[int], seed: int = SEED) -> list[int]:
    return chain_hashes_tokens(tokens, block_size=BS, seed=seed, max_blocks=10_000)


def ehs(n: int, base: int = 1 << 63) -> list[int]:
    """Engine hashes as vLLM sends them: opaque, often above 2^63."""
    return [base + 7919 * i for i in range(n)]


def live_index(*workers: str, **kw: float) -> PreciseIndex:
    idx = PreciseIndex(**kw)  # type: ignore[arg-type]
    for w in workers:
        idx.set_live(w, True, now=0.0)
    return idx


def store_prompt(
    idx: PreciseIndex,
    worker: str,
    tokens: list[int],
    hashes: list[Hashable],
    *,
    first: int = 0,
    parent: Hashable | None = None,
    medium: str | None = "GPU",
    seed: int = SEED,
    now: float = 0.0,
) -> int:
    """Store blocks [first, first + len(hashes)) of ``tokens`` in one event."""
    toks = tokens[first * BS : (first + len(hashes)) * BS]
    return idx.stored(worker, hashes, parent, toks, BS, seed, medium=medium, now=now)


# -- keys ------------------------------------------------------------------------------------
def test_keys_of_a_prompt_stored_in_one_event_equal_the_request_chain() -> None:
    idx = live_index("a")
    toks = prompt(8)
    h = ehs(8)
    assert store_prompt(idx, "a", toks, h) == 8
    assert [idx.key_of("a", x) for x in h] == chain(toks)
    assert idx.blocks("a") == set(chain(toks))
    assert idx.size("a") == 8
    assert idx.match(chain(toks), now=0.0) == {"a": 8}


def test_keys_of_a_prompt_split_over_events_with_parents_equal_the_request_chain() -> None:
    idx = live_index("a")
    toks = prompt(10)
    h = ehs(10)
    assert store_prompt(idx, "a", toks, h[:3]) == 3
    assert store_prompt(idx, "a", toks, h[3:4], first=3, parent=h[2]) == 1
    assert store_prompt(idx, "a", toks, h[4:], first=4, parent=h[3]) == 6
    assert [idx.key_of("a", x) for x in h] == chain(toks)
    assert idx.match(chain(toks), now=0.0) == {"a": 10}
    # a longer request sharing the prefix matches the stored part only
    assert idx.match(chain(toks + prompt(5, start=5)), now=0.0) == {"a": 10}


def test_extra_token_ids_beyond_the_blocks_are_ignored() -> None:
    idx = live_index("a")
    toks = prompt(3)
    assert idx.stored("a", ehs(2), None, [*toks, 1, 2], BS, SEED) == 2
    assert idx.blocks("a") == set(chain(toks)[:2])


def test_an_unknown_parent_or_too_few_tokens_leaves_blocks_unkeyed() -> None:
    idx = live_index("a", "b")
    toks = prompt(6)
    h = ehs(6)
    store_prompt(idx, "b", toks, h[:3])  # the parent is known to b, not to a
    assert store_prompt(idx, "a", toks, h[3:], first=3, parent=h[2]) == 0
    assert idx.unkeyed == {"a": 3}
    assert idx.size("a") == 0
    assert idx.stored("a", h[:2], None, toks[: BS + 1], BS, SEED) == 0  # 5 ids for 2 blocks
    assert idx.unkeyed == {"a": 5}
    assert idx.stored("a", h[:1], None, [-1] * BS, BS, SEED) == 0  # ids that are no uint32
    assert idx.stored("a", h[:1], None, toks, 0, SEED) == 0
    assert idx.unkeyed == {"a": 7}
    assert idx.stored("a", [], None, [], BS, SEED) == 0
    assert idx.size("a") == 0 and idx.match(chain(toks), now=0.0) == {"b": 3}


def test_root_seed_isolates_identical_tokens() -> None:
    idx = live_index("a")
    toks = prompt(4)
    salted = seed_for("m", cache_salt="tenant-1")
    store_prompt(idx, "a", toks, ehs(4), seed=salted)
    assert idx.blocks("a") == set(chain(toks, salted))
    assert idx.blocks("a").isdisjoint(chain(toks))
    assert idx.match(chain(toks), now=0.0) == {}
    assert idx.match(chain(toks, salted), now=0.0) == {"a": 4}


def test_bytes_engine_hashes() -> None:
    idx = live_index("a")
    toks = prompt(4)
    h: list[Hashable] = [bytes([i]) * 32 for i in range(4)]
    assert store_prompt(idx, "a", toks, h[:2]) == 2
    assert store_prompt(idx, "a", toks, h[2:], first=2, parent=h[1]) == 2
    assert [idx.key_of("a", x) for x in h] == chain(toks)
    assert idx.removed("a", [h[3], b"unknown"]) == 1
    assert idx.key_of("a", h[3]) is None
    assert idx.match(chain(toks), now=0.0) == {"a": 3}


def test_a_duplicate_store_is_idempotent() -> None:
    idx = live_index("a")
    toks = prompt(3)
    h = ehs(3)
    store_prompt(idx, "a", toks, h)
    store_prompt(idx, "a", toks, h)
    assert idx.size("a") == 3
    assert idx.removed("a", h, medium="GPU") == 3  # one removal is enough: no phantom refs
    assert idx.size("a") == 0 and idx._holders == {}


# -- removal ---------------------------------------------------------------------------------
def test_removed_drops_blocks_and_their_engine_hash_mapping() -> None:
    idx = live_index("a")
    toks = prompt(5)
    h = ehs(5)
    store_prompt(idx, "a", toks, h)
    assert idx.removed("a", [h[4], 12345, h[3]]) == 2  # unknown hash ignored
    assert idx.key_of("a", h[4]) is None and idx.key_of("a", h[3]) is None
    assert idx.blocks("a") == set(chain(toks)[:3])
    assert idx.removed("a", [h[4]]) == 0
    # a child of a removed block can no longer be keyed
    assert store_prompt(idx, "a", toks, h[4:], first=4, parent=h[3]) == 0
    assert idx.unkeyed == {"a": 1}


def test_a_key_shared_by_two_engine_hashes_stays_until_both_are_removed() -> None:
    idx = live_index("a")
    toks = prompt(2)
    store_prompt(idx, "a", toks, [1, 2])
    store_prompt(idx, "a", toks, [3, 4])  # same tokens re-stored under new engine hashes
    assert idx.key_of("a", 1) == idx.key_of("a", 3) == chain(toks)[0]
    assert idx.size("a") == 2
    assert idx.removed("a", [1, 2]) == 2
    assert idx.blocks("a") == set(chain(toks))
    assert idx.match(chain(toks), now=0.0) == {"a": 2}
    assert idx.removed("a", [3]) == 1
    assert idx.match(chain(toks), now=0.0) == {}
    assert idx.removed("a", [4]) == 1
    assert idx.size("a") == 0 and idx._holders == {}


def test_a_block_offloaded_then_removed_from_gpu_is_held_off_gpu_only() -> None:
    idx = live_index("a")
    toks = prompt(4)
    h = ehs(4)
    store_prompt(idx, "a", toks, h)
    store_prompt(idx, "a", toks, h, medium="CPU")  # offloaded copies
    c = chain(toks)
    assert idx.match(c, now=0.0) == {"a": 4}
    assert idx.removed("a", h[2:], medium="GPU") == 0  # still on CPU: not gone
    assert idx.size("a") == 4
    assert idx.match(c, now=0.0) == {"a": 3}  # 2 + 2 * 0.5
    assert idx.removed("a", h[3:], medium="CPU") == 1
    assert idx.match(c, now=0.0) == {"a": 2}  # 2 + 0.5, rounded down
    assert idx.removed("a", h[:2], medium="CPU") == 0  # GPU copies remain
    assert idx.match(c, now=0.0) == {"a": 2}
    assert idx.removed("a", h) == 3  # every tier
    assert idx.size("a") == 0 and idx._holders == {}


def test_removal_from_a_tier_that_does_not_hold_the_block_changes_nothing() -> None:
    idx = live_index("a")
    toks = prompt(2)
    store_prompt(idx, "a", toks, [1, 2])
    assert idx.removed("a", [1, 2], medium="CPU") == 0
    assert idx.match(chain(toks), now=0.0) == {"a": 2}


# -- clear / remove_worker -------------------------------------------------------------------
def test_clear_forgets_blocks_and_pending_but_keeps_liveness() -> None:
    idx = live_index("a", "b")
    toks = prompt(4)
    c = chain(toks)
    store_prompt(idx, "a", toks, ehs(4))
    store_prompt(idx, "b", toks, ehs(4))
    idx.note_dispatch("a", chain(prompt(6, start=7)), now=0.0)
    idx.clear("a")
    assert idx.size("a") == 0 and idx.key_of("a", ehs(1)[0]) is None
    assert idx.pending_size() == 0
    assert idx.match(c, now=0.0) == {"b": 4}
    assert idx.trusted(0.0) == {"a", "b"}
    assert store_prompt(idx, "a", toks, ehs(4)) == 4
    assert idx.match(c, now=0.0) == {"a": 4, "b": 4}
    idx.clear("nobody")


def test_remove_worker_forgets_everything_and_its_slot_is_reused() -> None:
    idx = live_index("a", "b")
    toks = prompt(4)
    store_prompt(idx, "a", toks, ehs(4))
    store_prompt(idx, "b", toks[: 2 * BS], ehs(2))
    idx.stored("a", [99], 12345, toks[:BS], BS, SEED)  # unkeyed
    idx.note_dispatch("a", chain(prompt(3, start=5)), now=0.0)
    slot_a = idx._slot["a"]
    idx.remove_worker("a")
    assert idx.workers() == ["b"]
    assert "a" not in idx.unkeyed and idx.trusted(0.0) == {"b"}
    assert idx.match(chain(toks), now=0.0) == {"b": 2}
    assert idx.pending_size() == 0
    assert all(m & (3 << 2 * slot_a) == 0 for m in idx._holders.values())
    idx.set_live("c", True, now=0.0)
    assert idx._slot["c"] == slot_a
    assert idx.size("c") == 0 and idx.match(chain(toks), now=0.0) == {"b": 2}
    store_prompt(idx, "c", toks, ehs(4))
    assert idx.match(chain(toks), now=0.0) == {"b": 2, "c": 4}
    idx.remove_worker("nobody")


# -- match -----------------------------------------------------------------------------------
def test_match_stops_each_worker_at_its_first_miss_even_with_later_blocks_held() -> None:
    idx = live_index("a")
    toks = prompt(10)
    h = ehs(10)
    store_prompt(idx, "a", toks, h)
    idx.removed("a", [h[4]])  # vLLM may evict a parent before its children
    assert idx.size("a") == 9
    assert idx.match(chain(toks), now=0.0) == {"a": 4}
    idx.removed("a", [h[0]])
    assert idx.match(chain(toks), now=0.0) == {}
    assert idx.match([], now=0.0) == {}


def test_match_reports_each_workers_own_run_length() -> None:
    idx = live_index("a", "b", "c", "d", "e")
    toks = prompt(12)
    h = ehs(12)
    store_prompt(idx, "a", toks, h[:2])
    store_prompt(idx, "b", toks, h)
    store_prompt(idx, "c", toks, h[:7])
    store_prompt(idx, "d", prompt(3, start=50_000), ehs(3))  # a different prompt
    store_prompt(idx, "e", toks, h[:9])
    idx.removed("e", [h[5]])
    c = chain(toks)
    assert idx.match(c, now=0.0) == {"a": 2, "b": 12, "c": 7, "e": 5}
    assert idx.match(c[:6], now=0.0) == {"a": 2, "b": 6, "c": 6, "e": 5}
    assert idx.match(chain(prompt(1, start=1)), now=0.0) == {}


def test_offloaded_blocks_count_offload_weight() -> None:
    toks = prompt(20)
    h = ehs(20)
    for weight, want in ((0.5, 15), (1.0, 20), (0.0, 10), (0.25, 12)):
        idx = live_index("a", offload_weight=weight)
        store_prompt(idx, "a", toks, h[:10])
        store_prompt(idx, "a", toks, h[10:], first=10, parent=h[9], medium="CPU")
        assert idx.match(chain(toks), now=0.0) == {"a": want}, weight
    idx = live_index("a", "b")
    store_prompt(idx, "a", toks, h[:1], medium="cpu")
    store_prompt(idx, "b", toks, h[:1], medium="GPU")
    store_prompt(idx, "b", toks, h[:1], medium="disk")  # GPU and another tier: full weight
    assert idx.match(chain(toks), now=0.0) == {"b": 1}  # a: 0.5 rounds down to 0, omitted
    store_prompt(idx, "a", toks, h[:1], medium=None)  # no medium: GPU
    assert idx.match(chain(toks), now=0.0) == {"a": 1, "b": 1}


# -- pending ---------------------------------------------------------------------------------
def test_a_dispatched_chain_counts_as_held_until_it_expires() -> None:
    idx = live_index("a", "b", pending_ttl_s=2.0)
    c = chain(prompt(6))
    idx.note_dispatch("a", c, now=10.0)
    assert idx.match(c, now=10.0) == {"a": 6}
    assert idx.match(c, now=11.9) == {"a": 6}
    assert idx.size("a") == 0  # pending is not held
    assert idx.match(c, now=12.0) == {}
    assert idx.pending_size() == 0 and not idx._pending and not idx._pq


def test_a_later_dispatch_extends_pending() -> None:
    idx = live_index("a", pending_ttl_s=2.0)
    c = chain(prompt(6))
    idx.note_dispatch("a", c[:4], now=0.0)
    idx.note_dispatch("a", c, now=1.5)
    assert idx.match(c, now=2.5) == {"a": 6}  # the first dispatch's expiry does not drop it
    assert idx.match(c, now=3.5) == {}
    assert idx.pending_size() == 0 and not idx._pq


def test_stored_supersedes_pending() -> None:
    idx = live_index("a", pending_ttl_s=2.0)
    toks = prompt(6)
    c = chain(toks)
    h = ehs(6)
    idx.note_dispatch("a", c, now=0.0)
    assert idx.pending_size() == 6
    store_prompt(idx, "a", toks, h[:4], now=0.5)  # prefill done for the first 4 blocks
    assert idx.pending_size() == 2
    assert idx.match(c, now=0.5) == {"a": 6}
    idx.removed("a", [h[1]], now=0.6)  # a stored block no longer rides on pending
    assert idx.match(c, now=0.6) == {"a": 1}
    assert idx.match(c, now=5.0) == {"a": 1}
    assert idx.pending_size() == 0


def test_pending_skips_the_leading_run_already_held_on_gpu_and_outweighs_offload() -> None:
    idx = live_index("a", pending_ttl_s=2.0)
    toks = prompt(8)
    h = ehs(8)
    c = chain(toks)
    store_prompt(idx, "a", toks, h[:3])
    store_prompt(idx, "a", toks, h[3:5], first=3, parent=h[2], medium="CPU")
    assert idx.match(c, now=0.0) == {"a": 4}  # 3 + 2 * 0.5
    idx.note_dispatch("a", c, now=0.0)
    assert idx.pending_size() == 5  # blocks 3..7: CPU-only blocks will be loaded back to GPU
    assert idx.match(c, now=0.0) == {"a": 8}
    assert idx.match(c, now=3.0) == {"a": 4}
    idx.note_dispatch("a", c[:3], now=3.0)
    assert idx.pending_size() == 0


def test_pending_stays_bounded_under_sustained_dispatch() -> None:
    idx = live_index("a", "b", pending_ttl_s=2.0)
    rng = random.Random(7)
    peak = 0
    for step in range(2_000):
        now = step * 0.01
        c = chain(prompt(rng.randint(1, 12), start=rng.randint(0, 100_000)))
        idx.note_dispatch(rng.choice("ab"), c, now=now)
        if step % 10 == 0:
            idx.match(c, now=now)
        peak = max(peak, idx.pending_size())
    assert peak <= 201 * 12  # at most what was dispatched in one TTL (200 dispatches)
    idx.match([], now=100.0)
    assert idx.pending_size() == 0 and not idx._pending and not idx._pq


def test_pending_of_untrusted_workers_is_ignored() -> None:
    idx = PreciseIndex()
    c = chain(prompt(3))
    idx.note_dispatch("a", c, now=0.0)
    assert idx.match(c, now=0.0) == {}
    idx.set_live("a", True, now=0.0)
    assert idx.match(c, now=0.0) == {"a": 3}


# -- trusted ---------------------------------------------------------------------------------
def test_only_live_workers_are_trusted_and_matched() -> None:
    idx = PreciseIndex()
    toks = prompt(3)
    store_prompt(idx, "a", toks, ehs(3))
    store_prompt(idx, "b", toks, ehs(3))
    assert idx.trusted(0.0) == frozenset()
    assert idx.match(chain(toks), now=0.0) == {}
    idx.set_live("a", True, now=0.0)
    assert idx.trusted(0.0) == {"a"}
    assert idx.match(chain(toks), now=0.0) == {"a": 3}
    idx.set_live("b", True, now=0.0)
    idx.set_live("a", False, now=0.0)
    assert idx.trusted(0.0) == {"b"}
    assert idx.match(chain(toks), now=0.0) == {"b": 3}
    assert sorted(idx.workers()) == ["a", "b"]


def test_a_worker_is_stale_only_with_many_dispatches_and_a_long_silence() -> None:
    idx = live_index("a", "b", stale_after_s=10.0, stale_after_dispatches=20)
    c = chain(prompt(2))
    for i in range(19):
        idx.note_dispatch("a", c, now=i * 0.1)
    assert idx.trusted(50.0) == {"a", "b"}  # long silence, but too few dispatches
    idx.note_dispatch("a", c, now=5.0)  # the 20th
    assert idx.trusted(5.0) == {"a", "b"}  # many dispatches, but not silent for long
    assert idx.trusted(10.0) == {"a", "b"}  # exactly 10 s: not *more than* 10 s
    assert idx.trusted(10.5) == {"b"}
    assert idx.match(c, now=10.5) == {}  # the stale worker's pending is not used either
    idx.touch("a", now=11.0)  # an event batch: reporting again
    assert idx.trusted(11.0) == {"a", "b"}
    for _ in range(25):
        idx.note_dispatch("a", c, now=12.0)
    assert idx.trusted(21.0) == {"a", "b"}
    assert idx.trusted(21.5) == {"b"}
    store_prompt(idx, "a", prompt(2), ehs(2), now=22.0)  # stored() touches too
    assert idx.trusted(22.0) == {"a", "b"}
    for _ in range(20):
        idx.note_dispatch("a", c, now=23.0)
    assert idx.trusted(40.0) == {"b"}
    idx.removed("a", [1], now=41.0)  # removed() touches too, even for unknown hashes
    assert idx.trusted(41.0) == {"a", "b"}


def test_going_live_restarts_the_staleness_clock() -> None:
    idx = live_index("a", stale_after_s=10.0, stale_after_dispatches=2)
    idx.note_dispatch("a", [1], now=0.0)
    idx.note_dispatch("a", [1], now=0.0)
    assert idx.trusted(20.0) == frozenset()
    idx.set_live("a", True, now=20.0)  # already live: no reset
    assert idx.trusted(20.0) == frozenset()
    idx.set_live("a", False, now=20.0)
    idx.set_live("a", True, now=21.0)  # reconnected and resynced
    assert idx.trusted(21.0) == {"a"}
    idx.remove_worker("a")
    assert idx.trusted(21.0) == frozenset()


def test_trusted_is_cached_but_follows_time_and_changes() -> None:
    idx = live_index("a", stale_after_s=1.0, stale_after_dispatches=1)
    t0 = idx.trusted(0.0)
    assert idx.trusted(0.5) is t0  # nothing changed: the same frozenset
    idx.note_dispatch("a", [1], now=0.5)
    assert idx.trusted(0.5) == {"a"}
    t1 = idx.trusted(0.9)
    assert idx.trusted(1.0) is t1
    assert idx.trusted(1.01) == frozenset()
    assert idx.trusted(0.9) == {"a"}  # queried at an earlier time again: recomputed


# -- a reference model -----------------------------------------------------------------------
def test_random_operations_agree_with_a_naive_model() -> None:
    rng = random.Random(1234)
    workers = ["w0", "w1", "w2", "w3"]
    idx = live_index(*workers, pending_ttl_s=0.0, offload_weight=0.5)
    # model: worker -> engine hash -> (key, set of tiers)
    model: dict[str, dict[int, tuple[int, set[int]]]] = {w: {} for w in workers}
    prompts = [prompt(12, start=s) for s in (0, 0, 100, 200)]
    prompts[1] = prompts[0][: 5 * BS] + prompt(7, start=300)  # shares 5 blocks with prompts[0]
    chains = [chain(p) for p in prompts]
    counter = 0
    for _ in range(3_000):
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.5:
            pi = rng.randrange(len(prompts))
            first = rng.randrange(12)
            n = rng.randint(1, 12 - first)
            medium = rng.choice(["GPU", "GPU", "CPU"])
            tb = 1 if medium == "GPU" else 2
            parent = None
            if first:  # the parent's engine hash: one the worker knows for that key, if any
                pk = chains[pi][first - 1]
                known = [eh for eh, (k, _) in model[w].items() if k == pk]
                parent = rng.choice(known) if known and rng.random() < 0.9 else -1
            hashes = []
            for i in range(first, first + n):
                reuse = [eh for eh, (k, _) in model[w].items() if k == chains[pi][i]]
                if reuse and rng.random() < 0.5:
                    hashes.append(rng.choice(reuse))
                else:
                    counter += 1
                    hashes.append(counter)
            got = idx.stored(w, hashes, parent, prompts[pi][first * BS :], BS, SEED, medium)
            keyed = list(range(n))
            if parent == -1:
                # No parent to key from: the hashes the worker already maps only gain the tier,
                # and after a leading run of them the rest is keyed from the run's last block.
                run = 0
                while run < n and hashes[run] in model[w]:
                    run += 1
                if not 0 < run < n:
                    keyed = [j for j in range(n) if hashes[j] in model[w]]
            assert got == len(keyed)
            for j in keyed:
                eh, key = hashes[j], chains[pi][first + j]
                k, tiers = model[w].get(eh, (key, set()))
                model[w][eh] = (k, tiers | {tb})
        elif op < 0.8 and model[w]:
            victims = rng.sample(sorted(model[w]), min(len(model[w]), rng.randint(1, 4)))
            medium = rng.choice([None, "GPU", "CPU"])
            rm = {1, 2} if medium is None else ({1} if medium == "GPU" else {2})
            gone = 0
            for eh in victims:
                k, tiers = model[w][eh]
                if tiers & rm and not tiers - rm:
                    del model[w][eh]
                    gone += 1
                elif tiers & rm:
                    model[w][eh] = (k, tiers - rm)
            assert idx.removed(w, victims, medium) == gone
        elif op < 0.82:
            idx.clear(w)
            model[w] = {}
        offl = 0
        for ww in workers:
            held = {k for k, _ in model[ww].values()}
            assert idx.blocks(ww) == held
            on_gpu = {k for k, t in model[ww].values() if 1 in t}
            offl += len(held - on_gpu)
        assert idx._offl == offl
        for c in chains:
            want: dict[str, int] = {}
            for ww in workers:
                tiers_of: dict[int, set[int]] = {}
                for k, t in model[ww].values():
                    tiers_of.setdefault(k, set()).update(t)
                score = 0.0
                for key in c:
                    if key not in tiers_of:
                        break
                    score += 1.0 if 1 in tiers_of[key] else 0.5
                if int(score) > 0:
                    want[ww] = int(score)
            assert idx.match(c, now=0.0) == want


# -- memory ----------------------------------------------------------------------------------
def test_memory_per_entry_stays_within_the_documented_figure() -> None:
    n = 20_000
    toks = prompt(n, start=0)

    def measure(workers: int) -> float:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            idx = PreciseIndex()
            for w in range(workers):
                hashes = ehs(n, base=(1 << 63) + w * 10 * n)
                idx.stored(f"w{w}", hashes, None, toks, BS, SEED)
            del hashes
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert sum(idx.size(f"w{w}") for w in range(workers)) == workers * n
        return used / (workers * n)

    assert measure(1) < 330  # unshared: see the module docstring
    assert measure(4) < 230  # the key shared by 4 workers


# -- stores of blocks the worker already maps (vLLM's offload placeholders) -------------------
def test_a_placeholder_store_of_known_hashes_adds_the_tier_without_tokens() -> None:
    # vLLM 0.32's OffloadingConnector (self_describing_kv_events off, its default) stores each
    # offloaded block as the engine hash alone: no token ids, block size 0, no parent.
    idx = live_index("a")
    toks = prompt(4)
    h = ehs(4)
    store_prompt(idx, "a", toks, h)
    for x in h[:3]:
        assert idx.stored("a", [x], None, [], 0, 0, medium="CPU") == 1
    assert idx.unkeyed == {}
    c = chain(toks)
    assert idx.removed("a", h, medium="GPU") == 1  # the one never offloaded leaves
    assert idx.size("a") == 3
    assert idx.match(c, now=0.0) == {"a": 1}  # 3 blocks off GPU only: 3 * 0.5
    assert idx.removed("a", h[:3], medium="CPU") == 3
    assert idx.size("a") == 0 and idx._holders == {} and idx._offl == 0


def test_a_placeholder_of_an_unknown_hash_is_unkeyed_and_known_ones_still_count() -> None:
    idx = live_index("a")
    toks = prompt(2)
    h = ehs(2)
    store_prompt(idx, "a", toks, h[:1])
    assert idx.stored("a", [h[1], h[0]], None, [], 0, 0, medium="CPU") == 1
    assert idx.unkeyed == {"a": 1}
    assert idx.key_of("a", h[0]) == chain(toks)[0] and idx.key_of("a", h[1]) is None


def test_an_event_whose_leading_blocks_are_known_keys_the_rest_from_them() -> None:
    # A parent this worker does not know (or none), but the event's first blocks are mapped:
    # the blocks after them are keyed with the last of them as their parent.
    idx = live_index("a")
    toks = prompt(5)
    h = ehs(5)
    store_prompt(idx, "a", toks, h[:2])
    assert store_prompt(idx, "a", toks, h, parent=12345) == 5
    assert [idx.key_of("a", x) for x in h] == chain(toks)
    assert idx.unkeyed == {} and idx.match(chain(toks), now=0.0) == {"a": 5}
