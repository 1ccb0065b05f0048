"""Several gateway replicas in the offline simulation: what each one knows, and when it learns it.

Why a model of its own: behind an L4 balancer each replica routes a share of the traffic, and the
state a learning policy routes on (the approximate prefix index, the session table, the
queued-prefill tokens and in-flight requests it has put on each worker) comes from dispatches. A
replica that learns only from its own sees a quarter of the fleet's placements with four replicas
(`bench.simulate --replicas 4`, Mooncake: hit rate 35.5% -> 10.8%); `[cluster]` shares that state
through Redis (`[cluster]`). This module is the simulator's stand-in for that sync, pure and
driven by the virtual clock, so the offline prediction can be set against the HTTP run with N real
gateways (`bench.compare --gateways N`).

Two models:
- independent (`ShareModel()`): each replica learns from its own dispatches only, and counts only
  its own in-flight requests and queued-prefill tokens per worker (a gateway without `[cluster]`).
- shared (`ShareModel.parse("all", delay_s)`): every replica also learns every other replica's
  dispatches, first tokens and completions `delay_s` virtual seconds after they happened, as the
  Redis sync delivers them. The default 0.1 s is the cluster's staleness target (two 50 ms
  publish intervals: a change waits for its replica's next write, then for the reader's next
  read); the measured median between two real gateways is ~55 ms for load and ~20-30 ms for
  learned entries, so a fixed 0.1 s is the pessimistic end. Parts can be shared alone (`load`,
  `index`, `sessions`, `pending`) to see what each buys; `all` is the four, what `[cluster]`
  ships.

`pending` is the precise (KV-event) index's pending dispatches (blocks sent to a worker and not
yet in its events, `PreciseIndex.note_dispatch`, cut short at the first token by
`dispatch_done`). For a worker whose events are trusted the precise match replaces the
approximate one, so the shared index entries do not reach the precise policy while a prefill is
queued: without the pending ones the other replicas scatter a new prefix (Mooncake x5, 4
replicas: 13.6% hit rate, against 23.3% with them and 22.5% for one gateway). The
workers' own scraped figures (running, waiting, KV usage) are never shared: every replica reads
them alike. A remote record sizes the worker's index budget from the same view the origin saw
(`RoutingState.sync_capacity`): every replica scrapes the worker's KV size itself; the origin
merely applies it first.

A remote dispatch is applied by the gateway's own code for it (`scoring.learned.apply_learned`,
what `gateway.cluster` replays from the Redis stream): the chain into the approximate index, the
session's turn into the session table unless the table already holds a later turn of that
session (a peer's note that arrives a sync late must not pin the session back to an older
worker). Parts not shared are left out of the note.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scoring.learned import Learned, apply_learned
from scoring.state import RoutingState
from scoring.views import RouteRequest, WorkerView
from workers.dispatch_load import Load

__all__ = [
    "CLUSTER_PARTS",
    "DEFAULT_DELAY_S",
    "PARTS",
    "ReplicaSync",
    "ShareModel",
    "learned_state",
]

CLUSTER_PARTS = ("load", "index", "sessions", "pending")  # what `[cluster]` shares: `all`
PARTS = CLUSTER_PARTS
DEFAULT_DELAY_S = 0.1  # gateway.cluster's staleness target at its 50 ms publish interval

_DISPATCH, _FIRST, _DONE = 0, 1, 2


@dataclass(slots=True, frozen=True)
class ShareModel:
    """Which parts of the learned state replicas share, and how late a peer sees a change."""

    parts: frozenset[str] = frozenset()
    delay_s: float = DEFAULT_DELAY_S

    def __post_init__(self) -> None:
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown shared parts {sorted(unknown)}; known: {', '.join(PARTS)}")
        if not self.delay_s >= 0:  # NaN too
            raise ValueError("the share delay must be >= 0 s")

    @classmethod
    def parse(cls, text: str | None, delay_s: float = DEFAULT_DELAY_S) -> ShareModel:
        """`none` (or empty): independent; `all` (what `[cluster]` shares); or a comma list of
        `load,index,sessions,pending`."""
        words = {w.strip() for w in (text or "").split(",") if w.strip()}
        if words <= {"none"}:
            return cls(frozenset(), delay_s)
        if "none" in words:
            raise ValueError("`none` shares nothing: give it alone")
        if "all" in words:
            extra = words - {"all"}
            if extra & set(CLUSTER_PARTS):
                raise ValueError("`all` already has load, index, sessions and pending")
            words = set(CLUSTER_PARTS) | extra
        return cls(frozenset(words), delay_s)

    @property
    def independent(self) -> bool:
        return not self.parts

    def label(self, replicas: int) -> str:
        """How a report names the model: one gateway, independent replicas, or what is shared."""
        if replicas <= 1:
            return "one gateway"
        if self.independent:
            return "independent"
        if set(CLUSTER_PARTS) <= self.parts:
            what = "+".join(["all", *(p for p in PARTS if p in self and p not in CLUSTER_PARTS)])
        else:
            what = "+".join(p for p in PARTS if p in self)
        return f"shared {what}, {self.delay_s:g} s late"

    def __contains__(self, part: str) -> bool:
        return part in self.parts

    def to_json(self, replicas: int) -> dict[str, Any]:
        return {
            "model": "single"
            if replicas <= 1
            else ("independent" if self.independent else "shared"),
            "parts": [p for p in PARTS if p in self.parts],
            "delay_s": None if self.independent else self.delay_s,
            "label": self.label(replicas),
        }


class ReplicaSync:
    """Per replica, the load it counts on each worker, and the queue of changes in transit.

    The origin replica's own changes apply at once (its own bookkeeping, and its policy's own
    `on_dispatch`, which the caller makes); the other replicas get them from `deliver` once
    `delay_s` has passed. One queued event per change, applied to every other replica when due:
    a heap on (due time, sequence), since first tokens of different workers are observed out of
    time order by the virtual clock (each engine runs up to the next arrival in turn).

    `seen[r][w]` is what replica r counts on worker w (its own plus the delivered remote share),
    `own[r][w]` its own only: `workers.dispatch_load.Load`s, counted by the gateway's own rules.
    """

    def __init__(
        self,
        replicas: int,
        workers: Sequence[str],
        model: ShareModel,
        policies: Sequence[Any],
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        if len(policies) != replicas:
            raise ValueError("one policy per replica")
        self.replicas = replicas
        self.model = model
        self.names = list(workers)
        self.policies = list(policies)
        n = len(self.names)
        self.own = [[Load() for _ in range(n)] for _ in range(replicas)]
        self.seen = [[Load() for _ in range(n)] for _ in range(replicas)]
        self._share_load = replicas > 1 and "load" in model
        self._share_index = replicas > 1 and "index" in model
        self._share_sessions = replicas > 1 and "sessions" in model
        self._share_pending = replicas > 1 and "pending" in model
        self._share_any = (
            self._share_load or self._share_index or self._share_sessions or self._share_pending
        )
        self._queue: list[tuple[float, int, int, int, tuple[Any, ...]]] = []
        self._seq = 0
        self._known = frozenset(self.names)
        self.delivered = 0  # changes applied to other replicas (each counted once per receiver)

    def in_flight(self, r: int) -> list[int]:
        """Requests replica r counts in flight per worker."""
        return [x.in_flight for x in self.seen[r]]

    def prefill(self, r: int) -> list[int]:
        """Queued-prefill tokens replica r counts per worker."""
        return [x.prefill_tokens for x in self.seen[r]]

    @property
    def in_transit(self) -> int:
        return len(self._queue)

    def _push(self, at: float, origin: int, kind: int, payload: tuple[Any, ...]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (at + self.model.delay_s, self._seq, origin, kind, payload))

    # -- the origin's changes ------------------------------------------------------------------
    def dispatched(
        self,
        r: int,
        at: float,
        w: int,
        route: RouteRequest,
        tokens: int,
        view: WorkerView | None = None,
    ) -> None:
        """Replica r sent `route` to worker w at `at` with `tokens` queued-prefill tokens; its
        policy has already learned it (`on_dispatch`)."""
        self.own[r][w].dispatched(tokens)
        self.seen[r][w].dispatched(tokens)
        if self._share_any:
            self._push(at, r, _DISPATCH, (w, route, tokens, view))

    def prefill_done(
        self, r: int, at: float, w: int, tokens: int, route: RouteRequest | None = None
    ) -> None:
        """The first token of a request replica r sent to worker w came back at `at` (`route`:
        its key, for the pending entries of the precise index)."""
        self.own[r][w].prefill_done(tokens)
        self.seen[r][w].prefill_done(tokens)
        pending = self._share_pending and route is not None and bool(route.block_chain)
        if (self._share_load and tokens) or pending:
            self._push(at, r, _FIRST, (w, tokens, route if pending else None))

    def finished(self, r: int, at: float, w: int) -> None:
        """A request replica r sent to worker w completed at `at`."""
        self.own[r][w].released()
        self.seen[r][w].released()
        if self._share_load:
            self._push(at, r, _DONE, (w,))

    # -- what the others learn -----------------------------------------------------------------
    def deliver(self, now: float) -> int:
        """Apply every change due by `now` to every replica but its origin; returns how many."""
        q = self._queue
        n = 0
        while q and q[0][0] <= now:
            _due, _seq, origin, kind, payload = heapq.heappop(q)
            for o in range(self.replicas):
                if o != origin:
                    self._apply(o, kind, payload, _due - self.model.delay_s)
            n += 1
        self.delivered += n * (self.replicas - 1)
        return n

    def _apply(self, o: int, kind: int, payload: tuple[Any, ...], at: float) -> None:
        if kind == _DISPATCH:
            w, route, tokens, view = payload
            if self._share_load:
                self.seen[o][w].dispatched(tokens)
            self._learn(o, self.names[w], route, at, view)
        elif kind == _FIRST:
            w, tokens, route = payload
            if self._share_load:
                self.seen[o][w].prefill_done(tokens)
            state = getattr(self.policies[o], "state", None)
            if route is not None and state is not None:
                done = Learned(self.names[w], (), 0, (), None, 0, at, route.block_chain, True)
                apply_learned(state, (done,), known=self._known)
        else:
            self.seen[o][payload[0]].released()

    def _learn(
        self, o: int, worker: str, route: RouteRequest, at: float, view: WorkerView | None
    ) -> None:
        policy = self.policies[o]
        state: RoutingState | None = getattr(policy, "state", None)
        if state is None:  # a stateless policy (round_robin, least_loaded) learns nothing
            return
        pending = self._share_pending and state.precise is not None
        blocks = route.block_chain if pending else ()
        chain = route.chain if self._share_index and getattr(policy, "needs_chain", False) else ()
        session = route.session_id if self._share_sessions else None
        if not (chain or session or blocks):
            return
        if chain and view is not None:
            state.sync_capacity(view)
        note = Learned(
            worker,
            chain,
            route.dense_blocks,
            route.tail_ends,
            session,
            route.prompt_tokens,
            at,
            blocks,
        )
        apply_learned(state, (note,), known=self._known)


def learned_state(state: RoutingState) -> dict[str, Any]:
    """Everything a replica has learned, in a form two replicas can be compared by (tests, and
    checking that a shared model with no delay makes every replica know what one gateway would).

    Per worker: the approximate index's entries in LRU order with their weights, and its fill;
    the session table in order with (worker, last use, prompt tokens)."""
    index = state.index
    per_worker: dict[str, list[tuple[int, int]]] = {}
    for name in index.workers():
        per_worker[name] = index.lru_entries(name)
    return {
        "index": {k: v for k, v in sorted(per_worker.items()) if v},
        "fill": {k: v for k, v in sorted(index.fill.items()) if v},
        # Not the entry's `local` flag: whether the shared stream has shown this replica's own
        # note back yet is the replica's place in the stream, not something it learned (one
        # gateway, with no stream, keeps every turn local).
        "sessions": [(sid, e[:3]) for sid, e in state.sessions._table.items()],
    }
