"""The default policy, ``kv_aware``: cache reuse weighed against queue delay and KV pressure.

Its per-candidate scoring loop (signal formulas inlined, per-worker memo, sampling in large fleets;
see ``KVAware``) is most of the policy code, so it lives here, apart from the interface, the
baselines and the registry (``make_policy``) in ``scoring.policy``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from scoring.state import _Learning
from scoring.views import Decision, RouteRequest, RoutingOptions, WorkerView

__all__ = ["KVAware"]


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
        now = self._clock()
        matches, trusted = state.matches(request, now)
        entry = state.sessions.lookup(request.session_id, now) if request.session_id else None
        last, last_tokens = entry if entry else (None, 0)
        # This session's share of its worker's commitment: its last turn while still active
        # (after session_active_s it has left the commitment, and subtracting it anyway made the
        # least committed figure negative, which took every other holder's cache credit).
        own_committed = state.sessions.active_tokens(request.session_id, last) if last else 0
        committed = state.sessions.committed(now) if self.options.commitment_slack else {}
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
        ctx = (matches, last, last_tokens, committed, own_committed)
        ties, best, n_ok, n_held, best_match = scan(pool, request, ctx, True)
        if n_ok == 0 and pool is not candidates:  # the sample is saturated: look at everyone
            pool = candidates
            ties, best, n_ok, n_held, best_match = scan(pool, request, ctx, True)
        if n_ok + n_held == 0:  # every worker is saturated: score them all, the queue decides
            ties, best, _n, _h, best_match = scan(pool, request, ctx, False)
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
        if wait > _MAX_WAIT_S:  # inf (a tiny weight): its queue term would be inf/inf = NaN
            wait = _MAX_WAIT_S
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
        ctx: tuple[dict[str, int], str | None, int, dict[str, int], int],
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

        ``ctx`` is (prefix matches, the session's last worker, its last turn's tokens, the
        workers' session commitment, this session's share of it).
        """
        matches, last, last_tokens, committed, own_committed = ctx
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
        cget = committed.get
        min_committed = float("inf") if committed else 0.0
        for w in candidates:
            name = w.name
            if committed:
                c = cget(name, 0) - (own_committed if name in session else 0)
                if c < min_committed:
                    min_committed = c
            e = memo_get(name)
            if e is None or e[0] is not w:
                e = memo[name] = load(w)
            _w, wait, queue, kv, inv_cap, sat, qsat = e
            m = mget(name, 0)
            if sat:
                if m and (not qsat or wait * o.prefill_tokens_per_s < _QUEUE_STAY * covered(m)):
                    # A holder saturated on KV only is not skipped: the request adds just its
                    # uncached tail there (the kv term weighs it). Skipping it sent hot prefixes
                    # to cold workers in overload (Mooncake x5 on 8 x 16,384 blocks: hit 15.8% ->
                    # 16.1%, p99 TTFT 16.6 -> 15.9 s; precise 15.4% -> 16.6%, 16.2 -> 14.9 s).
                    # A holder with a long queue is skipped only when its queued prefill would
                    # take longer than _QUEUE_STAY x what its hit saves: queued turns of one
                    # agent are mostly cache hits themselves, and moving one re-prefills the
                    # whole context on a cold worker.
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
                special.append((w, m, queue, kv, inv_cap, wait, e[3] if sat else 0.0))
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
        cslack = o.commitment_slack
        cratio = o.affinity_max_ratio
        inv_tps = 1.0 / o.prefill_tokens_per_s
        horizon = o.queue_horizon_s
        roomy: bool | None = None  # another worker has room for the whole prompt (found lazily)
        for w, m, queue, kv, inv_cap, wait, kv_sat in special:
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
                if committed and eff > 0 and w.name != last:
                    # commitment_yield: a hit for a session not living here yet (a shared
                    # preamble, mostly) weighed against the contexts this worker already carries;
                    # a session's own worker keeps its credit (moving it re-prefills its history).
                    c = cget(w.name, 0)
                    excess = c - min_committed
                    if excess > 0 and c > cratio * min_committed:
                        y = 1.0 - excess / (cslack * matched)
                        eff = eff * y if y > 0 else 0.0
            own = prompt - matched if prompt > matched else 0.0
            if inv_cap:
                kv += own * inv_cap
                if kv > 1.0:
                    kv = 1.0
            stay = True
            if (
                kv_sat
                and inv_cap
                and (w.waiting > 0 or kv_sat + (own + w.prefill_tokens) * inv_cap > _NO_ROOM)
            ):
                if roomy is None:
                    roomy = self._room_elsewhere(candidates, ctx, prompt)
                if roomy:
                    # KV-saturated, and no room for this request's uncached tail beside what
                    # runs there (or a request already waits there for room, which vLLM admits
                    # as soon as blocks free): it would wait for running requests to end, as
                    # long as their decodes take, while another worker takes the whole prompt
                    # now without evicting anything. Neither the cache nor the session is worth
                    # that (weka-agentic, 8 x 4,096 blocks: p99 TTFT 47.8 -> 2.9 s).
                    eff = 0.0
                    stay = False
            sess = 0.0
            if w.name == last and stay:  # session_signal
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

    def _room_elsewhere(
        self, candidates: Sequence[WorkerView], ctx: tuple[Any, ...], prompt: float
    ) -> bool:
        """Whether an unsaturated worker that holds nothing of this prompt could take all of it
        beside what runs there and the live sessions parked there (their contexts come back), so
        moving the request there evicts nothing anyone is about to reuse. Only asked when a
        KV-saturated holder has no room for the request's tail: rare, so not in the scan."""
        matches, last, _t, committed, _o = ctx
        memo = self._memo
        for w in candidates:
            name = w.name
            if name in matches or name == last:
                continue
            e = memo.get(name)
            if e is None or e[0] is not w:
                e = memo[name] = self._load(w)
            if not e[5] and e[4] and e[3] + (prompt + committed.get(name, 0)) * e[4] <= 1.0:
                return True
        return False


