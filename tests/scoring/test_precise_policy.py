"""kv_aware over the precise index: events beat guesses for workers that publish them, and the
approximate index takes over again when a worker's events stop."""

from __future__ import annotations

import random

from scoring.policy import make_policy
from scoring.precise import PreciseIndex
from scoring.prefix import block_keys, seed_for, tail_layout
from scoring.state import RoutingState
from scoring.views import RouteRequest, RoutingOptions, WorkerView

BS = 16
MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _setup() -> tuple[object, PreciseIndex, Clock, list[WorkerView]]:
    clock = Clock()
    idx = PreciseIndex(stale_after_s=5.0, stale_after_dispatches=3)
    opts = RoutingOptions(token_block_size=BS, block_chars=BS, chars_per_token=1.0)
    policy = make_policy(
        "kv_aware",
        options=opts,
        state=RoutingState(opts, idx),
        rng=random.Random(1),
        clock=clock,
    )
    views = [WorkerView(name=n, block_size=BS, num_blocks=10_000) for n in ("a", "b", "c")]
    for v in views:
        idx.set_live(v.name, True, clock())
    return policy, idx, clock, views


def _request(ids: list[int]) -> RouteRequest:
    keys = tuple(block_keys(ids, BS, MODEL, "", 1_000))
    return RouteRequest(
        model=MODEL,
        chain=keys[:8],  # the approximate chain: a short dense head only
        block_tokens=float(BS),
        prompt_tokens=len(ids),
        block_chain=keys,
    )


def store(idx: PreciseIndex, worker: str, ids: list[int], now: float) -> None:
    n = len(ids) // BS
    hashes = [hash((worker, i)) for i in range(n)]
    idx.stored(worker, hashes, None, ids[: n * BS], BS, seed_for(MODEL, "", ""), "GPU", now)


def test_a_worker_that_reports_the_blocks_wins_over_a_guess() -> None:
    policy, idx, clock, views = _setup()
    ids = list(range(1000, 1000 + 40 * BS))
    req = _request(ids)
    # The approximate index believes b holds the head (say another replica's guess); a's events
    # say it holds all 40 blocks, 32 more than the approximate chain even covers.
    policy.state.index.record("b", req.chain)  # type: ignore[attr-defined]
    store(idx, "a", ids, clock())
    d = policy.choose(views, req)  # type: ignore[attr-defined]
    assert d.worker.name == "a"
    assert d.match_source == "precise"
    assert d.matched_blocks == 40
    assert req.matched_tokens(d.matched_blocks) == 40 * BS


def test_stale_events_hand_the_worker_back_to_the_approximate_index() -> None:
    policy, idx, clock, views = _setup()
    ids = list(range(5000, 5000 + 20 * BS))
    req = _request(ids)
    store(idx, "a", ids, clock())
    # a gets traffic but publishes nothing for a long time: its events are no longer trusted.
    for _ in range(3):
        idx.note_dispatch("a", (), clock())
    clock.t += 60
    assert "a" not in idx.trusted(clock())
    # What a's events said (20 blocks) no longer counts; what the gateway sent it (the 8-entry
    # approximate chain) does.
    policy.state.index.record("a", req.chain)  # type: ignore[attr-defined]
    d = policy.choose(views, req)  # type: ignore[attr-defined]
    assert d.worker.name == "a"
    assert d.match_source == "approx"
    assert d.matched_blocks == 8


def test_a_dispatch_counts_as_held_until_the_events_arrive() -> None:
    policy, _idx, _clock, views = _setup()
    ids = list(range(9000, 9000 + 12 * BS))
    first = _request(ids)
    d1 = policy.choose(views, first)  # type: ignore[attr-defined]
    policy.on_dispatch(d1.worker.name, first)  # type: ignore[attr-defined]
    # No BlockStored yet (prefill still running): a same-prefix request follows the first one.
    d2 = policy.choose(views, _request(ids + [7] * BS))  # type: ignore[attr-defined]
    assert d2.worker.name == d1.worker.name
    assert d2.matched_blocks == 12


def test_entries_for_blocks_follows_the_chain_layout() -> None:
    ends = tail_layout(4, 2, 5)  # (6, 9, 13, 19, 28)
    r = RouteRequest(model=MODEL, chain=tuple(range(9)), dense_blocks=4, tail_ends=ends)
    assert [r.entries_for_blocks(b) for b in (0, 3, 4, 5, 6, 8, 9, 27, 28)] == [
        0,
        3,
        4,
        4,
        5,
        5,
        6,
        8,
        9,
    ]
    flat = RouteRequest(model=MODEL, chain=tuple(range(4)))
    assert flat.entries_for_blocks(10) == 10  # past the chain: block_chain reaches further
