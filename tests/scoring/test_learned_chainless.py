"""A peer's notes about workers of a model it keys the other way (token mode against text mode)
teach their sessions but not their chains, nor their KV-event pending keys: neither can match a
key hashed here, and recorded they only take the worker's capacity."""

from __future__ import annotations

from scoring.learned import Learned, apply_learned
from scoring.precise import PreciseIndex
from scoring.state import RoutingState

CHAIN = (11, 22, 33)
BLOCKS = (101, 102, 103)


def test_chainless_workers_learn_the_session_alone_and_the_others_everything() -> None:
    st = RoutingState(precise=PreciseIndex(pending_ttl_s=300.0, settle_s=1.0))
    notes = [
        Learned("w0", CHAIN, 3, (), "s0", 100, 5.0, BLOCKS),
        Learned("w1", CHAIN, 3, (), "s1", 100, 5.0, BLOCKS),
    ]
    n = apply_learned(st, notes, known={"w0", "w1"}, chainless=frozenset({"w0"}))
    assert n == 2
    assert st.index.match(CHAIN) == {"w1": 3}
    assert st.index.size("w0") == 0
    p = st.precise
    assert p is not None
    for w in ("w0", "w1"):
        p.set_live(w, True, 5.0)
    assert p.match(BLOCKS, 5.0) == {"w1": 3}
    assert p.pending_size() == 3
    assert st.sessions.get("s0", 5.0) == "w0"
    assert st.sessions.get("s1", 5.0) == "w1"
