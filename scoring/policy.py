"""Routing policies behind one interface.

A policy sees an immutable snapshot of the candidate workers (already filtered to healthy ones that
serve the model) and the request's routing key, and picks one. It never does I/O and never mutates
the snapshot, so it is safe to call from the request path and from the offline simulator alike.

Policies that learn (``prefix``, ``session``, ``kv_aware``) keep what they learned in a
``RoutingState`` (prefix index + session table) that outlives the policy object: a weight reload is
``policy.set_weights(w)``, a policy switch is ``make_policy(new, state=old.state)``, and neither
forgets which worker holds what.

Gateway call sequence per request::

    route = route_request("chat", body, model=m, namespace=ns, tenant_priority=p,
                          session_id=session_id_from(headers, body), request_id=rid,
                          options=policy.options, hash_prefix=policy.needs_chain)
    decision = policy.choose(views, route)        # per attempt, retries reuse `route`
    policy.on_dispatch(decision.worker.name, route)
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import xxhash

from scoring.index import PrefixIndex
from scoring.learned import Journal, Learned
from scoring.precise import PreciseIndex
from scoring.prefix import PathKind, text_key
from scoring.session import SessionTable
from scoring.signals import is_saturated, load_estimate, prefix_signal
from scoring.views import Decision, RouteRequest, RoutingOptions, Weights, WorkerView

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "Decision",
    "KVAware",
    "LeastLoaded",
    "Policy",
    "PrefixAffinity",
    "RoundRobin",
    "RouteRequest",
    "RoutingOptions",
    "RoutingState",
    "SessionAffinity",
    "Weights",
    "WorkerView",
    "load_of",
    "make_policy",
    "route_request",
    "session_id_from",
]


class Policy(Protocol):
    name: str
    needs_chain: bool  # does choose() use RouteRequest.chain? (skip hashing when not)
    options: RoutingOptions  # pass to route_request so chains match the index's block size
    state: RoutingState | None  # what it learned; pass to make_policy(..., state=) on a switch

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision: ...

    def on_dispatch(self, worker_name: str, request: RouteRequest) -> None:
        """The request was sent to ``worker_name`` (call once per attempt actually sent)."""

    def on_prefill_done(self, worker_name: str, request: RouteRequest) -> None:
        """That attempt produced its first token, or failed: its prefill is over either way."""

    def on_worker_removed(self, name: str) -> None:
        """The worker left the fleet (or restarted at the same address: its cache is gone)."""

    def set_weights(self, weights: Weights) -> None:
        """Apply new scorer weights from the next decision on (no-op for policies without)."""


class _Stateless:
    """Hooks for policies that learn nothing: the gateway calls every hook on every policy."""

    needs_chain = False
    options: RoutingOptions = RoutingOptions()
    state: RoutingState | None = (
        None  # nothing learned; make_policy(..., state=p.state) still works
    )

    def on_dispatch(self, worker_name: str, request: RouteRequest) -> None:
        return None

    def on_prefill_done(self, worker_name: str, request: RouteRequest) -> None:
        return None

    def on_worker_removed(self, name: str) -> None:
        return None

    def set_weights(self, weights: Weights) -> None:
        return None


class RoundRobin(_Stateless):
    """Even spread, blind to load and cache: the baseline every other policy is measured against."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        return Decision(candidates[next(self._counter) % len(candidates)], "round_robin")


def load_of(worker: WorkerView) -> float:
    """Outstanding work per unit of weight; the gateway's own count is fresher than a scrape."""
    return max(worker.in_flight, worker.running + worker.waiting) / max(worker.weight, 1e-9)


class LeastLoaded(_Stateless):
    """Fewest outstanding requests; ties broken at random so bursts do not pile onto one worker."""

    name = "least_loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        best = min(load_of(w) for w in candidates)
        ties = [w for w in candidates if load_of(w) == best]
        pick = ties[0] if len(ties) == 1 else self._rng.choice(ties)
        return Decision(pick, "least_loaded")