# Memo entries (one per worker name) kept beyond 4x the candidates before the memo is cleared.
_MEMO_SLACK = 1024
# A worker's estimated wait, at most (a year): a larger one is no estimate, and an infinite one
# (a weight of 1e-310, which the config accepts) made its queue term NaN, every comparison
# false, and the decision an IndexError: a 500 for each request of its model.
_MAX_WAIT_S = 3.15e7
# A queue-saturated holder stays a candidate (the score then weighs its wait) while its queued
# prefill is estimated under this many times the prefill its hit saves. Measured: 1 left a single
# agent's session on the weka-agentic sample (compare's default, 962x) split over three workers
# (hit 85.0%, p99 TTFT 2.51 s, against 93.9% / 2.05 s at 2); 2 gives the conversation at 8 x 4,096
# blocks (x4, 5 seeds) hit 88.5% -> 90.1%, p99 9.3 -> 11.4 s, and 4 gives 89.9% / 15.3 s. No
# change on Azure, Mooncake or weka at either cache size, or on the agentic-preamble trace; the
# long-document conversation 48.2% / 17.8 s -> 48.5% / 16.9 s (3 seeds).
_QUEUE_STAY = 2.0
# KV use above which a request's tail is taken not to fit beside a saturated worker's running
# requests: the scrape is up to an interval old and every running decode grows a block at a time.
# An agent's parallel calls fill its holder with one shared context, and a tail that still fits
# starts there at once (a preempted call recomputes only its own blocks). At 0.98 such a turn of
# weka-agentic (8 x 4,096 blocks, tail 4.6% of the cache at 94.2% used) re-prefilled its
# 63k-token context on a cold worker: 0.99 takes hit 85.7% -> 87.6% (0.94 -> 0.96 of the pooled
# LRU) at p99 TTFT 2.911 -> 2.921 s, with one more preempted request (TPOT p99 0.04 -> 0.20 s,
# goodput unchanged); every other cell of bench/README's table is unchanged (5 seeds each). At
# 1.0 the turn that finds 95.6% used and needs 4.4% more stays, and waits 47 s.
_NO_ROOM = 0.99
