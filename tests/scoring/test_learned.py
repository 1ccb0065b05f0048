"""What replicas learn from each other's dispatches (scoring.learned): a replayed
dispatch must teach a peer exactly what the dispatch taught the replica that made it."""

from __future__ import annotations

import random

from scoring.learned import RETRACT_SCAN, Journal, Learned, apply_learned
from scoring.policy import make_policy
from scoring.route_key import route_request
from scoring.session import SessionTable
from scoring.state import RoutingState
from scoring.views import RoutingOptions, WorkerView

WORKERS = [f"w{i}" for i in range(4)]


def views() -> list[WorkerView]:
    return [WorkerView(name=n) for n in WORKERS]


def body(system: int, user: int, turns: int = 1) -> dict[str, object]:
    msgs = [{"role": "system", "content": f"system prompt {system} " * 60}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"user {user} turn {t} " * 20})
        msgs.append({"role": "assistant", "content": f"answer {t} " * 10})
    return {"model": "m", "messages": msgs}


def replica(seed: int) -> tuple[object, RoutingState]:
    o = RoutingOptions()
    state = RoutingState(o)
    state.journal = Journal()
    return make_policy("kv_aware", options=o, state=state, rng=random.Random(seed)), state


def route(policy: object, b: dict[str, object], session: str | None = None) -> object:
    return route_request(
        "chat",
        b,
        model="m",
        session_id=session,
        options=policy.options,  # type: ignore[attr-defined]
        hash_prefix=True,
    )


def test_a_replayed_dispatch_teaches_a_peer_what_it_taught_its_replica() -> None:
    a, sa = replica(1)
    _b, sb = replica(2)
    rng = random.Random(7)
    chains = []
    for i in range(60):
        r = route(a, body(rng.randrange(5), i, turns=1 + i % 3), session=f"s{i % 9}")
        d = a.choose(views(), r)  # type: ignore[attr-defined]
        a.on_dispatch(d.worker.name, r)  # type: ignore[attr-defined]
        chains.append(r.chain)
    assert sa.journal is not None and len(sa.journal) == 60
    applied = apply_learned(sb, sa.journal.take(1000), known=set(WORKERS))
    assert applied == 60
    for c in chains:
        assert c and sb.index.match(c) == sa.index.match(c) != {}
    for i in range(9):
        assert sb.sessions.lookup(f"s{i}", 0.0) == sa.sessions.lookup(f"s{i}", 0.0) is not None


def test_without_replay_the_peer_knows_nothing() -> None:
    """The counterpart of the test above: it could fail."""
    a, sa = replica(1)
    _b, sb = replica(2)
    r = route(a, body(0, 0), session="s")
    a.on_dispatch("w2", r)  # type: ignore[attr-defined]
    assert sa.index.match(r.chain) == {"w2": len(r.chain)}
    assert sb.index.match(r.chain) == {}
    assert sb.sessions.get("s", 0.0) is None


def test_unknown_workers_and_foreign_chains_are_skipped() -> None:
    _a, sb = replica(2)
    chain = (11, 22, 33)
    e = Learned("w9", chain, 3, (), "s1", 100, 0.0)
    assert apply_learned(sb, [e], known=set(WORKERS)) == 0
    assert sb.index.match(chain) == {} and sb.sessions.get("s1", 0.0) is None
    # Chains hashed under other options: the session is learned, the chain is not.
    e = Learned("w1", chain, 3, (), "s1", 100, 0.0)
    assert apply_learned(sb, [e], known=set(WORKERS), with_chains=False) == 1
    assert sb.index.match(chain) == {}
    assert sb.sessions.get("s1", 0.0) == "w1"


def test_a_late_note_does_not_overwrite_a_later_turn() -> None:
    t = SessionTable()
    t.put("s", "w1", 10.0, 500)  # turn 2, routed here at t=10
    assert not t.put_if_newer("s", "w0", 9.95, 400)  # a peer's turn 1, learned late
    assert t.lookup("s", 10.1) == ("w1", 500)
    assert t.put_if_newer("s", "w2", 10.5, 600)  # a peer's turn 3
    assert t.lookup("s", 10.6) == ("w2", 600)
    # Two peers' notes in one read, applied in order: the later dispatch wins either way round.
    assert t.put_if_newer("s", "w3", 11.0) and not t.put_if_newer("s", "w0", 10.9)
    assert t.get("s", 11.1) == "w3"