# -- learned state ---------------------------------------------------------------------------------
class RoutingState:
    """What learning policies know about the fleet; outlives weight reloads and policy swaps."""

    def __init__(
        self, options: RoutingOptions | None = None, precise: PreciseIndex | None = None
    ) -> None:
        o = options or RoutingOptions()
        self.index = PrefixIndex(o.default_capacity_blocks, o.max_capacity_blocks)
        # What workers with KV events really hold; fed by their events, not by our decisions, so
        # it survives option changes (its keys depend on token ids and block size only).
        self.precise = precise
        self.sessions = SessionTable(o.session_ttl_s, o.session_max)
        # Set by a gateway whose replicas share what they learn (gateway.cluster): every dispatch
        # is noted here for the others, besides being learned locally.
        self.journal: Journal | None = None
        self._key = o.key_fields()
        self._text_block_tokens = o.text_block_tokens
        self._reported: dict[str, tuple[int, int]] = {}  # worker -> (num_blocks, block_size) seen

    @property
    def key(self) -> tuple[int, ...]:
        """The options chains are hashed under (``RoutingOptions.key_fields``)."""
        return self._key

    def configure(self, o: RoutingOptions) -> None:
        """Adopt new options; chains hashed under other block sizes mean nothing now, so forget."""
        if o.key_fields() != self._key:
            self.index = PrefixIndex(o.default_capacity_blocks, o.max_capacity_blocks)
            self._reported.clear()
            self._key = o.key_fields()
        else:
            self.index.default_capacity = o.default_capacity_blocks
            self.index.max_capacity = o.max_capacity_blocks
            if o.text_block_tokens != self._text_block_tokens:
                self._reported.clear()  # capacities are in index blocks: recompute them
        self._text_block_tokens = o.text_block_tokens
        self.sessions.ttl_s = o.session_ttl_s
        self.sessions.max_size = o.session_max

    def sync_capacity(self, w: WorkerView) -> None:
        """Size a worker's index budget from its reported KV cache (num_gpu_blocks * block_size)."""
        if not (w.num_blocks and w.block_size):
            return
        key = (w.num_blocks, w.block_size)
        if self._reported.get(w.name) != key:
            self._reported[w.name] = key
            blocks = int(w.num_blocks * w.block_size / self._text_block_tokens)
            self.index.set_capacity(w.name, blocks)

    def forget_worker(self, name: str) -> None:
        self.index.remove_worker(name)
        if self.precise is not None:
            self.precise.remove_worker(name)
        self.sessions.remove_worker(name)
        self._reported.pop(name, None)


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
        self.state.forget_worker(name)

    def on_dispatch(self, worker_name: str, request: RouteRequest) -> None:
        state = self.state
        if self.needs_chain and request.chain:
            state.index.record(
                worker_name, request.chain, dense=request.dense_blocks, tail_ends=request.tail_ends
            )
        now = self._clock()
        if state.precise is not None and request.block_chain:
            state.precise.note_dispatch(worker_name, request.block_chain, now)
        if request.session_id:
            state.sessions.put(request.session_id, worker_name, now, request.prompt_tokens)
        if state.journal is not None:
            state.journal.note(
                Learned(
                    worker_name,
                    request.chain if self.needs_chain else (),
                    request.dense_blocks,
                    request.tail_ends,
                    request.session_id,
                    request.prompt_tokens,
                    now,
                    request.block_chain if state.precise is not None else (),
                )
            )

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


class PrefixAffinity(_Learning):
    """Cache affinity: the longest prefix holder, misses and ties at random, and a load guard.

    A baseline (what the vLLM production-stack router does), kept to measure what the load terms
    of ``kv_aware`` buy. Without the guard it was an outage waiting for a common system prompt:
    every request matched the first block on one worker and went there (offline p50 TTFT ~3,000 s
    of simulated time; online p99 23.6 s). So, as the cache-aware Rust routers' balance thresholds
    do, a worker whose outstanding requests exceed the least loaded candidate's by more than
    ``affinity_max_excess`` and ``affinity_max_ratio`` times is left out; what it held spreads to
    the others, which then hold it too.
    """

    name = "prefix"
    needs_chain = True

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        o = self.options
        matches = self.state.index.match(request.chain) if request.chain else {}
        floor = min(load_of(w) for w in candidates)
        limit = max(floor + o.affinity_max_excess, floor * o.affinity_max_ratio)
        best = 0
        ties: list[WorkerView] = []
        open_: list[WorkerView] = []
        yielded = False
        for w in candidates:
            m = matches.get(w.name, 0)
            if load_of(w) > limit:
                yielded |= m > 0
                continue
            open_.append(w)
            if m > best:
                best, ties = m, [w]
            elif m == best:
                ties.append(w)
        pick = self._pick(ties if best else open_)
        self.state.sync_capacity(pick)
        prompt = request.prompt_tokens or request.matched_tokens(len(request.chain))
        return Decision(
            pick,
            "affinity" if best else "balance" if yielded else "random",
            {"prefix": prefix_signal(request.matched_tokens(best), prompt)},
            matched_blocks=best,
            prefill_tokens=_uncached(request, best),
        )


