"""The desired worker count per model: the autoscaling formula, pure.

The gateway is the one place that sees every request of a model from arrival to first token, the
admission queue in front of the fleet, and every worker's KV cache: so it exports, per model, the
signals an autoscaler (KEDA, a Kubernetes HPA, a Ray Serve controller) should act on, plus
``kvgate_autoscale_desired_workers``, the count those signals call for. An autoscaler that sets
``replicas = desired`` needs no model of LLM serving of its own; one that wants its own policy can
use the raw signals instead.

This module is the pure core, per the project's "pure cores, thin shells"; the shell that
evaluates it at scrape time and exports the ``kvgate_autoscale_*`` series is gateway/autoscale.py.

``DesiredWorkers`` (pure: no asyncio, no prometheus; ``now`` explicit or an injected clock)
    Observations come from the request walk (``observe_ttft``, ``observe_queue_wait``,
    ``begin(...)``/``InFlight.end()`` for tokens in flight); fleet state comes in as snapshots
    (``ModelLoad``: the healthy workers serving the model and its admission queue) at
    ``evaluate(loads, now)``, which returns one ``Signals`` per model.

The p95s come from ``WindowQuantile`` (gateway/window_quantile.py), one for TTFT and one for
the admission wait per model.

The formula (per model, at each evaluation)
-------------------------------------------
``N`` = healthy workers serving the model. Four pressure ratios, 1.0 = at target::

    r_ttft  = ttft_p95       / target_ttft_p95_s        (gateway-observed, includes queueing)
    r_wait  = queue_wait_p95 / target_queue_wait_p95_s  (admission wait, 0 for the fast path)
    r_kv    = kv_usage       / target_kv_usage          (capacity-weighted mean of the N workers)
    r_queue = queue_depth    / (max_queue_per_worker * N)
    r       = max(r_ttft, r_wait, r_kv, r_queue)

``queue_depth`` is the gateway's admission queue plus the requests waiting inside the workers
(vLLM ``num_requests_waiting``): with a generous ``worker_concurrency`` the backlog sits in vLLM,
not in the gateway. The latency ratios count only with ``min_samples`` in the window (a p95 of
three requests is noise) and only from samples taken since ``N`` last grew, so slow requests
from before a scale-out cannot justify a second one.

* Scale out, at once, when ``r > 1``: ``target = ceil(N * r)``, capped at
  ``max(ceil(N * max_scale_out_factor), N + 1)`` (at most doubling per evaluation by default;
  relative to the healthy ``N``, so repeated evaluations while new workers start do not
  compound) and at ``max_workers``. ``desired = max(desired, target)``: it never drops on the
  way out. With ``N = 0`` and any demand (queued requests, tokens in flight, a breached ratio,
  refused requests: below) the target is ``max(1, min_workers)``.
* Refused requests are demand. With no worker serving a model the gateway answers 503 at once
  and queues nothing, so neither the queue nor tokens in flight can show that clients want it
  (review: with ``min_workers = 0`` a model scaled to zero never came back, 150 requests in 3 s
  all refused and ``desired`` stayed 0). ``note_unserved`` records each such refusal; while
  the last one is less than ``window_s`` (60 s, the p95 window) old, ``desired`` is at least
  ``max(1, min_workers)`` and the model is not calm: the scale-in cooldown restarts at every
  evaluation, and no step in is taken.
* A fleet that is down is not idle: with ``N = 0`` while ``ModelLoad.fleet > 0`` (workers that
  serve the model exist, none is healthy) no step in is taken and the cooldown restarts, with
  or without traffic (review: 3 workers all down under steady refused traffic stepped 3 -> 1).
* Scale in, slowly, only after every ratio has stayed below ``scale_in_below`` (0.5) with the
  admission queue empty for ``scale_in_cooldown_s`` (300 s): ``desired -= scale_in_step`` (1),
  and only when the load then left, ``r * N / (desired - step)``, stays below
  ``scale_in_max_projected`` (0.8), so a step in cannot itself cause a step out. Each step
  restarts the cooldown: the fleet is observed at its new size before the next one.
* Between ``scale_in_below`` and 1 nothing changes (the hysteresis band); any evaluation there
  restarts the scale-in cooldown.
* Always ``min_workers <= desired <= max_workers``.
* A (re)start does not ask for a smaller fleet. The gateway keeps no memory of the last
  ``desired`` across a restart, and its first evaluations can see only part of the fleet (workers
  whose first probe is still out, one that is restarting or failing its probes). Until the
  model's first scale-in step, ``desired`` is therefore never below the largest fleet seen so
  far: ``N``, or ``ModelLoad.fleet`` (workers known to serve the model, in any health state, not
  draining) when that is larger, clamped to the bounds. Raising that floor is no scale event, and
  the decision and the cooldown go on as before. Only a scale-in step, after its calm cooldown,
  ends it. From then on ``desired`` is the autoscaler's own count, as above: a worker coming back
  to health does not raise it, or every step in would be undone while the step's worker is still
  being removed.

Wiring (for gateway/app.py)
    * One ``DesiredWorkers`` per gateway (its collector: gateway/autoscale.py).
    * After ``admission.admit()`` returns: ``observe_queue_wait(model, admitted.wait_s)`` (every
      admitted request, 0 on the fast path) and ``begin(model, request_tokens(...))``; both are
      synchronous, so admission's "last await before the dispatch" rule still holds.
    * ``InFlight.end()`` when the request is over: in the hook that settles a finished call, and
      when the dispatch raises (nothing was handed to the client). Ending twice is harmless.
    * ``observe_ttft(model, call.ttft)`` once the proxy returns a 200 (streams return at the
      first byte, so the sample is timely rather than at the end of a long stream).
    * ``note_unserved(model)`` for each request refused 503 because no worker serves a model the
      registry knows (``Registry.knows_model``): new requests and queued ones failed when the
      last worker went (``_unserved`` sees both). Not for unknown models (a 404, or a 503 before
      any worker answered): any name a client sends would make a model here.
    * Reload: ``configure(settings)``. Nothing here blocks or awaits.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.window_quantile import WindowQuantile

__all__ = [
    "AutoscaleSettings",
    "DesiredWorkers",
    "InFlight",
    "ModelLoad",
    "Signals",
    "WorkerLoad",
    "request_tokens",
]

log = logging.getLogger("kvgate.autoscale")

QUANTILE = 0.95
SIGNALS = ("ttft", "queue_wait", "kv", "queue")


@dataclass(slots=True)
class AutoscaleSettings:
    """Targets and bounds of the desired-workers formula (module docstring)."""

    # Targets: a ratio of 1.0 means "at target"; above it, scale out.
    target_ttft_p95_s: float = 2.0
    target_queue_wait_p95_s: float = 1.0
    target_kv_usage: float = 0.8
    max_queue_per_worker: int = 4
    # Bounds on the answer.
    min_workers: int = 1
    max_workers: int = 64
    # Largest growth of one evaluation, relative to the healthy workers (2.0 = at most double).
    max_scale_out_factor: float = 2.0
    # Scale in only while every ratio is below this (and the admission queue is empty) ...
    scale_in_below: float = 0.5
    # ... for this long, by this many workers, and only if the rest stay below this ratio.
    scale_in_cooldown_s: float = 300.0
    scale_in_step: int = 1
    scale_in_max_projected: float = 0.8
    # Percentile window and its resolution; p95s with fewer samples do not drive the formula.
    window_s: float = 60.0
    slot_s: float = 1.0
    min_samples: int = 10
    # A request whose end was never reported stops counting as in flight after this long.
    in_flight_max_age_s: float = 3600.0

    def __post_init__(self) -> None:
        positive = (
            "target_ttft_p95_s",
            "target_queue_wait_p95_s",
            "target_kv_usage",
            "window_s",
            "slot_s",
            "in_flight_max_age_s",
        )
        for name in positive:
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and > 0, got {v!r}")
        if self.max_queue_per_worker < 1:
            raise ValueError("max_queue_per_worker must be >= 1")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError("need 0 <= min_workers <= max_workers and max_workers >= 1")
        if not self.max_scale_out_factor > 1:
            raise ValueError("max_scale_out_factor must be > 1")
        if not 0 < self.scale_in_below < 1:
            raise ValueError("scale_in_below must be in (0, 1): it is the hysteresis band")
        if not self.scale_in_below <= self.scale_in_max_projected <= 1:
            raise ValueError("scale_in_max_projected must be in [scale_in_below, 1]")
        if self.scale_in_step < 1 or self.scale_in_cooldown_s < 0 or self.min_samples < 1:
            raise ValueError("scale_in_step and min_samples must be >= 1, cooldown >= 0")


# -- inputs and outputs ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One healthy worker serving the model, as its last metrics scrape saw it."""

    kv_usage: float  # 0..1
    num_blocks: int | None = None
    block_size: int | None = None
    waiting: int = 0  # requests queued inside the worker (vLLM num_requests_waiting)


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """Fleet state for one model at evaluation time."""

    workers: tuple[WorkerLoad, ...] = ()  # healthy workers serving the model
    queued: int = 0  # the gateway's admission queue for the model
    # Workers known to serve the model in any health state (not draining): the fleet as deployed,
    # which the desired count does not undercut before its first scale-in, and which, with no
    # healthy worker, makes the model "down, not idle" (no step in; module docstring).
    fleet: int = 0


