"""How peers' notes are resolved against what a replica knows: session turns in the shared log's
order when concurrent and by time otherwise, and notes about a forgotten worker (or an earlier
process of it) skipped."""

from __future__ import annotations

from scoring.learned import Learned, apply_learned
from scoring.session import SessionTable
from scoring.state import RoutingState

WORKERS = {"w0", "w1"}
CHAIN = tuple(range(100, 108))


def test_concurrent_turns_resolve_by_log_order_the_same_way_on_both_replicas() -> None:
    """A routed turn 1 to w0 at 10.000, B turn 2 to w1 at 10.002; the log holds A's then B's.
    Each replica places the other's turn a few ms late, so "the later time wins" swapped them."""
    a, b = SessionTable(), SessionTable()
    a.put("s", "w0", 10.000)
    b.put("s", "w1", 10.002)
    # A reads its own note back, then B's (seen at 10.009: late); B reads A's (seen at 10.006),
    # then its own.
    assert a.learn("s", "w0", 10.000, own=True, concurrent_s=1.0)
    assert a.learn("s", "w1", 10.009, concurrent_s=1.0)
    assert not b.learn("s", "w0", 10.006, concurrent_s=1.0)  # precedes B's turn in the log
    assert b.learn("s", "w1", 10.002, own=True, concurrent_s=1.0)  # confirmed
    assert a.get("s", 10.1) == b.get("s", 10.1) == "w1"


def test_a_turn_routed_here_gives_way_to_a_clearly_newer_one_only() -> None:
    t = SessionTable()
    t.put("s", "w0", 10.0)
    assert not t.learn("s", "w1", 10.5, concurrent_s=1.0)  # concurrent: our turn comes later
    assert t.learn("s", "w1", 11.5, concurrent_s=1.0)  # clearly newer
    assert not t.learn("s", "w0", 10.0, own=True, concurrent_s=1.0)  # ours, clearly older
    assert t.get("s", 12.0) == "w1"


def test_an_older_own_note_does_not_displace_a_newer_unconfirmed_turn() -> None:
    t = SessionTable()
    t.put("s", "w0", 10.0)
    t.put("s", "w1", 10.3)  # the next turn, before turn 1's note came back
    assert not t.learn("s", "w0", 10.0, own=True, concurrent_s=1.0)
    assert t.get("s", 10.4) == "w1"


def test_a_clearly_older_note_never_wins_whatever_its_log_position() -> None:
    t = SessionTable()
    assert t.learn("s", "w0", 20.0, concurrent_s=1.0)
    assert not t.learn("s", "w1", 15.0, concurrent_s=1.0)  # an outage backlog, published late
    assert t.learn("s", "w1", 19.5, concurrent_s=1.0)  # concurrent: the later in the log wins
    assert t.get("s", 20.1) == "w1"


def test_notes_from_before_a_worker_was_forgotten_are_skipped() -> None:
    st = RoutingState()
    st.forget_worker("w0", now=50.0)
    old = Learned("w0", CHAIN, len(CHAIN), (), "s0", 10, 49.0)
    new = Learned("w0", CHAIN, len(CHAIN), (), "s1", 10, 51.0)
    assert apply_learned(st, [old], known=WORKERS) == 0
    assert st.index.match(CHAIN) == {} and st.sessions.get("s0", 52.0) is None
    assert apply_learned(st, [new], known=WORKERS) == 1
    assert st.index.match(CHAIN) == {"w0": len(CHAIN)}


def test_notes_from_before_a_workers_process_started_are_skipped() -> None:
    st = RoutingState()
    w1 = Learned("w1", CHAIN, len(CHAIN), (), "s1", 10, 5.0)
    w0 = w1._replace(worker="w0", session_id="s0")
    assert apply_learned(st, [w0, w1], known=WORKERS, not_before={"w0": 6.0}) == 1
    assert st.index.match(CHAIN) == {"w1": len(CHAIN)}
    assert st.sessions.get("s0", 7.0) is None and st.sessions.get("s1", 7.0) == "w1"


def test_own_notes_read_back_teach_sessions_only() -> None:
    st = RoutingState()
    e = Learned("w0", CHAIN, len(CHAIN), (), "s", 10, 5.0)
    apply_learned(st, [e], known=WORKERS, own=True)
    assert st.index.match(CHAIN) == {}  # learned when it was routed, not again
    assert st.sessions.get("s", 6.0) == "w0"


def test_forgetting_learned_state_keeps_the_forget_time_alone() -> None:
    st = RoutingState(clock=lambda: 100.0)
    st.index.record("w0", CHAIN, dense=len(CHAIN), tail_ends=())
    st.forget_learned("w0")
    assert st.index.match(CHAIN) == {} and "w0" not in st.forgot_at
    st.forget_worker("w0")
    assert st.forgot_at["w0"] == 100.0
