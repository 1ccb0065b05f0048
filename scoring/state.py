"""What learning policies know about the fleet, and the hooks that teach it to them.

``RoutingState`` (approximate prefix index, precise index, session table, replication journal)
outlives any one policy object, so a weight reload or a policy switch forgets nothing; it is kept
apart from the policies because the gateway, its replicas (``gateway.cluster``) and the simulator
hold and feed it directly. ``_Learning`` is the plumbing the learning policies share (``prefix``,
``session`` in ``scoring.policy``; ``kv_aware`` in ``scoring.kv_aware``): what a dispatch, a first
token or a departed worker teaches the state.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from scoring.index import PrefixIndex
from scoring.learned import MAX_NOTE_AGE_S, Journal, Learned
from scoring.precise import PreciseIndex
from scoring.session import SessionTable
from scoring.views import RouteRequest, RoutingOptions, Weights, WorkerView

__all__ = ["RoutingState"]

# `RoutingState.forgot_at` is pruned at twice its size after the last pruning, at least this.
_FORGOT_MIN = 1024


class RoutingState:
    """What learning policies know about the fleet; outlives weight reloads and policy swaps."""

    def __init__(
        self,
        options: RoutingOptions | None = None,
        precise: PreciseIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        o = options or RoutingOptions()
        self.index = PrefixIndex(o.default_capacity_blocks, o.max_capacity_blocks)
        # What workers with KV events really hold; fed by their events, not by our decisions, so
        # it survives option changes (its keys depend on token ids and block size only).
        self.precise = precise
        self.sessions = SessionTable(o.session_ttl_s, o.session_max, o.session_active_s)
        # Set by a gateway whose replicas share what they learn (gateway.cluster): every dispatch
        # is noted here for the others, besides being learned locally.
        self.journal: Journal | None = None
        # Worker -> when routing last forgot it (left, or restarted: its cache is gone), on the
        # policies' clock: a peer's note from before then (an outage backlog published late)
        # is about what was forgotten, and `apply_learned` skips it. Entries older than
        # MAX_NOTE_AGE_S go (`_prune_forgot`): no note that old is replayed, and a fleet of
        # autoscaled pods must not keep every name it ever removed.
        self.forgot_at: dict[str, float] = {}
        self._forgot_cap = _FORGOT_MIN
        self.clock = clock
        self._key = o.key_fields()
        self._text_block_tokens = o.text_block_tokens
        self._reported: dict[str, tuple[int, int]] = {}  # worker -> (num_blocks, block_size) seen

    @property
    def key(self) -> tuple[int, ...]:
        """The options chains are hashed under (``RoutingOptions.key_fields``)."""
        return self._key

    def configure(self, o: RoutingOptions) -> None:
        """Adopt new options; chains hashed under other block sizes mean nothing now, so forget:
        the index, and the journal's notes not shipped yet (`gateway.cluster` frames a batch
        with the key current when it takes them, so they would reach the peers as hashed under
        the new one); counted in ``Journal.dropped``."""
        if o.key_fields() != self._key:
            self.index = PrefixIndex(o.default_capacity_blocks, o.max_capacity_blocks)
            self._reported.clear()
            self._key = o.key_fields()
            if self.journal is not None:
                self.journal.clear()
        else:
            self.index.set_limits(o.default_capacity_blocks, o.max_capacity_blocks)
            if o.text_block_tokens != self._text_block_tokens:
                self._reported.clear()  # capacities are in index blocks: recompute them
        self._text_block_tokens = o.text_block_tokens
        self.sessions.ttl_s = o.session_ttl_s
        self.sessions.max_size = o.session_max
        self.sessions.active_s = o.session_active_s

    def matches(self, request: RouteRequest, now: float) -> tuple[dict[str, int], frozenset[str]]:
        """Which workers hold how much of ``request``'s prefix (leading chain entries), and which
        of them publish KV events that are trusted now: the one lookup policies make over both
        indexes. A trusted worker's figure is what its events say it holds (converted from its
        blocks to chain entries: exact in the dense head, rounded down to a tail span beyond);
        everyone else's is the approximate index's, learned from our own dispatches.

        A worker whose events are keyed at another block size than the request's block chain
        (a fleet of mixed block sizes) cannot match that chain, so it is not trusted for this
        request: its figure is the approximate index's (``PreciseIndex.keyed_sizes``)."""
        chain = request.chain
        matches = self.index.match(chain) if chain else {}
        precise = self.precise
        if precise is None or not request.block_chain:
            return matches, _NOBODY
        trusted = precise.trusted(now)
        if not trusted:
            return matches, _NOBODY
        sizes = precise.keyed_sizes
        u = sizes.uniform
        if u and u != request.block_tokens:  # some worker is keyed at another block size
            trusted = trusted - sizes.left_out(trusted, request.block_tokens)
            if not trusted:
                return matches, _NOBODY
        out = {k: v for k, v in matches.items() if k not in trusted}
        conv = request.entries_for_blocks
        for name, blocks in precise.match(request.block_chain, now).items():
            # A worker left out above may show pending dispatches of this very chain: not its.
            if name in trusted:
                e = conv(blocks)
                if e:
                    out[name] = e
        return out, trusted

    def sync_capacity(self, w: WorkerView) -> None:
        """Size a worker's index budget from its reported KV cache (num_gpu_blocks * block_size)."""
        if not (w.num_blocks and w.block_size):
            return
        key = (w.num_blocks, w.block_size)
        if self._reported.get(w.name) != key:
            self._reported[w.name] = key
            blocks = int(w.num_blocks * w.block_size / self._text_block_tokens)
            self.index.set_capacity(w.name, blocks)

    def forget_worker(self, name: str, now: float | None = None) -> None:
        """Forget everything known of ``name`` (it left, or restarted with an empty cache), as
        of ``now`` (default: this state's clock): peers' notes from before then are skipped
        when they arrive later (`apply_learned`), or they would teach it all back."""
        t = self.clock() if now is None else now
        forgot = self.forgot_at
        if t > forgot.get(name, float("-inf")):
            forgot[name] = t
            if len(forgot) > self._forgot_cap:
                self._prune_forgot(t)
        self.index.remove_worker(name)
        if self.precise is not None:
            self.precise.remove_worker(name)
        self.sessions.remove_worker(name)
        self._reported.pop(name, None)

    def _prune_forgot(self, now: float) -> None:
        """Drop the ``forgot_at`` entries older than MAX_NOTE_AGE_S. Amortized O(1) a removal:
        the next pass waits for the map to double."""
        horizon = now - MAX_NOTE_AGE_S
        self.forgot_at = kept = {w: t for w, t in self.forgot_at.items() if t >= horizon}
        self._forgot_cap = max(_FORGOT_MIN, 2 * len(kept))

    def forget_learned(self, name: str) -> None:
        """Forget what dispatches taught of ``name`` (prefix index entries, session pins), not
        what its KV events report: for peers' notes found, once its process start became
        known, to predate it. No ``forgot_at``: later notes are judged by that start, and the
        rest of a warm start's history is still to come. The precise index's pending keys of
        those notes are left to expire (it has no per-worker pending-only drop)."""
        self.index.remove_worker(name)
        self.sessions.remove_worker(name)
        self._reported.pop(name, None)


