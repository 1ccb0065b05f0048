"""The fleet as the gateway sees it: each worker's health state, served models and load.

State changes are plain synchronous methods (no I/O) so the health state machine is tested
directly; `workers.probe` and the proxy feed it outcomes. The per-worker record it changes
(`Worker`, its `WorkerSpec` and `Health`) is `workers.worker`.

    starting --probe ok--> healthy --N consecutive probe failures--> unhealthy
    unhealthy --M consecutive probe successes (re-probed with backoff)--> healthy
    healthy --N consecutive request failures, or the breaker--> unhealthy, held (ejection)
    held --hold over, then M probe successes--> half_open
    half_open --a proxied request succeeds--> healthy
    half_open --a proxied request fails--> unhealthy, held twice as long

Passive failures (a proxied request that could not connect, got a 5xx or timed out before its
first byte) count toward the same N, so a dead worker is ejected at the speed of traffic rather
than at the speed of probes. Probe successes do not reset the passive streak: a worker can answer
`/health` and fail every request, and that worker must not be saved by its own health check.

A worker that went out because *requests* failed is not readmitted by `/health` (it
answered 200 there, was readmitted ~40 ms after each ejection, flapped 13 times a second and a
third of the requests needed a retry). It is held out like a breaker ejection, then goes
**half-open**: it takes at most `half_open_requests` trial requests at once (requests it still
runs from before its ejection take no trial slot: `trial_room`) and is healthy again only when one
of them succeeds (first byte of a stream, or a whole non-5xx response); a failed one ejects it
again with a doubled hold. A worker that went out through failed probes alone (nothing it was
sent failed) is readmitted by probes as before: it has shown no request failure to re-test.

Protections on top of that state machine:

- **Drain** (`drain`): an operator takes a worker out of routing (`candidates`) while its
  in-flight requests finish and its probes go on; `drained` says when it is safe to restart it.
  Draining is not a health state: a draining worker stays HEALTHY, so undraining readmits it at
  once, and a config reload keeps the flag (the operator's intent outlives the file).
- **Circuit breaker**: a worker that fails intermittently never builds N *consecutive* failures,
  yet loses most requests (each failure is a retry: latency for the client, load for the fleet).
  The breaker also ejects when the error rate over the last `breaker_window` passive outcomes
  exceeds `breaker_error_rate`, once at least `breaker_min_requests` outcomes are in.
- **TTFT outlier ejection** (`observe_ttft`): a worker whose median time to first token is far
  above its peers' (thermal throttling, a bad NIC, a noisy neighbour) is answering, just slowly,
  so neither rule above sees it.

Every ejection (request failures, breaker, outlier) holds the worker out for an ejection time that
doubles on each repeated ejection (`backoff_initial_s` up to `backoff_max_s`; a worker that then
stays healthy for `backoff_max_s` starts a fresh series): probes that succeed before it runs out do
not readmit it. After a request-failure or breaker ejection the trial is a real request
(half-open, above), and a worker readmitted from it starts with a clean error window: the
ejection acted on that evidence, and the ejection count, not the window, makes a relapse back off.
An outlier ejection ends with the first successful probe after the hold (with deep probes on, it
generates a token): one request could not show that it is no longer slow, fresh TTFT samples do.
A readmission after probe failures alone keeps the error window, so a worker flapping its health
check cannot wipe the breaker's evidence.

Load and KV numbers (`/metrics`) are kept from one probe to the next only while they keep
coming: after `metrics_stale_after` probes in a row without them they are dropped to unknown
(`_metrics_missed`), and routing goes by the gateway's own in-flight counts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

from workers.vllm_metrics import WorkerMetrics
from workers.worker import Health, Worker, WorkerSpec, median

# Ejections for failed requests: readmitted through a half-open trial request, not by probes.
_TRIAL_REASONS = frozenset({"failures", "breaker"})
# Exponent cap of the ejection backoff: 2**60 x any base is past every backoff_max_s, and a float
# power of a larger count would overflow after days of a worker failing every trial.
_MAX_DOUBLINGS = 60
# Probes in a row without a `/metrics` reading after which the last one is dropped (see
# `Registry._metrics_missed`).
METRICS_STALE_AFTER = 3

log = logging.getLogger("kvgate.registry")


HealthHook = Callable[[Worker, Health], None]


class Registry:
    """The fleet and its health state machine (see the module docstring).

    Knobs are plain attributes; `configure` changes them on a config reload. Every protection is
    off when its main knob is 0: `breaker_window` / `breaker_error_rate` for the breaker,
    `outlier_factor` / `outlier_max_fraction` for TTFT outliers. `half_open_requests` is how many
    trial requests a half-open worker may have in flight at once.
    """

    def __init__(
        self,
        specs: Iterable[WorkerSpec] = (),
        *,
        unhealthy_after: int = 3,
        healthy_after: int = 1,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        half_open_requests: int = 1,
        breaker_window: int = 20,
        breaker_error_rate: float = 0.5,
        breaker_min_requests: int = 10,
        outlier_factor: float = 3.0,
        outlier_min_s: float = 1.0,
        outlier_min_samples: int = 20,
        outlier_max_fraction: float = 0.34,
        outlier_window: int = 50,
        outlier_check_s: float = 1.0,
        metrics_stale_after: int = METRICS_STALE_AFTER,
        clock: Callable[[], float] = time.monotonic,
        on_change: HealthHook | None = None,
    ) -> None:
        self.clock = clock
        # Called as on_change(worker, previous_health) on every health transition, whatever
        # caused it (probe, passive failure, breaker, outlier): one place to export and log.
        self.on_change = on_change
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.half_open_requests = half_open_requests
        self.breaker_window = breaker_window
        self.breaker_error_rate = breaker_error_rate
        self.breaker_min_requests = breaker_min_requests
        self.outlier_factor = outlier_factor
        self.outlier_min_s = outlier_min_s
        self.outlier_min_samples = outlier_min_samples
        self.outlier_max_fraction = outlier_max_fraction
        self.outlier_window = outlier_window
        self.outlier_check_s = outlier_check_s
        self.metrics_stale_after = metrics_stale_after
        self._next_outlier_check = 0.0
        self.workers: dict[str, Worker] = {}
        # Every model any current worker has ever reported: tells "unknown model" (404) apart
        # from "known model, nobody healthy serves it right now" (503).
        self._known_models: dict[str, frozenset[str]] = {}
        # Served name -> the name its prompts' KV blocks are keyed under (`cache_name`).
        self.cache_names: dict[str, str] = {}
        # Half-open worker -> how many of its requests in flight are from before its trial began
        # (`trial_room`): the registry sees no dispatch, only `in_flight`.
        self._pre_trial: dict[str, int] = {}
        self.sync(specs)

    KNOBS = frozenset(
        {
            "unhealthy_after",
            "healthy_after",
            "backoff_initial_s",
            "backoff_max_s",
            "half_open_requests",
            "breaker_window",
            "breaker_error_rate",
            "breaker_min_requests",
            "outlier_factor",
            "outlier_min_s",
            "outlier_min_samples",
            "outlier_max_fraction",
            "outlier_window",
            "outlier_check_s",
        }
    )

    def configure(self, **knobs: float) -> None:
        """Change knobs live (config reload). Windows shrink lazily on the next outcome/sample;
        worker state (health, drain, ejections) is kept."""
        unknown = set(knobs) - self.KNOBS
        if unknown:
            raise TypeError(f"unknown registry setting(s): {sorted(unknown)}")
        for k, v in knobs.items():
            setattr(self, k, v)

    # -- membership --------------------------------------------------------------------------
    def sync(self, specs: Iterable[WorkerSpec]) -> tuple[list[str], list[str]]:
        """Make the fleet match `specs`; returns (added, removed). Unchanged workers keep state.

        A worker whose URL changed is a new server and starts over, except for `draining`: a
        drain is the operator's decision about that name and only an undrain lifts it. It is
        listed as removed *and* added, so what was learned of the old server (the routing
        index's picture of its cache, its metrics series) goes with it."""
        wanted = {s.name: s for s in specs}
        removed = [n for n in self.workers if n not in wanted]
        for n in removed:
            self.remove(n)
        added = []
        for name, spec in wanted.items():
            cur = self.workers.get(name)
            if cur is None:
                self.workers[name] = Worker(spec)
                added.append(name)
            elif cur.spec != spec:
                if cur.spec.url != spec.url:  # a different server: start over
                    self.workers[name] = Worker(spec, draining=cur.draining)
                    self._known_models.pop(name, None)
                    self._pre_trial.pop(name, None)
                    if cur.model_cards:
                        self._index_cache_names()
                    removed.append(name)
                    added.append(name)
                else:
                    cur.spec = spec
        return added, removed

    def add(self, spec: WorkerSpec) -> Worker:
        if spec.name in self.workers:
            raise ValueError(f"worker {spec.name!r} already exists")
        w = self.workers[spec.name] = Worker(spec)
        return w

    def remove(self, name: str) -> bool:
        self._known_models.pop(name, None)
        self._pre_trial.pop(name, None)
        gone = self.workers.pop(name, None)
        if gone is not None and gone.model_cards:
            self._index_cache_names()
        return gone is not None

    def cache_name(self, model: str) -> str:
        """The name a request for ``model`` keys its prompt's KV blocks under: the model's
        weights (its cards' `root`) where every worker listing the name agrees on them, else the
        name. vLLM serves one model under all its `--served-model-name`s and caches one set of
        blocks for them (the name is not in its block hash), and publishes its KV events
        without a name: keyed by the served name, requests under an alias never matched the
        events (or the prefixes) of the same worker under its other name."""
        return self.cache_names.get(model, model)

    def _index_cache_names(self) -> None:
        roots: dict[str, set[str]] = {}
        for w in self.workers.values():
            for mid, card in w.model_cards.items():
                root = card.get("root")
                # A LoRA adapter (a parent) keys its blocks under its own name, as vLLM does.
                ok = isinstance(root, str) and root and not card.get("parent")
                roots.setdefault(mid, set()).add(root if ok else mid)  # type: ignore[arg-type]
        self.cache_names = {m: next(iter(r)) if len(r) == 1 else m for m, r in roots.items()}

    # -- drain -------------------------------------------------------------------------------
    def drain(self, name: str, draining: bool = True) -> bool:
        """Stop (or, with draining=False, resume) sending new requests to `name`.

        In-flight requests finish normally and probes continue, so health is current the moment
        the worker is undrained. Returns False for an unknown worker."""
        w = self.workers.get(name)
        if w is None:
            return False
        w.draining = draining
        return True

    def drained(self, name: str) -> bool:
        """True once `name` is draining and has nothing in flight (False if unknown)."""
        w = self.workers.get(name)
        return w is not None and w.drained

    # -- queries -----------------------------------------------------------------------------
    def candidates(self, model: str) -> list[Worker]:
        """Workers that may take a new request for `model` now: serving it, not draining, and
        healthy, or half-open with a trial slot free (`trial_room`; the proxy counts in_flight
        before it awaits anything, so no two picks see the same free trial slot). Whether the
        model is served at all is `serving`'s question: a half-open worker whose trial runs is
        not in this list, yet its verdict may be a moment away."""
        return [
            w
            for w in self.workers.values()
            if (
                w.health is Health.HEALTHY
                or (w.health is Health.HALF_OPEN and self.trial_room(w) > 0)
            )
            and not w.draining
            and model in w.models
        ]

    def serving(self, model: str) -> list[Worker]:
        """Workers that serve `model`, full or not: not draining, and healthy or half-open. What
        decides between "wait for room" (the admission queue) and "nothing serves it" (a 503 or
        404 at once): a request behind a half-open worker's running trial waits for its verdict,
        as one behind a full healthy worker waits for a slot (review: every request for the
        model of a worker on trial was refused 503 until the trial ended)."""
        return [
            w
            for w in self.workers.values()
            if w.health in (Health.HEALTHY, Health.HALF_OPEN)
            and not w.draining
            and model in w.models
        ]

    def trial_room(self, w: Worker) -> int:
        """Trial requests half-open ``w`` may still take: `half_open_requests` minus those sent
        since it went half-open.

        Its requests from before the ejection (a long stream that outlived it) are not trials:
        counted as trials, one such stream took the only trial slot and no trial could start
        until it ended (review: 23 requests in 12 s refused while the worker streamed, at 1 of
        256 slots). They are the ``in_flight`` noted when it went half-open, lowered whenever
        ``in_flight`` is found below that (old requests ended; every pick reads this first, so
        a trial sent after they ended counts in full). The registry sees no dispatch, only
        ``in_flight``: an old request ending while a trial runs looks like the trial's end and
        lets one more trial in. Only one ending with no verdict does (a client gone): one that
        ends well, or fails, is itself the trial's verdict."""
        pre = self._pre_trial.get(w.name, 0)
        if pre > w.in_flight:
            pre = self._pre_trial[w.name] = max(w.in_flight, 0)
        return self.half_open_requests - (w.in_flight - pre)

    def healthy(self) -> list[Worker]:
        """Workers that take traffic: HEALTHY, and HALF_OPEN ones (on trial), draining ones
        included (they still serve in-flight requests); filter on `draining` for "can take new
        work". Half-open counts because only traffic can end a trial: a fleet all on trial must
        stay ready (/ready) and list its models, or no request would ever come to readmit it."""
        return [w for w in self.workers.values() if w.health in (Health.HEALTHY, Health.HALF_OPEN)]

    def held(self, name: str) -> bool:
        """Inside an ejection's hold: nothing a probe says can readmit it before the hold ends."""
        w = self.workers.get(name)
        return w is not None and w.health is Health.UNHEALTHY and self.clock() < w.ejected_until

    def served_models(self) -> dict[str, dict[str, object]]:
        """Model id -> card, over healthy workers that take new requests (the first worker's
        card wins): a model only a drained worker serves is refused 503, so `/v1/models` does
        not list it (review: it did), as `/ready` does not count that worker."""
        out: dict[str, dict[str, object]] = {}
        for w in self.healthy():
            if w.draining:
                continue
            for mid, card in w.model_cards.items():
                out.setdefault(mid, card)
        return out

    def knows_model(self, model: str) -> bool:
        return any(model in ms for ms in self._known_models.values())

    # -- probe outcomes ----------------------------------------------------------------------
    def probe_ok(
        self,
        name: str,
        cards: list[dict[str, object]] | None,
        metrics: WorkerMetrics | None,
    ) -> None:
        """A successful probe. Readmits a worker that went out through probes; after a held
        ejection only once the hold is over, and after one for failed requests only to half-open
        (`/health` said 200 all along while its requests failed: a probe proves nothing there).
        It never resets the passive streak, for the same reason."""
        w = self.workers.get(name)
        if w is None:
            return
        self._probe_data(w, cards, metrics)
        w.consecutive_failures = 0
        w.consecutive_successes += 1
        if not w.ejection_reason:  # held out or on trial: keep saying why
            w.last_error = ""
        if (
            w.health in (Health.STARTING, Health.UNHEALTHY)
            and w.consecutive_successes >= self.healthy_after
            and self.clock() >= w.ejected_until
        ):
            w.backoff_s = 0.0
            if w.ejection_reason in _TRIAL_REASONS:
                self._set(w, Health.HALF_OPEN)
            else:
                w.last_error = ""
                self._set(w, Health.HEALTHY)

    def probe_failed(
        self,
        name: str,
        error: str,
        cards: list[dict[str, object]] | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        """A failed probe. `cards`/`metrics` are what the probe did learn (a deep probe fails
        after /v1/models and /metrics answered): kept, so load and models stay current."""
        w = self.workers.get(name)
        if w is None:
            return
        self._probe_data(w, cards, metrics)
        self._fail(w, error)
        if w.health is Health.UNHEALTHY:
            w.backoff_s = min(
                self.backoff_max_s,
                max(self.backoff_initial_s, w.backoff_s * 2 if w.backoff_s else 0.0),
            )

    def _probe_data(
        self, w: Worker, cards: list[dict[str, object]] | None, metrics: WorkerMetrics | None
    ) -> None:
        w.last_probe_at = self.clock()
        if cards is not None:
            got = {str(c["id"]): c for c in cards}
            if got != w.model_cards:
                w.model_cards = got
                w.models = frozenset(got)
                self._index_cache_names()
            self._known_models[w.name] = w.models
        if metrics is not None:
            if self.metrics_stale(w):
                log.info(
                    "worker %s: /metrics read again after %d probes without; routing on its "
                    "load and KV numbers again",
                    w.name,
                    w.metrics_missed,
                )
            w.metrics = metrics
            w.metrics_at = w.last_probe_at
            w.metrics_missed = 0
            # On the view's scale (every replica's in-flight), so view.in_flight minus it is
            # what the whole gateway dispatched since this scrape.
            w.in_flight_at_scrape = w.in_flight + w.remote_in_flight
            w.sent_tokens_since_scrape = 0
        else:
            self._metrics_missed(w)

    def metrics_stale(self, w: Worker) -> bool:
        """Whether ``w``'s last scrape was dropped as too old (it had one, and then
        `metrics_stale_after` probes in a row brought none)."""
        return w.metrics_at is not None and w.metrics_missed >= max(1, self.metrics_stale_after)

    def _metrics_missed(self, w: Worker) -> None:
        """A probe without a `/metrics` reading (absent, failed, over a cap, unparsable, too
        slow, or the probe failed). One such keeps the last reading: it is one interval older
        than it would be anyway. After `metrics_stale_after` in a row it is dropped, or a
        reading from before `/metrics` broke ruled for good: "KV 95% full" gave a worker that
        served fine no room at all (`gateway.slots.Slots.worker_room`: every request waited out
        its deadline and got a 503), and "idle" kept sending traffic to one that filled up.

        Counted in probes, not seconds: the probes are the scrapes, so a count says how many
        chances the worker had to report, whatever the interval (reloaded, or backed off while
        it is out), and a gateway stall that delays probes does not age every worker at once.
        Three is one lost scrape plus a margin, bounded at a few intervals' age.

        Dropped means unknown, as before a first scrape: `WorkerMetrics()` (no load, no KV use,
        no capacity) and no `in_flight_at_scrape`, so routing and admission go by the gateway's
        own in-flight counts and concurrency caps. The process start time stays: it is which
        process this is, not a load reading (restart detection keeps the last one anyway)."""
        w.metrics_missed += 1
        if w.metrics_at is None or w.metrics_missed != max(1, self.metrics_stale_after):
            return  # nothing to drop, not yet, or dropped already
        log.warning(
            "worker %s: no /metrics reading for %d probes in a row (last %.1fs ago); its load "
            "and KV numbers are unknown until one comes",
            w.name,
            w.metrics_missed,
            self.clock() - w.metrics_at,
        )
        w.metrics = WorkerMetrics(process_start=w.metrics.process_start)
        w.in_flight_at_scrape = None
        w.sent_tokens_since_scrape = 0

    # -- passive outcomes (proxied requests) -------------------------------------------------
    def passive_failure(self, name: str, error: str) -> None:
        """A proxied request failed before its first byte (connect error, 5xx, timeout).

        A healthy worker is ejected, held, after `unhealthy_after` in a row (or by the breaker);
        a half-open one has failed its trial and is ejected again at once, held twice as long.
        Failures reported for a worker already out are requests sent before it went out: counted,
        but its state and the reason it gives stay."""
        w = self.workers.get(name)
        if w is None:
            return
        w.consecutive_successes = 0
        w.consecutive_failures += 1
        w.passive_streak += 1
        if w.health is Health.HALF_OPEN:
            self._eject(w, w.ejection_reason or "failures", f"trial request failed: {error}")
            return
        if w.health is not Health.HEALTHY:
            if not w.ejection_reason:
                w.last_error = error
            return
        w.last_error = error
        self._record_outcome(w, failed=True)
        n = self.unhealthy_after
        if w.passive_streak >= n or w.consecutive_failures >= n:
            self._eject(w, "failures", self._streak_error(w, error))
        elif self._breaker_open(w):
            self._eject(
                w,
                "breaker",
                f"circuit breaker: {w.outcome_failures}/{len(w.outcomes)} recent requests "
                f"failed (last: {error})",
            )

    def passive_success(self, name: str) -> None:
        """A proxied request succeeded (a whole response below 500, or a stream that ended well).
        On a half-open worker that is the trial passing: it is healthy again."""
        w = self.workers.get(name)
        if w is None or w.health not in (Health.HEALTHY, Health.HALF_OPEN):
            return
        self._succeeded(w)
        self._record_outcome(w, failed=False)

    def _succeeded(self, w: Worker) -> None:
        """A proxied request got its answer: the failure streaks end, and a trial passes."""
        w.consecutive_failures = 0
        w.passive_streak = 0
        w.last_success_at = self.clock()
        if w.health is Health.HALF_OPEN:
            # The ejection acted on the window's failures; a relapse backs off by the ejection
            # count instead (kept until the worker stays in for backoff_max_s).
            w.outcomes.clear()
            w.outcome_failures = 0
            w.last_error = ""
            self._set(w, Health.HEALTHY)

    def _streak_error(self, w: Worker, error: str) -> str:
        probes = w.consecutive_failures - w.passive_streak
        if probes > 0:
            n = w.consecutive_failures
            return f"{n} failures in a row, {probes} of them probes (last: {error})"
        n = w.passive_streak
        return f"{n} request{'s' if n != 1 else ''} failed in a row (last: {error})"

    def _record_outcome(self, w: Worker, *, failed: bool) -> None:
        if self.breaker_window <= 0:
            return
        w.outcomes.append(failed)
        w.outcome_failures += failed
        while len(w.outcomes) > self.breaker_window:
            w.outcome_failures -= w.outcomes.popleft()

    def _breaker_open(self, w: Worker) -> bool:
        """Error rate strictly above the threshold over at least min_requests outcomes."""
        if self.breaker_window <= 0 or self.breaker_error_rate <= 0:
            return False
        n = len(w.outcomes)
        return n >= max(1, self.breaker_min_requests) and w.outcome_failures > (
            self.breaker_error_rate * n
        )

    # -- TTFT outliers -----------------------------------------------------------------------
    def observe_ttft(self, name: str, seconds: float) -> list[str]:
        """One proxied request's time to first token on `name` (from dispatch to that worker,
        not from the client's arrival: admission queueing is not the worker's fault).

        Cheap on the hot path: the fleet-wide comparison runs at most every `outlier_check_s`.
        Returns the workers ejected by that comparison, if it ran (usually none)."""
        w = self.workers.get(name)
        if w is None:
            return []
        if w.health is Health.HALF_OPEN:
            # First byte from a trial request: the worker answers again. Passing here, not at the
            # end of the stream, keeps the trial as short as a TTFT: a fleet all on trial has one
            # request slot per worker until then.
            self._succeeded(w)
        if w.health is not Health.HEALTHY or not self._outliers_on():
            return []
        w.ttfts.append(seconds)
        while len(w.ttfts) > max(1, self.outlier_window):
            w.ttfts.popleft()
        now = self.clock()
        if now < self._next_outlier_check:
            return []
        self._next_outlier_check = now + self.outlier_check_s
        return self.eject_outliers()

    def _outliers_on(self) -> bool:
        return self.outlier_factor > 0 and self.outlier_max_fraction > 0

    def outliers(self) -> list[tuple[str, float, float]]:
        """Healthy workers that would be ejected now, worst first, as (name, median, peers'
        median): a pure query, `eject_outliers` acts on it.

        Conservative on purpose. TTFT is dominated by prefill of the uncached part of a prompt,
        and a KV-aware router sends each worker a different cache-hit mix, so per-worker TTFT
        medians differ a lot between perfectly good workers. Hence: medians, not means; only
        workers with `outlier_min_samples` samples take part; peers are workers serving the same
        models (a 70B and an 8B deployment are not comparable); a worker is an outlier only when
        its median is above `outlier_factor` x its peers' median *and* above `outlier_min_s`
        (3x of 50 ms is noise, not a sick GPU); and at most `outlier_max_fraction` of a peer group
        (counting members already out as outliers) may be out at once, so a fleet-wide slowdown
        (a traffic burst, long prompts) never empties the fleet: with three workers one may go,
        with two neither (their median is their mean, which no factor >= 2 can exceed).
        """
        if not self._outliers_on():
            return []
        groups: dict[frozenset[str], list[Worker]] = {}
        ejected: dict[frozenset[str], int] = {}
        for w in self.workers.values():
            if w.health is Health.HEALTHY:
                groups.setdefault(w.models, []).append(w)
            elif w.ejection_reason == "outlier":
                ejected[w.models] = ejected.get(w.models, 0) + 1
        out: list[tuple[str, float, float]] = []
        for models, members in groups.items():
            already = ejected.get(models, 0)
            room = math.floor(self.outlier_max_fraction * (len(members) + already) + 1e-9)
            room -= already
            if room <= 0:
                continue
            meds = {
                w.name: m
                for w in members
                if len(w.ttfts) >= max(1, self.outlier_min_samples)
                and (m := w.ttft_median()) is not None
            }
            if len(meds) < 3:
                continue  # fewer than three opinions: no majority to call anyone slow
            peers = median(list(meds.values()))
            limit = max(self.outlier_factor * peers, self.outlier_min_s)
            slow = sorted(
                ((n, m, peers) for n, m in meds.items() if m > limit), key=lambda t: -t[1]
            )
            out.extend(slow[:room])
        return out

    def eject_outliers(self) -> list[str]:
        """Eject what `outliers` names; returns their names."""
        names = []
        for name, med, peers in self.outliers():
            w = self.workers[name]
            self._eject(
                w,
                "outlier",
                f"ttft outlier: median {med:.3f}s over {len(w.ttfts)} requests vs peers' "
                f"{peers:.3f}s (limit {self.outlier_factor:g}x, floor {self.outlier_min_s:g}s)",
            )
            names.append(name)
        return names

    # -- transitions -------------------------------------------------------------------------
    def _fail(self, w: Worker, error: str) -> None:
        """A failed probe. Reaching `unhealthy_after` with request failures among them is an
        ejection for failed requests (held, then half-open); with probes alone, plain UNHEALTHY
        that probes readmit."""
        w.consecutive_successes = 0
        w.consecutive_failures += 1
        w.last_error = error
        if w.health is Health.UNHEALTHY or w.consecutive_failures < self.unhealthy_after:
            return
        if w.health is Health.HEALTHY and w.passive_streak:
            self._eject(w, "failures", self._streak_error(w, error))
        else:
            # From half-open the reason stays: readmission goes through a trial again.
            self._set(w, Health.UNHEALTHY)

    def _eject(self, w: Worker, reason: str, error: str) -> None:
        """Held ejection: UNHEALTHY for an ejection time that doubles with each ejection in a
        row. A worker that stayed healthy for longer than the longest ejection since its last
        one starts a fresh series: that is a new incident, not the same one (a half-open worker
        has not been back at all: its failed trial continues the series)."""
        now = self.clock()
        if (
            w.ejections
            and w.health is Health.HEALTHY
            and now - w.last_change_at > self.backoff_max_s
        ):
            w.ejections = 0
        w.ejections += 1
        doublings = min(w.ejections - 1, _MAX_DOUBLINGS)
        hold = min(self.backoff_max_s, self.backoff_initial_s * 2.0**doublings)
        w.ejected_until = now + hold
        w.ejection_reason = reason
        w.last_error = error
        w.consecutive_successes = 0
        self._set(w, Health.UNHEALTHY, now)

    def _set(self, w: Worker, health: Health, now: float | None = None) -> None:
        was = w.health
        w.health = health
        w.last_change_at = self.clock() if now is None else now
        if health is Health.HALF_OPEN:
            if was is not Health.HALF_OPEN:
                self._pre_trial[w.name] = max(w.in_flight, 0)  # all sent before the trial
        else:
            self._pre_trial.pop(w.name, None)
        if health is Health.HEALTHY:
            # TTFT samples from before it went out are not this worker's speed now (and an
            # outlier ejection acted on them). The error window is cleared where an ejection
            # acted on it (`_succeeded`), not here: probe flaps must not wipe it.
            w.ttfts.clear()
            w.ejection_reason = ""
            w.ejected_until = 0.0
        if was is not health and self.on_change is not None:
            self.on_change(w, was)

    def next_probe_delay(self, name: str, interval_s: float) -> float:
        """Seconds until `name`'s next probe: the interval, or longer while it is ejected (probe
        backoff, or the rest of a held ejection)."""
        w = self.workers.get(name)
        if w is None or w.health is not Health.UNHEALTHY:
            return interval_s
        return max(interval_s, w.backoff_s, w.ejected_until - self.clock())
