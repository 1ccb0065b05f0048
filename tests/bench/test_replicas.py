"""The simulator's model of several gateway replicas (bench.replicas): with the shared model and
no delay every replica knows what one gateway would; independent replicas do not; a delay holds
changes back exactly that long; the newest turn of a session wins."""

from __future__ import annotations

import random

import pytest

from bench.replicas import ReplicaSync, ShareModel, learned_state
from scoring.policy import make_policy
from scoring.precise import PreciseIndex
from scoring.state import RoutingState
from scoring.views import RouteRequest, RoutingOptions, WorkerView

WORKERS = ["w0", "w1", "w2", "w3"]
# 160 x 16 KV tokens = 160 index entries of 16 tokens per worker: the script below dispatches more
# than that to each, so the indexes evict and their LRU order matters.
OPTIONS = RoutingOptions()
VIEWS = {n: WorkerView(name=n, num_blocks=160, block_size=16) for n in WORKERS}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _policies(n: int, clock: Clock) -> list:  # type: ignore[type-arg]
    return [
        make_policy("kv_aware", options=OPTIONS, rng=random.Random(i), clock=clock)
        for i in range(n)
    ]


def _script(seed: int, steps: int = 300) -> list[tuple[float, int, str, RouteRequest, int]]:
    """Dispatches (time, replica, worker, route, prefill tokens): 6 prefix families of growing
    chains, a session per family member, arrivals 0-50 ms apart."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(steps):
        t += rng.uniform(0.0, 0.05)
        fam = rng.randrange(6)
        user = rng.randrange(4)
        chain = tuple([fam * 1000 + k for k in range(8)] + [10**6 + i * 10 + k for k in range(3)])
        route = RouteRequest(
            model="m",
            request_id=f"r{i}",
            chain=chain[: rng.randint(4, len(chain))],
            block_tokens=64.0,
            prompt_tokens=64 * len(chain),
            session_id=f"s{fam}-{user}",
        )
        out.append((t, rng.randrange(4), rng.choice(WORKERS), route, rng.randrange(0, 500)))
    return out


def _run(model: ShareModel, replicas: int = 4, seed: int = 1) -> tuple[list, ReplicaSync, object]:  # type: ignore[type-arg]
    """Play the script through `replicas` policies wired by `model`, and the same dispatches
    through one gateway's policy; first tokens and completions come back 0.3 s / 1 s later."""
    clock = Clock()
    policies = _policies(replicas, clock)
    one = _policies(1, clock)[0]
    sync = ReplicaSync(replicas, WORKERS, model, policies)
    later: list[tuple[float, str, int, int, int]] = []  # (time, kind, replica, worker, tokens)
    for t, r, name, route, tokens in _script(seed):
        for e in sorted(x for x in later if x[0] <= t):
            later.remove(e)
            at, kind, rr, w, tok = e
            if kind == "first":
                sync.prefill_done(rr, at, w, tok)
            else:
                sync.finished(rr, at, w)
        clock.now = t
        sync.deliver(t)
        w = WORKERS.index(name)
        for p in (policies[r], one):  # what choose() does for the chosen worker, then dispatch
            p.state.sync_capacity(VIEWS[name])
            p.on_dispatch(name, route)
        sync.dispatched(r, t, w, route, tokens, VIEWS[name])
        later += [(t + 0.3, "first", r, w, tokens), (t + 1.0, "done", r, w, 0)]
    clock.now += 10.0
    sync.deliver(clock.now)
    return policies, sync, one


def test_shared_with_no_delay_every_replica_knows_what_one_gateway_knows() -> None:
    policies, sync, one = _run(ShareModel.parse("all", 0.0))
    want = learned_state(one.state)  # type: ignore[attr-defined]
    assert want["index"] and want["sessions"]
    assert sum(len(v) for v in want["index"].values()) > 100  # the script evicts: order matters
    for p in policies:
        assert learned_state(p.state) == want
    assert sync.in_transit == 0 and sync.delivered > 0


def test_independent_replicas_each_know_only_their_own_dispatches() -> None:
    policies, sync, one = _run(ShareModel())
    want = learned_state(one.state)  # type: ignore[attr-defined]
    for p in policies:
        got = learned_state(p.state)
        assert got != want
        assert len(got["sessions"]) <= len(want["sessions"])
    assert sync.delivered == 0 and sync.in_transit == 0


