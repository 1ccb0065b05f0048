from __future__ import annotations

import pytest

from scoring.session import SessionTable


def test_remembers_the_last_worker_of_a_session() -> None:
    t = SessionTable(ttl_s=60)
    t.put("s1", "a", now=0)
    t.put("s1", "b", now=1)
    t.put("s2", "c", now=1)
    assert t.get("s1", now=2) == "b" and t.get("s2", now=2) == "c"
    assert t.get("nope", now=2) is None


def test_lookup_returns_the_last_turns_prompt_size() -> None:
    t = SessionTable(ttl_s=60)
    t.put("s", "a", now=0, prompt_tokens=1200)
    t.put("s", "b", now=1, prompt_tokens=1500)
    assert t.lookup("s", now=2) == ("b", 1500)
    assert t.lookup("s", now=100) is None


def test_entries_expire_after_the_ttl_since_last_use() -> None:
    t = SessionTable(ttl_s=10)
    t.put("s", "a", now=0)
    assert t.get("s", now=10) == "a"
    t.put("s", "a", now=9)  # a new turn refreshes it
    assert t.get("s", now=18) == "a"
    assert t.get("s", now=19.5) is None
    assert len(t) == 0


def test_put_drops_expired_entries_and_bounds_the_table_lru_first() -> None:
    t = SessionTable(ttl_s=100, max_size=3)
    for i, sid in enumerate("abcd"):
        t.put(sid, "w", now=i)
    assert len(t) == 3 and t.get("a", now=4) is None and t.get("d", now=4) == "w"
    t.put("b", "w", now=5)  # b becomes most recent: c is next to go
    t.put("e", "w", now=6)
    assert t.get("c", now=6) is None and t.get("b", now=6) == "w"
    t.put("f", "w", now=200)  # everything else idle > ttl: swept on put
    assert len(t) == 1


def test_remove_worker_drops_its_sessions_only() -> None:
    t = SessionTable()
    t.put("s1", "a", now=0)
    t.put("s2", "b", now=0)
    t.put("s3", "a", now=0)
    assert t.remove_worker("a") == 2
    assert t.get("s1", now=1) is None and t.get("s2", now=1) == "b"


def test_rejects_nonsense_bounds() -> None:
    with pytest.raises(ValueError):
        SessionTable(ttl_s=0)
    with pytest.raises(ValueError):
        SessionTable(max_size=0)


def test_commitment_counts_each_active_session_once_at_its_latest_turn() -> None:
    t = SessionTable(active_s=60.0)
    t.put("s1", "a", 0.0, 10_000)
    t.put("s2", "a", 1.0, 5_000)
    t.put("s3", "b", 2.0, 7_000)
    assert t.committed(2.0) == {"a": 15_000, "b": 7_000}
    t.put("s1", "a", 10.0, 12_000)  # the next turn replaces the last one, not added to it
    assert t.committed(10.0)["a"] == 17_000
    t.put("s2", "b", 20.0, 6_000)  # moved: leaves a, joins b
    assert t.committed(20.0) == {"a": 12_000, "b": 13_000}


def test_commitment_expires_after_the_active_window_but_not_on_a_later_turn() -> None:
    t = SessionTable(active_s=60.0)
    t.put("s1", "a", 0.0, 10_000)
    t.put("s2", "a", 0.0, 4_000)
    t.put("s1", "a", 50.0, 11_000)  # s1 is still active at 61 s, s2 is not
    assert t.committed(61.0)["a"] == 11_000
    assert t.committed(111.0) == {}  # none left: nothing for the scorer to weigh
    assert t.get("s2", 111.0) == "a"  # the pin itself lives for the TTL


def test_remove_worker_drops_its_commitment() -> None:
    t = SessionTable()
    t.put("s1", "a", 0.0, 10_000)
    t.put("s2", "b", 0.0, 3_000)
    t.remove_worker("a")
    assert t.committed(1.0) == {"b": 3_000}
    t.put("s1", "b", 2.0, 11_000)  # the session comes back elsewhere: nothing to subtract
    assert t.committed(2.0) == {"b": 14_000}


def test_undo_takes_back_a_refused_turn_pin_and_commitment() -> None:
    t = SessionTable(active_s=60.0)
    t.put("s1", "a", 0.0, 1_000)
    before = t.before("s1", 5.0)
    t.put("s1", "b", 5.0, 90_000)  # a prompt worker b will refuse as too long
    assert t.get("s1", 5.0) == "b" and t.committed(5.0) == {"b": 90_000}
    t.undo("s1", "b", before, 5.1)
    assert t.lookup("s1", 6.0) == ("a", 1_000) and t.committed(6.0) == {"a": 1_000}
    assert t.committed(61.0) == {}  # the restored turn still expires on its own schedule
    fresh = t.before("s2", 70.0)  # a session's first turn, refused: it is not pinned anywhere
    t.put("s2", "b", 70.0, 500)
    t.undo("s2", "b", fresh, 70.1)
    assert t.get("s2", 71.0) is None and t.committed(71.0) == {}


def test_undo_leaves_a_later_turn_alone() -> None:
    t = SessionTable()
    before = t.before("s1", 0.0)
    t.put("s1", "b", 0.0, 5_000)
    t.put("s1", "c", 1.0, 6_000)  # the next turn went elsewhere before the refusal came back
    t.undo("s1", "b", before, 1.5)
    assert t.lookup("s1", 2.0) == ("c", 6_000) and t.committed(2.0) == {"c": 6_000}


def test_undo_leaves_a_later_turn_to_the_same_worker_alone() -> None:
    # Review finding: only the worker was compared, so undoing turn N after turn N+1 went to
    # the same worker restored the pin from before N (or dropped a first turn's session) and
    # took N+1's commitment off.
    t = SessionTable()
    t.put("s1", "a", 0.0, 1_000)
    before = t.before("s1", 5.0)
    t.put("s1", "b", 5.0, 6_000)  # turn N, refused later
    t.put("s1", "b", 6.0, 7_000)  # turn N+1, same worker, running
    t.undo("s1", "b", before, 6.5)
    assert t.lookup("s1", 7.0) == ("b", 7_000) and t.committed(7.0) == {"b": 7_000}
    first = t.before("s2", 10.0)  # and a session's first two calls, the first refused
    t.put("s2", "c", 10.0, 500)
    t.put("s2", "c", 10.5, 600)
    t.undo("s2", "c", first, 11.0)
    assert t.get("s2", 11.0) == "c"


def test_undo_does_not_pin_back_to_a_worker_removed_since() -> None:
    # Review finding: the pin and commitment `remove_worker` had dropped came back with undo.
    t = SessionTable(active_s=60.0)
    t.put("s1", "a", 0.0, 1_000)
    before = t.before("s1", 5.0)
    t.put("s1", "b", 5.0, 2_000)
    t.remove_worker("a")  # a left (or restarted: its cache is gone)
    t.undo("s1", "b", before, 6.0)
    assert t.get("s1", 7.0) is None and t.committed(7.0) == {}


def test_active_tokens_is_the_share_still_in_the_commitment() -> None:
    t = SessionTable(active_s=60.0)
    t.put("s1", "a", 0.0, 20_000)
    assert t.active_tokens("s1", "a") == 20_000 and t.active_tokens("s1", "b") == 0
    t.committed(61.0)  # expired from the commitment, still pinned (ttl 600 s)
    assert t.get("s1", 61.0) == "a" and t.active_tokens("s1", "a") == 0
