"""A worker's KV events are the only thing that decides how much the precise index holds for it
(`scoring.precise.PreciseIndex`): three 4 MiB batches made one worker claim 1,950,000 blocks
(+432 MiB) while its engine had 4,096. What it may claim is bounded, by its reported capacity
times a slack for offload tiers, or by a fixed ceiling; past it, what it stored first goes."""

from __future__ import annotations

import pytest

import scoring.precise as precise
from scoring.precise import PreciseIndex
from scoring.prefix import chain_hashes_tokens

BS = 2


def _ids(n: int, base: int) -> list[int]:
    return list(range(base, base + n * BS))


def _store(idx: PreciseIndex, n: int, base: int, medium: str = "GPU") -> list[int]:
    """A chain of ``n`` blocks with engine hashes base..base+n-1; returns its keys."""
    ids = _ids(n, base)
    idx.stored("w0", list(range(base, base + n)), None, ids, BS, 42, medium)
    return chain_hashes_tokens(ids, block_size=BS, seed=42, max_blocks=n)


def _consistent(idx: PreciseIndex) -> None:
    """Every derived structure agrees with the per-worker engine-hash maps."""
    holders: dict[int, int] = {}
    offl = 0
    for slot, name in enumerate(idx._names):
        if name is None:
            continue
        refs: dict[int, int] = {}
        for v in idx._e2k[slot].values():
            k, t = v & ((1 << 64) - 1), (v >> 64) + 1
            refs[k] = refs.get(k, 0) + (1 if t & 1 else 0) + (precise._OTHER if t & 2 else 0)
        assert refs == idx._refs[slot]
        even = 1 << (2 * slot)
        for k, r in refs.items():
            gpu = r & precise._GPU_REFS
            holders[k] = holders.get(k, 0) | (even if gpu else even | even << 1)
            offl += not gpu
    assert holders == idx._holders and offl == idx._offl


def test_the_ceiling_bounds_a_worker_with_no_reported_capacity() -> None:
    idx = PreciseIndex(max_worker_blocks=500)
    idx.set_live("w0", True)
    old = _store(idx, 400, 10_000)
    new = _store(idx, 300, 20_000)
    assert idx.size("w0") == 500 and idx.overflow == {"w0": 200}
    # First stored, first out: the newer chain is whole, the older lost its head.
    assert idx.match(new, 0.0) == {"w0": 300}
    assert idx.match(old, 0.0) == {}
    assert idx.key_of("w0", 10_199) is None and idx.key_of("w0", 10_200) == old[200]
    _consistent(idx)


def test_the_default_ceiling_is_the_module_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precise, "MAX_WORKER_BLOCKS", 64, raising=False)
    idx = PreciseIndex()
    _store(idx, 100, 1)
    assert idx.size("w0") == 64 and idx.capacity("w0") == 64


def test_a_reported_capacity_with_its_slack_bounds_the_worker() -> None:
    idx = PreciseIndex(max_worker_blocks=10_000)
    idx.set_capacity("w0", 10)
    assert idx.capacity("w0") == 10 * precise.OFFLOAD_SLACK
    _store(idx, 1_000, 1)
    assert idx.size("w0") == 10 * precise.OFFLOAD_SLACK
    idx.set_capacity("w0", 1_000_000)  # never above the ceiling
    assert idx.capacity("w0") == 10_000
    idx.set_capacity("w0", 0)  # unknown again: the ceiling
    assert idx.capacity("w0") == 10_000
    idx.set_capacity("w0", 5)  # a smaller engine (after a restart): trimmed at once
    assert idx.size("w0") == 5 * precise.OFFLOAD_SLACK
    _consistent(idx)


def test_trimming_keeps_tiers_shared_keys_and_other_workers_consistent() -> None:
    idx = PreciseIndex(max_worker_blocks=500)
    for w in ("w0", "w1"):
        idx.set_live(w, True)
    keys = _store(idx, 200, 1, "CPU")  # held off-GPU only
    ids = _ids(200, 1)
    idx.stored("w1", list(range(1, 201)), None, ids, BS, 42, "GPU")
    # Another engine hash of w0 for the same blocks (vLLM may hash a block twice), on GPU.
    idx.stored("w0", list(range(5_000, 5_200)), None, ids, BS, 42, "GPU")
    _consistent(idx)
    _store(idx, 150, 90_000)  # 550 engine hashes: the 50 oldest (CPU copies) go
    assert len(idx._e2k[idx._slot["w0"]]) == 500 and idx.overflow == {"w0": 50}
    _consistent(idx)
    # w1 lost nothing; w0 still holds every block through its other engine hash
    assert idx.match(keys, 0.0) == {"w0": 200, "w1": 200}


def test_a_long_run_of_trims_stays_cheap_and_in_order() -> None:
    # A dict iterates from its first slot over every deleted one: trimming from the front of a
    # big map scanned all earlier holes each time until it was rebuilt.
    idx = PreciseIndex(max_worker_blocks=20_000)
    for k in range(30):
        _store(idx, 2_000, 1_000_000 * (k + 1))
    slot = idx._slot["w0"]
    assert len(idx._e2k[slot]) == 20_000 and idx.overflow["w0"] == 40_000
    assert idx._trimmed[slot] <= max(4096, 20_000 >> 3)
    assert next(iter(idx._e2k[slot])) == 1_000_000 * 21  # the oldest kept: the 21st chain
    _consistent(idx)


def test_removing_the_worker_forgets_its_overflow() -> None:
    idx = PreciseIndex(max_worker_blocks=10)
    _store(idx, 20, 1)
    idx.remove_worker("w0")
    assert idx.overflow == {} and idx.size("w0") == 0
    _store(idx, 5, 100)  # a new worker by that name starts from the ceiling again
    assert idx.capacity("w0") == 10 and idx.size("w0") == 5