class SessionAffinity(_Learning):
    """Sticky to the session's last worker unless it is saturated; otherwise least loaded."""

    name = "session"
    needs_chain = False

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        o = self.options
        last = (
            self.state.sessions.get(request.session_id, self._clock())
            if request.session_id
            else None
        )
        ok: list[WorkerView] = []
        lost = False
        for w in candidates:
            _wait, queued, kv = load_estimate(w, o)
            sat = is_saturated(queued, kv, o)
            if w.name == last:
                if not sat:
                    return Decision(w, "session", prefill_tokens=_uncached(request, 0))
                lost = True
            if not sat:
                ok.append(w)
        pool = ok or list(candidates)
        best = min(load_of(w) for w in pool)
        pick = self._pick([w for w in pool if load_of(w) == best])
        return Decision(
            pick,
            "load_fallback" if lost else "least_loaded",
            prefill_tokens=_uncached(request, 0),
            saturated=not ok,
        )


class KVAware(_Learning):
    """The default: cache reuse weighed against queue delay, KV pressure and tenant priority.

    ``score = w.prefix*prefix*yield - w.queue*queue - w.kv*kv + w.tenant*tenant
    + w.session*session`` with the signals of ``scoring.signals``. Saturated workers are left out
    while any is below the thresholds; scores within ``tie_tolerance`` of the best are drawn at
    random.

    Speed: the per-worker half of the signals (wait, queue, KV used, saturation) depends only on the
    immutable WorkerView, so it is memoised per worker name and reused while the view is the same
    object; a registry that rebuilds a worker's view only when that worker changes lets a decision
    recompute only the changed workers and pay ~0.3 us for each of the others (a fresh view for
    every worker costs ~0.5 us each here). Keyed by name, not by ``id(view)``: one entry per
    worker, replaced in place when its view changes, so the memo never needs sweeping (sweeping it
    against the sampled pool dropped the entries of every worker outside the sample, and at 256
    workers nearly every sampled worker was recomputed). Fleets larger than ``2 * sample_size``
    score the prefix holders, the session's worker and a random sample of the rest (``_sample``),
    so a decision's cost stops growing with the fleet.
    """

    name = "kv_aware"
    needs_chain = True

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._memo: dict[str, tuple[Any, ...]] = {}  # worker name -> _load(its current view)

    def set_options(self, options: RoutingOptions) -> None:
        super().set_options(options)
        self._memo = {}

    def on_worker_removed(self, name: str) -> None:
        super().on_worker_removed(name)
        self._memo.pop(name, None)

    def choose(self, candidates: Sequence[WorkerView], request: RouteRequest) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        state = self.state
        chain = request.chain
        matches = state.index.match(chain) if chain else {}
        precise = state.precise
        trusted = _NOBODY
        if precise is not None and request.block_chain:
            trusted = precise.trusted(self._clock())
            if trusted:
                matches = _merge_precise(matches, trusted, precise, request, self._clock())
        entry = (
            state.sessions.lookup(request.session_id, self._clock()) if request.session_id else None
        )
        last, last_tokens = entry if entry else (None, 0)
        if last in trusted:
            # The session's worker publishes events: what it holds of this prompt is known, so
            # its last turn is not assumed to be cached there (it may have been evicted).
            last_tokens = 0
        memo = self._memo
        if len(memo) > 4 * len(candidates) + _MEMO_SLACK:  # names gone without on_worker_removed
            memo.clear()
        scan = self._scan
        d = self.options.sample_size
        pool = candidates
        if d and len(candidates) > 2 * d:
            pool = self._sample(candidates, matches, last, d)
        ties, best, n_ok, n_held, best_match = scan(pool, request, matches, last, last_tokens, True)
        if n_ok == 0 and pool is not candidates:  # the sample is saturated: look at everyone
            pool = candidates
            ties, best, n_ok, n_held, best_match = scan(
                pool, request, matches, last, last_tokens, True
            )
        if n_ok + n_held == 0:  # every worker is saturated: score them all, the queue decides
            ties, best, _n, _h, best_match = scan(pool, request, matches, last, last_tokens, False)
        tol = self.options.tie_tolerance
        if len(ties) > 1:
            ties = [t for t in ties if t[0] >= best - tol]
        score, w, m, prefix, eff, queue, kv, tenant, sess, wait, own = self._pick(ties)
        state.sync_capacity(w)  # only the chosen worker's budget matters (on_dispatch records)
        if m and m == best_match:
            reason = "affinity"
        elif last is not None and w.name == last and (sess > 0 or eff > 0):
            reason = "session"
        elif best_match:
            reason = "load_fallback"
        else:
            reason = "load"
        # Positional: keywords make CPython build a dict to call a dataclass __init__ (~0.7 us).
        return Decision(
            w,
            reason,
            {
                "prefix": prefix,
                "affinity": eff,
                "queue": queue,
                "kv": kv,
                "tenant": tenant,
                "session": sess,
                "score": score,
                "wait_s": wait,
            },
            m,  # matched_blocks
            int(own),  # prefill_tokens
            n_ok == 0,  # saturated
            ("precise" if w.name in trusted else "approx") if m else "",  # match_source
        )

    def _sample(
        self,
        candidates: Sequence[WorkerView],
        matches: dict[str, int],
        last: str | None,
        d: int,
    ) -> list[WorkerView]:
        """Every prefix holder and the session's worker, plus ``d`` workers drawn at random.

        Power of d choices (Mitzenmacher): the best of a few random workers balances load almost
        as well as the best of all, and better when load figures are stale (a global argmin sends
        every request of a burst to the same worker). Holders are found by one dict lookup per
        candidate, ~30 ns against ~0.5 us for scoring one (a second test, ``w.name == last``,
        doubled that, and tripled it with ``last=None``: ``str == None`` takes the slow reflected
        comparison). A drawn worker is left out by name when it is already in (as a holder), which
        is the same test as by identity since every candidate with such a name is in; a worker
        drawn twice is scored twice, as it always was (tie odds depend on it).
        """
        choices = self._rng.choices
        if last is not None and last not in matches:
            keys: Mapping[str, Any] | set[str] = {*matches, last}
        elif matches:
            keys = matches
        else:
            return choices(candidates, k=d)
        pool = [w for w in candidates if w.name in keys]
        pool += [w for w in choices(candidates, k=d) if w.name not in keys]
        return pool

    def _load(self, w: WorkerView) -> tuple[Any, ...]:
        """A view's request-independent signals: (view, wait_s, queue, kv_used, 1/cap, saturated,
        saturated by its queue).

        ``load_estimate``, ``queue_signal``, ``kv_capacity_tokens`` and ``is_saturated`` of
        scoring.signals, inlined: at least one view changes per decision (the last dispatch's).
        """
        o = self.options
        ifl, run = w.in_flight, w.running
        q = w.waiting + (ifl - w.in_flight_at_scrape if w.in_flight_at_scrape is not None else 0)
        if ifl - run > q:
            q = ifl - run
        if q < 0:
            q = 0
        backlog = q * o.mean_prompt_tokens
        if w.prefill_tokens > backlog:
            backlog = w.prefill_tokens
        weight = w.weight if w.weight > 0 else 1e-9
        wait = (backlog / o.prefill_tokens_per_s + run * o.decode_s_per_running) / weight
        cap = w.num_blocks * w.block_size if w.num_blocks and w.block_size else 0
        kv = w.kv_usage + (w.sent_tokens_since_scrape / cap if cap else 0.0)
        qsat = q >= o.saturation_waiting
        return (
            w,
            wait,
            wait / (wait + o.queue_horizon_s) if wait > 0 else 0.0,
            kv,
            1.0 / cap if cap else 0.0,
            qsat or kv >= o.saturation_kv,
            qsat,
        )

    def _scan(
        self,
        candidates: Sequence[WorkerView],
        request: RouteRequest,
        matches: dict[str, int],
        last: str | None,
        last_tokens: int,
        skip_saturated: bool,
    ) -> tuple[list[tuple[Any, ...]], float, int, int, int]:
        """Score candidates; returns (near-best rows, best score, #unsaturated, #KV-saturated
        holders, best match).

        One pass scores the workers that hold nothing of this prompt and are not the session's
        worker (their score does not depend on the others); holders and the session worker need the
        best achievable wait (their yield is relative to it), so they are finished after the pass.
        The signal formulas are inlined from scoring.signals: this loop runs per candidate.

        The session's last worker is credited with its last turn's prompt (capped at this one) when
        the index holds all of this request's chain there: past the hashed range (or with no chain)
        only the session knows what it caches; within it the index also knows about evictions.
        """
        o = self.options
        wt = self.weights
        covered = request.matched_tokens
        n_chain = len(request.chain)
        prompt = float(request.prompt_tokens) or covered(n_chain) or 1.0
        prio = request.tenant_priority
        prio = 0.0 if prio < 0 else (prio if prio < 1.0 else 1.0)
        wk = wt.kv
        wtn = wt.tenant * prio
        wtnq = wt.queue + wtn  # tenant*(1-queue) - queue*w.queue == wtn - (w.queue + wtn)*queue
        tol = o.tie_tolerance
        best = hi = lo = float("-inf")
        ties: list[tuple[Any, ...]] = []
        special: list[tuple[Any, ...]] = []
        min_wait = float("inf")
        n_ok = 0
        n_held = 0  # KV-saturated holders, scored all the same
        best_match = 0
        mget = matches.get
        fget = self.state.index.fill.get
        memo = self._memo
        memo_get = memo.get
        load = self._load
        # ``name in session`` rather than ``name == last``: the same test, but comparing a str with
        # None (no session, the common case) takes Python's slow reflected-comparison path.
        session = () if last is None else (last,)
        for w in candidates:
            name = w.name
            e = memo_get(name)
            if e is None or e[0] is not w:
                e = memo[name] = load(w)
            _w, wait, queue, kv, inv_cap, sat, qsat = e
            m = mget(name, 0)
            if sat:
                if m and not qsat:
                    # A holder saturated on KV only is not skipped: the request adds just its
                    # uncached tail there (the kv term weighs it). Skipping it sent hot prefixes
                    # to cold workers in overload (Mooncake x5 on 8 x 16,384 blocks: hit 15.8% ->
                    # 16.1%, p99 TTFT 16.6 -> 15.9 s; precise 15.4% -> 16.6%, 16.2 -> 14.9 s).
                    # A holder with a long queue still is: its wait estimate is least reliable.
                    n_held += 1
                else:
                    if m > best_match:
                        best_match = m
                    if skip_saturated:
                        continue
            else:
                n_ok += 1
            if wait < min_wait:
                min_wait = wait
            fill = fget(name, 0.0)
            if fill > kv:  # kv_pressure counts the cache the index says is in use, too
                kv = fill
            if m or name in session:  # finished after the pass
                special.append((w, m, queue, kv, inv_cap, wait))
                continue
            if inv_cap:  # kv_pressure: usage after placing this request's uncached tokens here
                kv += prompt * inv_cap
                if kv > 1.0:
                    kv = 1.0
            base = wtn - wtnq * queue - wk * kv  # tenant, queue and kv terms
            if base >= lo:
                row = (base, w, 0, 0.0, 0.0, queue, kv, prio * (1.0 - queue), 0.0, wait, prompt)
                if base > hi:
                    ties = [row]
                else:
                    ties.append(row)
                if base > best:
                    best = base
                    hi, lo = best + tol, best - tol
        wp, ws = wt.prefix, wt.session
        slack = o.affinity_slack
        inv_tps = 1.0 / o.prefill_tokens_per_s
        horizon = o.queue_horizon_s
        for w, m, queue, kv, inv_cap, wait in special:
            if m > best_match:
                best_match = m
            extra = wait - min_wait
            eff = prefix = 0.0
            matched = covered(m) if m else 0.0
            if w.name == last and last_tokens > matched and m >= n_chain:
                matched = last_tokens if last_tokens < prompt else prompt
            if matched:
                prefix = matched / prompt
                if prefix > 1.0:
                    prefix = 1.0
                if extra <= 0:  # affinity_yield
                    eff = prefix
                elif slack > 0:
                    y = 1.0 - extra / (slack * matched * inv_tps)
                    eff = prefix * y if y > 0 else 0.0
            own = prompt - matched if prompt > matched else 0.0
            if inv_cap:
                kv += own * inv_cap
                if kv > 1.0:
                    kv = 1.0
            sess = 0.0
            if w.name == last:  # session_signal
                sess = 1.0 if extra <= 0 else 1.0 - extra / horizon
                if sess < 0:
                    sess = 0.0
            base = wtn - wtnq * queue - wk * kv
            score = base + wp * eff + ws * sess
            if score >= lo:
                row = (score, w, m, prefix, eff, queue, kv, prio * (1.0 - queue), sess, wait, own)
                if score > hi:
                    ties = [row]
                else:
                    ties.append(row)
                if score > best:
                    best = score
                    hi, lo = best + tol, best - tol
        return ties, best, n_ok, n_held, best_match


