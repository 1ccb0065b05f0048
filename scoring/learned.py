"""What one gateway replica learned from its own dispatches, for the other replicas to learn too.

The approximate prefix index and the session table are learned from the gateway's own routing
decisions: a replica knows that worker w holds a prompt's blocks because it sent that prompt
there. Behind a load balancer every replica sees a quarter of the traffic (with four), so each
learns a quarter of what the fleet holds, and the same prefix lands on different workers
(`bench.simulate --replicas 4`, Mooncake: hit rate 35.5% with one gateway, 10.8% with four). The
fix is to let every replica learn every replica's dispatches: a replica notes each dispatch here
(one tuple append on the request path), `gateway.cluster` ships the notes through Redis in
batches, and each peer replays them into its own state with ``apply``, exactly as its own
``on_dispatch`` would have.

Pure: no I/O, times come with the entries; the journal is bounded so a store outage costs the oldest
notes (approximate knowledge, counted in ``dropped``), never memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Container, Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from scoring.state import RoutingState

__all__ = ["MAX_NOTE_AGE_S", "Journal", "Learned", "apply_learned"]

# A note's dispatch (``at``) and its batch's publish are on one clock, at most this far apart (a
# note waits in the outbox for as long as Redis is away, which a day covers): the transport
# (`workers.learned_share.decode_batch`) refuses a row further apart, and a `RoutingState` forgets
# a worker's ``forgot_at`` this much after it (no note that old is replayed any more).
MAX_NOTE_AGE_S = 86_400.0


class Learned(NamedTuple):
    """One dispatch as the state learns it: what ``_Learning.on_dispatch`` records."""

    worker: str
    chain: tuple[int, ...]  # empty when the policy keeps no prefix index
    dense: int
    tail_ends: tuple[int, ...]
    session_id: str | None
    prompt_tokens: int
    at: float  # when it happened, on the clock of whoever holds the entry
    # KV-event mode: the request's worker-block keys, pending in the precise index until the
    # worker's events show them stored (`PreciseIndex.note_dispatch`). Empty otherwise.
    block_chain: tuple[int, ...] = ()
    # The dispatch's prefill is over (first token, or failure): its pending keys expire soon
    # (`PreciseIndex.dispatch_done`). Such an entry carries the worker and block_chain only.
    done: bool = False


# Newest journal entries a refused dispatch's note is looked for among (Journal.retract).
RETRACT_SCAN = 256


class Journal:
    """Dispatches not yet shipped to the other replicas, oldest first, at most ``max_size``."""

    def __init__(self, max_size: int = 50_000) -> None:
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self._q: deque[Learned] = deque(maxlen=max_size)
        self.noted = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._q)

    def note(self, entry: Learned) -> None:
        q = self._q
        if len(q) == q.maxlen:
            self.dropped += 1
        q.append(entry)
        self.noted += 1

    def retract(self, entry: Learned) -> bool:
        """Drop a note not shipped yet (its dispatch was refused); False when already gone.
        By identity, among the newest ``RETRACT_SCAN`` only: refusals come back within
        milliseconds of their note, and a journal backed up by a Redis outage must not make
        each refusal scan all of it."""
        q = self._q
        for i in range(len(q) - 1, max(-1, len(q) - 1 - RETRACT_SCAN), -1):
            if q[i] is entry:
                del q[i]
                return True
        return False

    def clear(self) -> int:
        """Drop every note not shipped yet, counted in ``dropped`` (their chains were hashed
        under routing options replaced since: `RoutingState.configure`); returns how many."""
        n = len(self._q)
        self._q.clear()
        self.dropped += n
        return n

    def take(self, limit: int) -> list[Learned]:
        """Up to ``limit`` oldest entries, removed from the journal."""
        q = self._q
        n = min(limit, len(q))
        return [q.popleft() for _ in range(n)]

    def put_back(self, entries: list[Learned]) -> None:
        """Entries a failed publish took: they go back in front, the oldest dropping first when
        the journal filled meanwhile (what a longer outage costs)."""
        q = self._q
        room = q.maxlen - len(q) if q.maxlen is not None else len(entries)
        keep = entries[len(entries) - room :] if room < len(entries) else entries
        self.dropped += len(entries) - len(keep)
        q.extendleft(reversed(keep))


def apply_learned(
    state: RoutingState,
    entries: Iterable[Learned],
    *,
    known: Container[str],
    with_chains: bool = True,
    chainless: Collection[str] = (),
    not_before: Mapping[str, float] | None = None,
    own: bool = False,
    concurrent_s: float = 0.0,
    on_error: Callable[[Learned, Exception], None] | None = None,
) -> int:
    """Replay dispatches read from the replicas' shared log into ``state``, in log order;
    returns how many applied. ``on_error``: a note whose replay raises is handed to it and
    skipped, the rest still applied (a peer's malformed note must not cost its batch);
    without it, the error propagates.

    ``at`` must be on this replica's clock (the transport shifts it). Session notes are resolved
    by `SessionTable.learn`: a turn clearly later than the one pinned wins, and of two turns
    within ``concurrent_s`` the one later in the log, an order every replica reads the same (so
    concurrent turns through two replicas end on the same worker everywhere).

    ``own``: this replica's notes read back, so that it resolves sessions the same way as its
    peers; only their session notes count (it learned the rest when it routed them).

    Skipped, besides workers this replica does not know (a peer on another config during a
    rollout: recording them would give the index a slot for a worker it can never route to):
    notes from before ``state.forgot_at[worker]`` (routing forgot the worker since: it left or
    restarted, and a peer's outage backlog must not teach its old cache back) and from before
    ``not_before[worker]`` (on this clock: when the worker's current process started, so notes
    about an earlier process, as a warm start's history holds, are not credited to it).

    ``with_chains`` False skips the prefix entries (chains hashed under other routing options
    mean nothing here) but keeps the sessions, whose keys do not depend on options.
    ``chainless``: workers whose notes' chains (and KV-event keys) are skipped alike, sessions
    kept: workers of a model the publisher keys otherwise (token mode against text mode), whose
    chains can never match one hashed here. Empty (the usual case) costs nothing a note.

    In KV-event mode the precise index learns the peers' pending dispatches too: what a replica
    has sent that the worker has not prefilled yet is in no event, so without them the other
    replicas send the same new prefix elsewhere for as long as the prefill queues
    (`bench.simulate --replicas 4`, Mooncake x5: hit rate 22.5% with one gateway, 13.6% with four
    sharing everything else, 23.3% with the pending dispatches shared too).
    """
    index = state.index
    sessions = state.sessions
    precise = state.precise if with_chains and not own else None
    # Looked up per note, not merged into one copy a call: forgot_at holds every worker
    # forgotten within MAX_NOTE_AGE_S, and the cluster replays a few notes a call.
    forgot = state.forgot_at
    floor = not_before or None
    skip = chainless or None
    chains = with_chains
    n = 0
    for e in entries:
        if e.worker not in known:
            continue
        if forgot:
            f = forgot.get(e.worker)
            if f is not None and e.at < f:
                continue
        if floor is not None:
            f = floor.get(e.worker)
            if f is not None and e.at < f:
                continue
        if skip is not None:
            chains = with_chains and e.worker not in skip
        try:
            if e.done:
                if chains and precise is not None and e.block_chain:
                    precise.dispatch_done(e.worker, e.block_chain, e.at)
            elif own:
                if e.session_id:
                    sessions.learn(
                        e.session_id,
                        e.worker,
                        e.at,
                        e.prompt_tokens,
                        own=True,
                        concurrent_s=concurrent_s,
                    )
            else:
                if chains and e.chain:
                    index.record(e.worker, e.chain, dense=e.dense, tail_ends=e.tail_ends)
                if chains and precise is not None and e.block_chain:
                    precise.note_dispatch(e.worker, e.block_chain, e.at)
                if e.session_id:
                    sessions.learn(
                        e.session_id, e.worker, e.at, e.prompt_tokens, concurrent_s=concurrent_s
                    )
        except Exception as err:
            if on_error is None:
                raise
            on_error(e, err)
            continue
        n += 1
    return n