def test_journal_is_bounded_and_a_failed_publish_goes_back_in_front() -> None:
    j = Journal(max_size=5)
    for i in range(7):
        j.note(Learned(f"w{i}", (), 0, (), None, i, float(i)))
    assert len(j) == 5 and j.dropped == 2 and j.noted == 7
    got = j.take(3)
    assert [e.worker for e in got] == ["w2", "w3", "w4"]
    j.note(Learned("w7", (), 0, (), None, 7, 7.0))
    j.put_back(got)
    assert [e.worker for e in j.take(10)] == ["w3", "w4", "w5", "w6", "w7"]
    assert j.dropped == 3
    # Filled meanwhile: the taken batch's oldest are what is lost.
    j2 = Journal(max_size=3)
    for i in range(3):
        j2.note(Learned(f"a{i}", (), 0, (), None, 0, 0.0))
    batch = j2.take(3)
    for i in range(2):
        j2.note(Learned(f"b{i}", (), 0, (), None, 0, 0.0))
    j2.put_back(batch)
    assert [e.worker for e in j2.take(10)] == ["a2", "b0", "b1"]
    assert j2.dropped == 2


def test_kv_event_mode_peers_learn_pending_dispatches_until_their_prefill_ends() -> None:
    """A prefix one replica sent, not yet in any event, counts as held on its worker at the
    other replicas too (else they scatter it while the prefill queues); its first token ends it
    there as here."""
    from scoring.precise import PreciseIndex
    from scoring.views import RouteRequest

    clock = [100.0]
    replicas = []
    for seed in (1, 2):
        o = RoutingOptions()
        precise = PreciseIndex(settle_s=1.0, pending_ttl_s=300.0)
        for n in WORKERS:
            precise.set_live(n, True, clock[0])
        state = RoutingState(o, precise)
        state.journal = Journal()
        p = make_policy("kv_aware", options=o, state=state, rng=random.Random(seed))
        p._clock = lambda: clock[0]  # type: ignore[attr-defined]
        replicas.append((p, state))
    (a, sa), (_b, sb) = replicas
    blocks = tuple(range(1000, 1040))
    r = RouteRequest(model="m", chain=blocks[:8], dense_blocks=8, block_chain=blocks)
    a.on_dispatch("w3", r)  # type: ignore[attr-defined]
    assert sa.precise is not None and sb.precise is not None
    assert sa.precise.match(blocks, clock[0]) == {"w3": 40}
    assert sb.precise.match(blocks, clock[0]) == {}  # not yet shared
    assert sa.journal is not None
    apply_learned(sb, sa.journal.take(10), known=set(WORKERS))
    assert sb.precise.match(blocks, clock[0]) == {"w3": 40}
    clock[0] += 5.0  # the prefill queued for a while: still pending at both
    assert sb.precise.match(blocks, clock[0]) == {"w3": 40}
    a.on_prefill_done("w3", r)  # type: ignore[attr-defined]
    apply_learned(sb, sa.journal.take(10), known=set(WORKERS))
    clock[0] += 1.5  # past settle_s, and no event stored the blocks: gone at both
    assert sa.precise.match(blocks, clock[0]) == sb.precise.match(blocks, clock[0]) == {}


def test_a_refused_dispatch_s_note_is_retracted_unless_shipped_or_buried() -> None:
    j = Journal()
    first = Learned("w0", (), 0, (), None, 0, 0.0)
    j.note(first)
    twin = Learned("w0", (), 0, (), None, 0, 0.0)  # equal, but another dispatch's note
    j.note(twin)
    assert j.retract(first) and [e is twin for e in j.take(10)] == [True]
    assert not j.retract(twin)  # shipped already: the other replicas keep it
    j.note(first)
    for i in range(RETRACT_SCAN):
        j.note(Learned(f"w{i}", (), 0, (), None, 0, 1.0))
    assert not j.retract(first) and len(j) == RETRACT_SCAN + 1  # too deep to look for