# What ``_Learning.on_dispatch`` learned from one dispatch, for ``on_refused`` to undo: (the
# index's receipt for the record, ``PrefixIndex.record``'s (held, stamp), ``SessionTable.before``
# when the request had a session, the note queued for the other replicas). Plain tuples: a
# NamedTuple costs ~0.4 us per dispatch.
Dispatched = tuple[tuple[int, int], tuple[Any, Any] | None, Learned | None]


class _Learning:
    """Shared plumbing of the policies that keep a RoutingState."""

    name: str
    needs_chain: bool

    def __init__(
        self,
        *,
        weights: Weights | None = None,
        options: RoutingOptions | None = None,
        rng: random.Random | None = None,
        state: RoutingState | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.weights = weights or Weights()
        self.options = options or RoutingOptions()
        self.state = state or RoutingState(self.options)
        if state is not None:
            state.configure(self.options)
        self._rng = rng or random.Random()
        self._clock = clock or time.monotonic

    def set_weights(self, weights: Weights) -> None:
        # One attribute swap: a decision in progress keeps the object it already read.
        self.weights = weights

    def set_options(self, options: RoutingOptions) -> None:
        self.state.configure(options)
        self.options = options

    def on_worker_removed(self, name: str) -> None:
        self.state.forget_worker(name, self._clock())

    def on_dispatch(self, worker_name: str, request: RouteRequest) -> Dispatched:
        state = self.state
        held = (len(request.chain), 0)  # nothing recorded: nothing to take back
        if self.needs_chain and request.chain:
            held = state.index.record(
                worker_name, request.chain, dense=request.dense_blocks, tail_ends=request.tail_ends
            )
        now = self._clock()
        if state.precise is not None and request.block_chain:
            state.precise.note_dispatch(worker_name, request.block_chain, now)
        before = None
        if request.session_id:
            sessions = state.sessions
            before = sessions.before(request.session_id, now)
            sessions.put(request.session_id, worker_name, now, request.prompt_tokens)
        entry = None
        if state.journal is not None:
            entry = Learned(
                worker_name,
                request.chain if self.needs_chain else (),
                request.dense_blocks,
                request.tail_ends,
                request.session_id,
                request.prompt_tokens,
                now,
                request.block_chain if state.precise is not None else (),
            )
            state.journal.note(entry)
        return held, before, entry

    def on_refused(self, worker_name: str, request: RouteRequest, receipt: Any) -> None:
        """The worker refused the request (a 4xx, or a 5xx or connection failure before any
        work): take back what ``on_dispatch`` learned from it, so bad input (a prompt over the
        model's context, say) leaves no trace in routing: the index entries it added, the
        session pin and commitment, its pending KV-event keys, and its note to the other
        replicas if not shipped yet (one already shipped stays learned there)."""
        if not isinstance(receipt, tuple):
            return
        held, before, entry = receipt
        state = self.state
        now = self._clock()
        if self.needs_chain and request.chain:
            state.index.unrecord(worker_name, request.chain, held)
        if state.precise is not None and request.block_chain:
            state.precise.dispatch_done(worker_name, request.block_chain, now)
        if request.session_id and before is not None:
            state.sessions.undo(request.session_id, worker_name, before, now)
        if entry is not None and state.journal is not None:
            state.journal.retract(entry)

    def on_prefill_done(self, worker_name: str, request: RouteRequest) -> None:
        state = self.state
        precise = state.precise
        if precise is not None and request.block_chain:
            now = self._clock()
            precise.dispatch_done(worker_name, request.block_chain, now)
            if state.journal is not None:
                state.journal.note(
                    Learned(worker_name, (), 0, (), None, 0, now, request.block_chain, True)
                )

    def _pick(self, ties: list[Any]) -> Any:
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)


_NOBODY: frozenset[str] = frozenset()  # no worker with trusted KV events