def _merge_precise(
    matches: dict[str, int],
    trusted: frozenset[str],
    precise: PreciseIndex,
    request: RouteRequest,
    now: float,
) -> dict[str, int]:
    """Approximate matches for workers without trusted events, precise ones for the others.

    A precise match counts worker blocks; the scorer counts chain entries, so it is converted
    (exact in the dense head, rounded down to a tail span beyond it).
    """
    out = {k: v for k, v in matches.items() if k not in trusted}
    conv = request.entries_for_blocks
    for name, blocks in precise.match(request.block_chain, now).items():
        e = conv(blocks)
        if e:
            out[name] = e
    return out


def _uncached(request: RouteRequest, matched_blocks: int) -> int:
    left = request.prompt_tokens - request.matched_tokens(matched_blocks)
    return int(left) if left > 0 else 0


# Memo entries (one per worker name) kept beyond 4x the candidates before the memo is cleared.
_MEMO_SLACK = 1024
_NOBODY: frozenset[str] = frozenset()  # no worker with trusted KV events


# -- building a request's routing key --------------------------------------------------------------
_DEFAULT_OPTIONS = RoutingOptions()
_MAX_SESSION_ID = 128


def session_id_from(
    headers: Mapping[str, str], body: Mapping[str, Any], header: str = "x-session-id"
) -> str | None:
    """The session id: the configured header, else the body's ``user`` or ``prompt_cache_key``.

    Ids longer than 128 characters are replaced by their hash so a client cannot grow the session
    table's memory with huge ids.
    """
    sid: Any = headers.get(header)
    if sid is None and header.lower() != header:
        sid = headers.get(header.lower())
    if not sid:
        sid = body.get("user") or body.get("prompt_cache_key")
    if not sid or not isinstance(sid, str):
        return None
    if len(sid) > _MAX_SESSION_ID:
        sid = "h:" + xxhash.xxh3_128_hexdigest(sid.encode())
    return sid