def test_load_counts_own_then_everyone_s_once_delivered() -> None:
    clock = Clock()
    sync = ReplicaSync(3, WORKERS, ShareModel.parse("load", 0.5), _policies(3, clock))
    route = RouteRequest(model="m", chain=(1, 2, 3), session_id="s")
    sync.dispatched(0, 1.0, 2, route, 300)
    sync.dispatched(1, 1.1, 2, route, 200)
    assert sync.prefill(0)[2] == 300 and sync.in_flight(0)[2] == 1  # own at once
    sync.deliver(1.49)
    assert sync.prefill(2)[2] == 0 and sync.in_flight(2)[2] == 0  # not yet
    sync.deliver(1.5)
    assert sync.prefill(2)[2] == 300 and sync.prefill(1)[2] == 500 and sync.prefill(0)[2] == 300
    sync.deliver(1.6)
    assert [sync.prefill(r)[2] for r in range(3)] == [500, 500, 500]
    assert [sync.in_flight(r)[2] for r in range(3)] == [2, 2, 2]
    sync.prefill_done(0, 2.0, 2, 300)
    sync.finished(0, 3.0, 2)
    assert sync.prefill(0)[2] == 200 and sync.in_flight(0)[2] == 1
    assert sync.prefill(1)[2] == 500  # the first token is still in transit
    sync.deliver(3.5)
    assert [sync.prefill(r)[2] for r in range(3)] == [200, 200, 200]
    assert [sync.in_flight(r)[2] for r in range(3)] == [1, 1, 1]
    assert sync.own[1][2].prefill_tokens == 200 and sync.own[2][2].prefill_tokens == 0
    # `load` alone shares no learned state (and these policies never dispatched themselves)
    assert learned_state(sync.policies[2].state) == {"index": {}, "fill": {}, "sessions": []}


def test_a_late_note_never_pins_a_session_back_to_an_older_turn() -> None:
    clock = Clock()
    policies = _policies(2, clock)
    sync = ReplicaSync(2, WORKERS, ShareModel.parse("sessions", 0.1), policies)
    older = RouteRequest(model="m", session_id="s", prompt_tokens=100)
    newer = RouteRequest(model="m", session_id="s", prompt_tokens=200)
    clock.now = 1.0
    policies[0].on_dispatch("w0", older)
    sync.dispatched(0, 1.0, 0, older, 0)
    clock.now = 1.05
    policies[1].on_dispatch("w1", newer)
    sync.dispatched(1, 1.05, 1, newer, 0)
    sync.deliver(1.2)
    for p in policies:
        assert p.state.sessions.lookup("s", 1.2) == ("w1", 200)
        assert learned_state(p.state)["index"] == {}  # sessions alone: no index entries


def test_pending_dispatches_reach_the_other_replicas_precise_index() -> None:
    # Blocks sent to a worker and not yet in its KV events count as held there for the other
    # replicas too (what [cluster] ships), until the first token (+ settle_s).
    clock = Clock()
    policies = [
        make_policy(
            "kv_aware", options=OPTIONS, clock=clock, state=RoutingState(OPTIONS, PreciseIndex())
        )
        for _ in range(2)
    ]
    for p in policies:
        p.state.precise.set_live("w1", True)
    blocks = (11, 12, 13, 14)
    route = RouteRequest(model="m", block_chain=blocks, chain=blocks, dense_blocks=4)
    for parts, want in (("load,index,sessions", {}), ("all", {"w1": 4})):
        sync = ReplicaSync(2, WORKERS, ShareModel.parse(parts, 0.1), policies)
        policies[0].on_dispatch("w1", route)
        sync.dispatched(0, 1.0, 1, route, 100)
        sync.deliver(1.1)
        assert policies[1].state.precise.match(blocks, 1.1) == want
        sync.prefill_done(0, 2.0, 1, 100, route)
        sync.deliver(2.1)  # the first token: what is still pending lapses settle_s later
        assert policies[1].state.precise.match(blocks, 2.1 + 1.01) == {}
        assert policies[0].state.precise.match(blocks, 1.5) == {"w1": 4}  # its own, always


def test_share_model_parsing_and_labels() -> None:
    assert ShareModel.parse(None).independent and ShareModel.parse("none").independent
    assert ShareModel.parse("all").parts == {"load", "index", "sessions", "pending"}
    m = ShareModel.parse("index, load", 0.25)
    assert m.parts == {"index", "load"} and "load" in m and "sessions" not in m
    assert m.label(4) == "shared load+index, 0.25 s late" and m.label(1) == "one gateway"
    assert ShareModel.parse("all").label(4) == "shared all, 0.1 s late"
    three = ShareModel.parse("load,index,sessions")
    assert three.label(4) == "shared load+index+sessions, 0.1 s late"
    assert ShareModel.parse("all").to_json(4)["parts"] == ["load", "index", "sessions", "pending"]
    assert ShareModel.parse("pending").label(2) == "shared pending, 0.1 s late"
    assert ShareModel().label(4) == "independent"
    assert ShareModel().to_json(4) == {
        "model": "independent", "parts": [], "delay_s": None, "label": "independent",
    }  # fmt: skip
    assert ShareModel.parse("all").to_json(1)["model"] == "single"
    assert ShareModel.parse("all", 0.0).to_json(2)["delay_s"] == 0.0
    for bad in ("all,load", "all,pending", "prefix", "none,load"):
        with pytest.raises(ValueError):
            ShareModel.parse(bad)
    with pytest.raises(ValueError):
        ShareModel.parse("all", -0.1)
    with pytest.raises(ValueError):
        ReplicaSync(0, WORKERS, ShareModel(), [])
