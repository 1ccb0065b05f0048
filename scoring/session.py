"""Session id -> the worker that served its last turn, bounded and expiring.

Multi-turn chats and agents resend their whole history each turn; the worker that served turn N
holds it. The prefix index sees that too, but a session id survives what the index cannot express
(a context longer than the hashed range) and is a cheap stickiness hint for ties, so it is kept as
a second signal. Pure: the caller passes ``now``, so the
same table runs under the simulator's virtual clock.

It also keeps each worker's *commitment*: the last-turn prompts of the sessions pinned there
that were active within ``active_s``. Those contexts come back (an agent's next call, a chat's
next turn) and grow, so a worker already carrying several long ones is a worse home for a new
session than its cache hit on a shared preamble suggests (``kv_aware`` weighs it).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

__all__ = ["SessionTable"]

# Worker removals remembered for `SessionTable.undo` (far more than can happen between a
# dispatch and its refusal).
_REMOVALS_KEPT = 256
# `SessionTable._noted` is compacted at twice its size after the last compaction, at least this.
_NOTED_MIN = 1024


class SessionTable:
    """LRU map with a TTL; entries stay ordered by last use, so expiry pops from the front."""

    def __init__(
        self, ttl_s: float = 600.0, max_size: int = 100_000, active_s: float = 60.0
    ) -> None:
        if ttl_s <= 0 or max_size <= 0 or active_s < 0:
            raise ValueError("ttl_s and max_size must be positive, active_s >= 0")
        self.ttl_s = ttl_s
        self.max_size = max_size
        self.active_s = active_s
        # session -> (worker, last use, prompt tokens of the last turn sent there, local): local
        # is True for a turn routed by this replica whose note the shared stream has not shown
        # back yet (``learn``: every note read before it precedes it in the stream).
        self._table: OrderedDict[str, tuple[str, float, int, bool]] = OrderedDict()
        # Commitment: worker -> tokens of its active sessions; the active ones and when each
        # turn was noted (in note order: a peer's late note may expire a little late).
        self._committed: dict[str, int] = {}
        self._active: dict[str, tuple[str, float, int]] = {}
        self._noted: deque[tuple[float, str]] = deque()
        # `_noted` is compacted (`_compact`) when it grows past this: its entries are dropped
        # lazily, so a session re-put, undone or evicted for ``max_size`` leaves one behind.
        self._noted_cap = _NOTED_MIN
        # Workers removed so far (their count is a mark `before` takes), for `undo` not to pin a
        # session back to one gone since; bounded, the oldest forgotten.
        self._removed: deque[str] = deque(maxlen=_REMOVALS_KEPT)
        self._removals = 0

    def __len__(self) -> int:
        return len(self._table)

    def get(self, session_id: str, now: float) -> str | None:
        """The session's last worker, or None when unknown or idle for longer than the TTL."""
        entry = self.lookup(session_id, now)
        return entry[0] if entry else None

    def lookup(self, session_id: str, now: float) -> tuple[str, int] | None:
        """``(last worker, prompt tokens of the last turn)``, or None (unknown or expired).

        The last turn's prompt is what that worker most likely still caches for the next turn,
        which can exceed what the prefix index hashes of an agent's context.
        """
        entry = self._table.get(session_id)
        if entry is None:
            return None
        worker, seen, tokens, _local = entry
        if now - seen > self.ttl_s:
            del self._table[session_id]
            return None
        return worker, tokens

    def put(self, session_id: str, worker: str, now: float, prompt_tokens: int = 0) -> None:
        """The session's latest turn went to ``worker`` (routed here); also expires and bounds
        the table."""
        self._put(session_id, worker, now, prompt_tokens, True)

    def _put(
        self, session_id: str, worker: str, now: float, prompt_tokens: int, local: bool
    ) -> None:
        table = self._table
        table[session_id] = (worker, now, prompt_tokens, local)
        table.move_to_end(session_id)
        self._commit(session_id, worker, now, prompt_tokens)
        while table:
            sid, (_w, seen, _t, _l) = next(iter(table.items()))
            if len(table) > self.max_size:
                # Evicted for room: its commitment goes with it, or the commitment maps would
                # hold every session routed within active_s, whatever max_size says.
                del table[sid]
                e = self._active.pop(sid, None)
                if e is not None:
                    self._uncommit(e[0], e[2])
            elif now - seen > self.ttl_s:
                del table[sid]
            else:
                break

    def before(self, session_id: str, now: float) -> tuple[Any, ...]:
        """What ``undo`` needs to take back the ``put`` about to be made, at ``now``, for this
        session."""
        return self._table.get(session_id), self._active.get(session_id), now, self._removals

    def undo(self, session_id: str, worker: str, before: tuple[Any, ...], now: float) -> None:
        """Take back a turn that ``worker`` refused (``before`` from just before its ``put``):
        the session is pinned where it was and the refused prompt leaves that worker's
        commitment. A later turn is left alone, to another worker or the same one (found by
        its time), and so is a pin to a worker removed since (its cache is gone)."""
        entry, active, put_at, removals = before
        table = self._table
        cur = table.get(session_id)
        if cur is None or cur[0] != worker or cur[1] != put_at:
            return
        gone = self._gone_since(removals)
        if entry is None or entry[0] in gone:
            del table[session_id]
        else:
            table[session_id] = entry
        old = self._active.get(session_id)
        if old is not None and old[0] == worker and old[1] == put_at:
            del self._active[session_id]
            self._uncommit(old[0], old[2])
            if active is not None and active[1] >= now - self.active_s and active[0] not in gone:
                # Younger than active_s: it expires as before, by its queued note (noted again:
                # a compaction since the put dropped the first, which no longer matched).
                self._active[session_id] = active
                self._add_commit(active[0], active[2])
                self._noted.append((active[1], session_id))

    def _gone_since(self, mark: int) -> set[str]:
        n = self._removals - mark
        if n <= 0:
            return set()
        removed = self._removed
        return set(removed) if n >= len(removed) else set(list(removed)[-n:])

    def active_tokens(self, session_id: str | None, worker: str) -> int:
        """The session's share of ``worker``'s commitment: its last turn's tokens while that
        turn, sent there, is active (within ``active_s``); else 0."""
        e = self._active.get(session_id) if session_id else None
        return e[2] if e is not None and e[0] == worker else 0

    def put_if_newer(self, session_id: str, worker: str, at: float, prompt_tokens: int = 0) -> bool:
        """Another replica's turn, dispatched at ``at`` (this clock, estimated): applied unless the
        table holds a later turn of the session. Without the check a peer's note, a sync interval
        late, would overwrite the turn that followed it here and pin the session to a stale
        worker. ``learn`` with no concurrency window."""
        return self.learn(session_id, worker, at, prompt_tokens)

    def learn(
        self,
        session_id: str,
        worker: str,
        at: float,
        prompt_tokens: int = 0,
        *,
        own: bool = False,
        concurrent_s: float = 0.0,
    ) -> bool:
        """A turn's note read from the replicas' shared, totally ordered log (``own``: one this
        replica routed, read back), in log order; True when it now pins the session.

        Why not simply "the later ``at`` wins": each replica places a peer's ``at`` on its own
        clock with an error of milliseconds, so two turns routed that close together through two
        replicas (an agent's parallel calls behind a load balancer) were each seen as the
        other's later one, and the two replicas swapped pins. Times decide only turns more than
        ``concurrent_s`` apart (an outage backlog published late must not undo a newer turn);
        closer ones are concurrent and the note later in the log wins, an order every replica
        reads the same. A turn routed here is not in the log yet, so it is later than every note
        read before it comes back: it stands against those unless they are clearly newer, and is
        confirmed (not re-applied) when its own note comes back. A stuck confirmation (its note
        dropped in a long outage) only keeps deciding concurrent notes its way.

        Stored as seen at ``at``: an entry up to one sync late sits behind newer ones and
        outlives its TTL by that much, which the front-first expiry tolerates."""
        table = self._table
        entry = table.get(session_id)
        if entry is not None:
            cur_worker, seen, _tokens, local = entry
            if local:
                if own and cur_worker == worker and seen == at:
                    table[session_id] = (cur_worker, seen, _tokens, False)  # confirmed
                    return True
                if at <= seen + concurrent_s:
                    return False
            elif at < seen - concurrent_s:
                return False
        self._put(session_id, worker, at, prompt_tokens, False)
        return True

    def remove_worker(self, worker: str) -> int:
        """Drop every session pinned to a worker that left the fleet; returns how many."""
        gone = [sid for sid, (w, _seen, _t, _l) in self._table.items() if w == worker]
        for sid in gone:
            del self._table[sid]
        for sid in [sid for sid, e in self._active.items() if e[0] == worker]:
            del self._active[sid]
        self._committed.pop(worker, None)
        self._removed.append(worker)
        self._removals += 1
        return len(gone)

    def committed(self, now: float) -> dict[str, int]:
        """Worker -> prompt tokens of the sessions whose last turn went there within
        ``active_s`` (each session counted once, at its latest turn). Read-only for callers."""
        self._expire(now)
        return self._committed

    def _commit(self, session_id: str, worker: str, now: float, tokens: int) -> None:
        old = self._active.get(session_id)
        if old is not None:
            self._uncommit(old[0], old[2])
        self._active[session_id] = (worker, now, tokens)
        self._add_commit(worker, tokens)
        noted = self._noted
        noted.append((now, session_id))
        self._expire(now)
        if len(noted) > self._noted_cap:
            self._compact()

    def _compact(self) -> None:
        """Drop the notes that expire nothing any more (their session re-put since, undone,
        evicted or removed), keeping the rest in order: ``_noted`` then holds at most one note
        per active session, so it is bounded like ``_active``. Amortized O(1) a note: the next
        compaction waits for the queue to double."""
        active = self._active
        kept: deque[tuple[float, str]] = deque()
        seen: set[str] = set()
        for at, sid in self._noted:
            e = active.get(sid)
            if e is not None and e[1] == at and sid not in seen:
                seen.add(sid)
                kept.append((at, sid))
        self._noted = kept
        self._noted_cap = max(_NOTED_MIN, 2 * len(kept))

    def _expire(self, now: float) -> None:
        noted, active = self._noted, self._active
        horizon = now - self.active_s
        while noted and noted[0][0] < horizon:
            at, sid = noted.popleft()
            e = active.get(sid)
            if e is not None and e[1] == at:  # else a later turn replaced it
                del active[sid]
                self._uncommit(e[0], e[2])

    def _add_commit(self, worker: str, tokens: int) -> None:
        self._committed[worker] = self._committed.get(worker, 0) + tokens

    def _uncommit(self, worker: str, tokens: int) -> None:
        """Take a turn's tokens off; a worker left with none is dropped, so a fleet whose
        sessions all went idle costs the scorer nothing (it skips an empty commitment)."""
        left = self._committed.get(worker, 0) - tokens
        if left > 0:
            self._committed[worker] = left
        else:
            self._committed.pop(worker, None)
