"""Routing state stays bounded by its own limits whatever the traffic: the removed-worker times
(``RoutingState.forgot_at``) by the age of a replayable note, and the session commitment maps by
``session_max``."""

from __future__ import annotations

from collections.abc import Iterator

from scoring.learned import MAX_NOTE_AGE_S, Learned, apply_learned
from scoring.policy import make_policy
from scoring.route_key import route_request
from scoring.session import SessionTable
from scoring.state import RoutingState
from scoring.views import RoutingOptions, WorkerView

CHAIN = tuple(range(100, 108))


def test_forgot_at_keeps_a_day_of_removals_not_every_name_ever_removed() -> None:
    """Autoscaled pods, a new name each: one removed every 100 s for ~6 days."""
    clock = [0.0]
    policy = make_policy("kv_aware", clock=lambda: clock[0])
    st = policy.state
    n, step = 5_000, 100.0
    for i in range(n):
        clock[0] += step
        policy.on_worker_removed(f"vllm-{i:08x}")
    recent = [f"vllm-{i:08x}" for i in range(n) if clock[0] - (i + 1) * step <= MAX_NOTE_AGE_S]
    assert all(w in st.forgot_at for w in recent)  # every name a note could still be about
    assert len(st.forgot_at) <= 2 * max(1024, len(recent)) < n
    # What the kept entries are for still holds: a backlog note from before the removal is
    # skipped, one after it is applied.
    last = recent[-1]
    stale = Learned(last, CHAIN, 8, (), None, 0, clock[0] - 1.0)
    fresh = Learned(last, CHAIN, 8, (), None, 0, clock[0] + 1.0)
    assert apply_learned(st, [stale], known={last}) == 0
    assert apply_learned(st, [fresh], known={last}) == 1


class _Counting(dict[str, float]):
    """forgot_at, counting what reads it whole (a copy, an iteration) or per worker."""

    def __init__(self, *a: object) -> None:
        super().__init__(*a)  # type: ignore[arg-type]
        self.whole = 0
        self.lookups = 0

    def __iter__(self) -> Iterator[str]:
        self.whole += 1
        return super().__iter__()

    def keys(self):  # type: ignore[override]
        self.whole += 1
        return super().keys()

    def items(self):  # type: ignore[override]
        self.whole += 1
        return super().items()

    def copy(self) -> dict[str, float]:
        self.whole += 1
        return super().copy()

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        self.lookups += 1
        return super().get(key, default)


def test_apply_learned_looks_up_forgot_at_per_note_instead_of_copying_it() -> None:
    st = RoutingState()
    forgot = _Counting({f"gone-{i}": 50.0 for i in range(10_000)})
    forgot["w0"] = 100.0
    st.forgot_at = forgot
    notes = [
        Learned("w0", CHAIN, 8, (), None, 0, 99.0),  # before w0 was forgotten: skipped
        Learned("w0", CHAIN, 8, (), "s", 0, 101.0),
        Learned("w1", CHAIN, 8, (), None, 0, 101.0),
    ]
    n = apply_learned(st, notes, known={"w0", "w1"}, not_before={"w1": 102.0})
    assert n == 1  # w1's note predates its process (not_before): skipped too
    assert forgot.whole == 0 and forgot.lookups <= len(notes)
    assert st.index.match(CHAIN) == {"w0": len(CHAIN)}


def check_commitment(t: SessionTable) -> None:
    """``committed`` is the sum of the active entries, each of which can still expire."""
    want: dict[str, int] = {}
    for w, _at, tokens in t._active.values():
        want[w] = want.get(w, 0) + tokens
    assert t._committed == {w: v for w, v in want.items() if v > 0}
    noted = set(t._noted)
    assert all((at, sid) in noted for sid, (_w, at, _t) in t._active.items())


def test_commitment_maps_are_bounded_by_session_max() -> None:
    """10,000 distinct sessions within active_s into a table of 100: the commitment of the
    sessions evicted for room goes with them (it held all 10,000)."""
    t = SessionTable(ttl_s=600.0, max_size=100, active_s=60.0)
    for i in range(10_000):
        t.put(f"user-{i}", f"w{i % 4}", i * 0.001, 10)
    assert len(t) == 100
    assert len(t._active) <= 100
    assert len(t._noted) <= 2 * 1024
    assert sum(t.committed(10.0).values()) == 100 * 10  # the 100 sessions the table holds
    check_commitment(t)
    # They still expire on time.
    assert t.committed(10.0 + 61.0) == {}
    assert not t._active


def test_a_session_routed_again_and_again_leaves_one_note_to_expire() -> None:
    t = SessionTable(ttl_s=600.0, max_size=100, active_s=60.0)
    for i in range(10_000):
        t.put("agent", "w0", i * 0.001, 10 + i)
    assert len(t._noted) <= 2 * 1024
    assert t.committed(10.0) == {"w0": 10 + 9_999}
    assert t.committed(10.0 + 61.0) == {}


def test_a_turn_undone_after_its_notes_were_compacted_still_expires() -> None:
    t = SessionTable(ttl_s=600.0, max_size=100_000, active_s=60.0)
    t.put("s", "w0", 0.0, 7)
    before = t.before("s", 1.0)
    t.put("s", "w1", 1.0, 9)
    for i in range(5_000):  # enough other sessions for the notes to be compacted
        t.put(f"o{i}", "w2", 1.0, 1)
    t.undo("s", "w1", before, 1.0)  # w1 refused it: s is w0's again, with its first turn's
    check_commitment(t)
    assert t.committed(2.0)["w0"] == 7 and "w1" not in t.committed(2.0)
    assert t.committed(1.0 + 61.0) == {}  # nothing left behind that never expires


def test_the_policy_path_keeps_the_commitment_within_session_max() -> None:
    """The reviewer's scenario, scaled down: unique session ids through kv_aware."""
    clock = [0.0]
    o = RoutingOptions(session_max=50)
    p = make_policy("kv_aware", options=o, clock=lambda: clock[0])
    views = [WorkerView(f"w{i}", in_flight_at_scrape=0) for i in range(4)]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for i in range(3_000):
        clock[0] += 0.01
        r = route_request("chat", body, options=o, session_id=f"user-{i}")
        p.on_dispatch(p.choose(views, r).worker.name, r)
    s = p.state.sessions
    assert len(s) == 50 and len(s._active) <= 50 and len(s._noted) <= 2 * 1024
    check_commitment(s)