@dataclass(frozen=True, slots=True)
class Signals:
    model: str
    healthy_workers: int
    queue_depth: int  # admission queue + requests waiting inside the workers
    queue_wait_p95_s: float | None  # None: no sample in the window
    ttft_p95_s: float | None
    kv_usage: float | None  # capacity-weighted mean; None without healthy workers
    kv_free_tokens: int | None  # None when a worker's cache size is unknown
    tokens_in_flight: int
    ratios: Mapping[str, float]  # what the formula used, keyed by SIGNALS
    desired_workers: int
    decision: str  # scale_out | scale_in | hold | cooldown

    @property
    def kv_headroom(self) -> float:
        """Free share of the model's KV cache; 0 without healthy workers (nothing to use)."""
        return 0.0 if self.kv_usage is None else max(0.0, 1.0 - self.kv_usage)


class InFlight:
    """One request's tokens, counted from dispatch until ``end()``; ending twice is harmless, so
    every exit path of the walk may call it."""

    __slots__ = ("_owner", "ended", "model", "started", "tokens")

    def __init__(self, owner: _ModelState, model: str, tokens: int, started: float) -> None:
        self._owner = owner
        self.model = model
        self.tokens = tokens
        self.started = started
        self.ended = False

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self._owner.tokens -= self.tokens
            self._owner.leases.pop(id(self), None)