def route_request(
    path_kind: PathKind,
    body: Mapping[str, Any],
    *,
    model: str | None = None,
    namespace: str = "",
    cache_salt: str | None = None,
    tenant_priority: float = 0.5,
    session_id: str | None = None,
    request_id: str = "",
    options: RoutingOptions | None = None,
    hash_prefix: bool = True,
    block_chain_blocks: int = 0,
) -> RouteRequest:
    """A request body -> its RouteRequest: rendered, hashed (if ``hash_prefix``) and sized once.

    ``namespace`` is the tenant's cache namespace (empty for shared caches) and also scopes the
    session id, so two tenants' ``user="alice"`` are different sessions.
    """
    o = options or _DEFAULT_OPTIONS
    model = model if model is not None else str(body.get("model") or "")
    if session_id is not None and namespace:
        session_id = f"{namespace}\x00{session_id}"
    if not hash_prefix:
        return RouteRequest(
            model=model,
            request_id=request_id,
            tenant_priority=tenant_priority,
            session_id=session_id,
        )
    k = text_key(
        path_kind,
        body,
        model=model,
        namespace=namespace,
        cache_salt=cache_salt,
        block_chars=o.block_chars,
        max_blocks=o.max_blocks,
        token_block_size=o.token_block_size,
        chars_per_token=o.chars_per_token,
        tail_ratio=o.tail_ratio,
        tail_blocks=o.tail_blocks,
        block_chain_blocks=block_chain_blocks,
    )
    # Positional, in field order: keywords make CPython build a dict to call a dataclass __init__.
    return RouteRequest(
        model,
        request_id,
        tenant_priority,
        tuple(k.chain),
        k.block_tokens,
        round(k.prompt_tokens),
        session_id,
        k.dense_blocks,
        k.tail_ends,
        tuple(k.blocks),
    )


# -- registry --------------------------------------------------------------------------------------
POLICIES: dict[str, type] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "prefix": PrefixAffinity,
    "session": SessionAffinity,
    "kv_aware": KVAware,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(
    name: str,
    *,
    weights: Weights | None = None,
    options: RoutingOptions | None = None,
    rng: random.Random | None = None,
    state: RoutingState | None = None,
    clock: Callable[[], float] | None = None,
) -> Policy:
    """A policy by its config name. Pass ``state=old.state`` to keep what the old one learned."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(rng)
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    policy: Policy = cls(weights=weights, options=options, rng=rng, state=state, clock=clock)
    return policy