@dataclass(slots=True)
class _ModelState:
    ttft: WindowQuantile
    wait: WindowQuantile
    leases: dict[int, InFlight] = field(default_factory=dict)
    tokens: int = 0
    desired: int | None = None
    # No scale-in step yet: `desired` follows the largest fleet seen (module docstring).
    settling: bool = True
    calm_since: float | None = None
    workers: int | None = None  # healthy workers at the last evaluation
    grew_at: float | None = None  # when that count last rose
    unserved_at: float | None = None  # the last request refused for want of a serving worker
    scale_outs: int = 0
    scale_ins: int = 0


def _kv(workers: tuple[WorkerLoad, ...]) -> tuple[float | None, int | None]:
    """(usage, free tokens): weighted by cache size when every worker reports one (a big worker
    at 50 % has more room than a small one), a plain mean otherwise."""
    if not workers:
        return None, 0
    usage = [min(1.0, max(0.0, w.kv_usage)) for w in workers]
    cap = [(w.num_blocks or 0) * (w.block_size or 0) for w in workers]
    if all(cap):
        total = sum(cap)
        free = sum(c * (1.0 - u) for c, u in zip(cap, usage, strict=True))
        return 1.0 - free / total, int(free)
    return sum(usage) / len(usage), None


class DesiredWorkers:
    """Per-model signals and the desired worker count (module docstring); pure and synchronous."""

    def __init__(
        self,
        settings: AutoscaleSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or AutoscaleSettings()
        self.clock = clock
        self._models: dict[str, _ModelState] = {}

    def configure(self, settings: AutoscaleSettings) -> None:
        """Reloaded settings apply at the next evaluation; windows keep their samples, unless
        their slot width changed (the samples are bucketed by it: those windows start over)."""
        reslot = settings.slot_s != self.settings.slot_s
        self.settings = settings
        for st in self._models.values():
            if reslot:
                st.ttft = WindowQuantile(settings.window_s, settings.slot_s)
                st.wait = WindowQuantile(settings.window_s, settings.slot_s)
            for w in (st.ttft, st.wait):
                w.window_s = settings.window_s

    def _state(self, model: str) -> _ModelState:
        st = self._models.get(model)
        if st is None:
            s = self.settings
            st = self._models[model] = _ModelState(
                WindowQuantile(s.window_s, s.slot_s), WindowQuantile(s.window_s, s.slot_s)
            )
        return st

    # -- observations (the request walk) ---------------------------------------------------------
    def observe_ttft(self, model: str, seconds: float, now: float | None = None) -> None:
        self._state(model).ttft.observe(seconds, self.clock() if now is None else now)

    def observe_queue_wait(self, model: str, seconds: float, now: float | None = None) -> None:
        """Every admitted request, 0 for the fast path: the p95 is over requests, not over the
        ones that happened to queue."""
        self._state(model).wait.observe(seconds, self.clock() if now is None else now)

    def begin(self, model: str, tokens: int, now: float | None = None) -> InFlight:
        st = self._state(model)
        tokens = max(0, int(tokens))
        lease = InFlight(st, model, tokens, self.clock() if now is None else now)
        st.leases[id(lease)] = lease
        st.tokens += tokens
        return lease

    def note_unserved(self, model: str, now: float | None = None) -> None:
        """A request for ``model`` refused because no worker serves it now: demand that neither
        the queue nor tokens in flight show (module docstring, "Refused requests are demand").
        Only for a model some worker has listed; synchronous, nothing to end."""
        st = self._state(model)
        t = self.clock() if now is None else now
        if st.unserved_at is None or t > st.unserved_at:
            st.unserved_at = t

    def tokens_in_flight(self, model: str) -> int:
        st = self._models.get(model)
        return st.tokens if st is not None else 0

    # -- evaluation (scrape time) ----------------------------------------------------------------
    def evaluate(self, loads: Mapping[str, ModelLoad], now: float | None = None) -> list[Signals]:
        """Signals for every model in ``loads``, and for no other.

        ``loads`` holds the models the gateway serves or queues for now (``fleet_loads``): one
        that is not there left the fleet (a reload removed its last worker, which then stopped
        listing it), and its series go at once. Before, it was evaluated as long as it held
        samples or requests in flight (the p95 window; a stream still running on the removed
        worker, up to ``in_flight_max_age_s``) and kept asking for its last ``desired``, its
        scale-in held off by the tokens of that stream. Its state is kept while it holds
        either, unevaluated, so a model back within the window (its only worker moved to a new
        URL, then answered) goes on where it was, and forgotten after."""
        if now is None:
            now = self.clock()
        for model in [m for m in self._models if m not in loads]:
            st = self._models[model]
            self._sweep(st, now)
            if not st.leases and not st.ttft.count(now) and not st.wait.count(now):
                del self._models[model]
        return [self._evaluate(m, self._state(m), loads[m], now) for m in sorted(loads)]

    def _sweep(self, st: _ModelState, now: float) -> None:
        horizon = now - self.settings.in_flight_max_age_s
        for lease in [x for x in st.leases.values() if x.started < horizon]:
            log.warning(
                "autoscale: %s tokens of %s never ended; dropped", lease.tokens, lease.model
            )
            lease.end()

    def _evaluate(self, model: str, st: _ModelState, load: ModelLoad, now: float) -> Signals:
        s = self.settings
        self._sweep(st, now)
        n = len(load.workers)
        if st.workers is not None and n > st.workers:
            st.grew_at = now
        st.workers = n
        kv_usage, kv_free = _kv(load.workers)
        depth = max(0, load.queued) + sum(max(0, w.waiting) for w in load.workers)

        def latency(w: WindowQuantile, target: float) -> float:
            count, p95 = w.summary(QUANTILE, now, st.grew_at)
            return 0.0 if p95 is None or count < s.min_samples else p95 / target

        ratios = {
            "ttft": latency(st.ttft, s.target_ttft_p95_s),
            "queue_wait": latency(st.wait, s.target_queue_wait_p95_s),
            "kv": 0.0 if kv_usage is None else kv_usage / s.target_kv_usage,
            "queue": depth / (s.max_queue_per_worker * n) if n else (math.inf if depth else 0.0),
        }
        r = max(ratios.values())
        # Requests refused for want of a serving worker, recently: demand nothing else shows.
        refused = st.unserved_at is not None and now - st.unserved_at < s.window_s
        demand = depth > 0 or st.tokens > 0 or r > 0 or refused
        least = max(1, s.min_workers)
        prev = st.desired
        if prev is None or st.settling:
            # Before the first scale-in: at least the fleet seen, so an evaluation that lands
            # while probes are still out or a worker is down does not ask to shrink the fleet.
            seen = max(n, load.fleet, prev or 0)
            prev = min(max(seen, s.min_workers), s.max_workers)
        desired, decision = prev, "hold"
        if r > 1.0 or (n == 0 and demand) or (refused and prev < least):
            st.calm_since = None
            if n == 0 or r <= 1.0:
                target = least
            else:
                cap = max(math.ceil(n * s.max_scale_out_factor - 1e-9), n + 1)
                target = min(math.ceil(n * r - 1e-9), cap)
            if target > prev:
                desired, decision = target, "scale_out"
        elif refused or (n == 0 and load.fleet > 0):
            # Not calm: requests are being refused, or the model's workers are all down (down,
            # not idle: nothing says the load is gone). Hold, and the cooldown starts over.
            st.calm_since = None
        elif r < s.scale_in_below and load.queued == 0:
            decision = "cooldown"
            if st.calm_since is None:
                st.calm_since = now
            elif now - st.calm_since >= s.scale_in_cooldown_s:
                step = max(s.min_workers, prev - s.scale_in_step)
                # The load, in workers at target, spread over what would be left; to zero only
                # with nothing at all to serve.
                ok = r * n / step < s.scale_in_max_projected if step else not demand
                if step < prev and ok:
                    desired, decision = step, "scale_in"
                    st.calm_since = now
        else:
            st.calm_since = None
        desired = min(max(desired, s.min_workers), s.max_workers)
        if desired > prev:
            st.scale_outs += 1
        elif desired < prev:
            st.scale_ins += 1
        if decision == "scale_in":
            st.settling = False  # the autoscaler's own count from here on
        st.desired = desired
        return Signals(
            model=model,
            healthy_workers=n,
            queue_depth=depth,
            queue_wait_p95_s=st.wait.quantile(QUANTILE, now),
            ttft_p95_s=st.ttft.quantile(QUANTILE, now),
            kv_usage=kv_usage,
            kv_free_tokens=kv_free,
            tokens_in_flight=st.tokens,
            ratios=ratios,
            desired_workers=desired,
            decision=decision,
        )

    def scale_events(self, model: str) -> tuple[int, int]:
        """(scale-outs, scale-ins) of the desired count so far, for the counters."""
        st = self._models.get(model)
        return (st.scale_outs, st.scale_ins) if st is not None else (0, 0)


def request_tokens(prompt_estimate: int, body: Mapping[str, object], max_out: int = 0) -> int:
    """Tokens a request may hold: its prompt estimate plus its output cap (the tenant cap the
    gateway applied, else the body's ``max_completion_tokens``/``max_tokens``; without any, the
    prompt alone, since vLLM's own default depends on the model's context length)."""
    out = max_out
    if out <= 0:
        for key in ("max_completion_tokens", "max_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out = v
                break
    return max(0, prompt_estimate) + max(0, out)
