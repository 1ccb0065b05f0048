"""The virtual clock: a discrete-event simulation of a fleet of engines behind a router.

Time jumps from event to event (arrivals, step completions) instead of passing, so a whole
production trace replays in seconds. Each engine runs the same `Engine.step` as the real-time
server; only the clock differs. A step's outputs become visible at its end, and the next step of
that engine starts there, after any arrivals at the same instant (so a request arriving exactly at
a step boundary is admitted into that next step, as it would be on a real server).

Engines interact only through routing, which happens at arrivals, so instead of one global heap of
step events each engine is advanced through its own steps up to the next arrival (step ends at
that instant included, step starts excluded). The order of events is the same as a global heap
would give, per engine and relative to arrivals, at a fraction of the cost per step.

The router sees a `FleetSnapshot` at each arrival: the engines' scheduler state (what a gateway
would scrape from /metrics, but exact and fresh) plus what the runner itself has sent to each
worker and not yet seen finish (what a gateway tracks for free).

Arrivals are consumed lazily from any time-ordered iterable, so a trace whose prompts would not
fit in memory all at once (Mooncake: 61M prompt tokens) replays with only the live requests held.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from workers.sim.engine import Engine
from workers.sim.engine_types import RequestOutput, SimRequest


@dataclass(slots=True)
class Arrival:
    time: float  # seconds from the start of the run
    request: SimRequest
    tag: str | None = None  # tenant or session: passed through to the router and the results


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    index: int
    running: int
    waiting: int
    kv_usage: float
    block_size: int
    num_blocks: int
    in_flight: int  # sent by this runner and not finished yet
    sent: int  # sent by this runner in total


@dataclass(slots=True, frozen=True)
class FleetSnapshot:
    now: float
    engines: tuple[EngineSnapshot, ...]


Router = Callable[[Arrival, FleetSnapshot], int]


@dataclass(slots=True)
class RequestResult:
    request_id: str
    worker: int
    arrival: float
    tag: str | None = None
    first_token_time: float | None = None
    completion_time: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    preempted: int = 0
    finish_reason: str | None = None
    itl: list[float] = field(default_factory=list)  # gaps between consecutive token deliveries
    # Refused at admission as vLLM's front end refuses it (a 400): `rejection_reason` of the
    # engine's message. Such a request never ran: no first token, no completion.
    rejected: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.completion_time is None else self.completion_time - self.arrival


@dataclass(slots=True)
class SimulationResult:
    results: list[RequestResult]  # in arrival order
    duration: float  # virtual time of the last completion (seconds from the clock's 0)
    num_steps: int
    engines: list[Engine]
    start: float = 0.0  # virtual time of the first arrival

    @property
    def span(self) -> float:
        """Seconds from the first arrival to the last completion: what the fleet was busy
        replaying (0 when nothing completed). Rates divide by this, not by `duration`, which
        also counts the time before the first arrival."""
        return max(0.0, self.duration - self.start)

    @property
    def hit_rate(self) -> float:
        """Fleet prefix-cache hit rate in prompt tokens (cached / prompt), vLLM's definition."""
        prompt = sum(r.prompt_tokens for r in self.results)
        return sum(r.cached_tokens for r in self.results) / prompt if prompt else 0.0


def rejection_reason(message: str) -> str:
    """A short name for why the engine refused a request (its 400's message)."""
    if "maximum context length" in message:
        return "context_length"
    if "KV cache" in message:
        return "exceeds_kv_cache"
    return "invalid_request"


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100); NaN when empty. The one
    percentile definition of the simulator and every bench tool (`bench.metrics`)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values; NaN for no values."""
    return nearest_rank(sorted(values), q)


class VirtualFleet:
    """Replays arrivals through a router onto N engines under virtual time."""

    def __init__(self, engines: Sequence[Engine], route: Router) -> None:
        if not engines:
            raise ValueError("need at least one engine")
        self.engines = list(engines)
        self.route = route
        self._in_flight = [0] * len(self.engines)
        self._sent = [0] * len(self.engines)

    def snapshot(self, now: float) -> FleetSnapshot:
        engines = tuple(
            EngineSnapshot(
                index=i,
                running=e.num_running,
                waiting=e.num_waiting,
                kv_usage=e.kv_usage,
                block_size=e.config.block_size,
                num_blocks=e.config.num_blocks,
                in_flight=self._in_flight[i],
                sent=self._sent[i],
            )
            for i, e in enumerate(self.engines)
        )
        return FleetSnapshot(now, engines)

    def run(self, arrivals: Iterable[Arrival]) -> SimulationResult:
        engines = self.engines
        n = len(engines)
        self._results: list[RequestResult] = []
        self._live: dict[str, RequestResult] = {}
        self._last_token: dict[str, float] = {}
        self._num_steps = 0
        self._end_time = 0.0
        # Per engine: when its step in flight ends (and that step's outputs), or when it may start
        # its next step; both None when idle.
        self._step_end: list[float | None] = [None] * n
        self._pending: list[list[RequestOutput]] = [[] for _ in range(n)]
        self._ready_at: list[float | None] = [None] * n

        last = -math.inf
        start: float | None = None
        for a in arrivals:
            now = a.time
            if now < last:
                raise ValueError("arrivals must be in non-decreasing time order")
            last = now
            if start is None:
                start = now
            for w in range(n):
                self._advance(w, now)
            w = self.route(a, self.snapshot(now))
            if not 0 <= w < n:
                raise ValueError(f"router chose worker {w} of {n}")
            req = a.request
            res = RequestResult(
                req.request_id, w, now, a.tag, prompt_tokens=len(req.prompt_token_ids)
            )
            self._results.append(res)
            try:
                engines[w].add_request(req, now)
            except ValueError as e:  # what vLLM answers with a 400: counted, and the replay goes on
                res.rejected = rejection_reason(str(e))
                res.prompt_tokens = 0  # never prefilled: not part of the hit rate's denominator
                on_reject = getattr(self.route, "rejected", None)
                if on_reject is not None:
                    on_reject(req.request_id, now)
                continue
            self._live[req.request_id] = res
            self._in_flight[w] += 1
            self._sent[w] += 1
            if self._step_end[w] is None and self._ready_at[w] is None:
                self._ready_at[w] = now  # starts after every arrival at this same instant
        for w in range(n):
            self._advance(w, math.inf)
        return SimulationResult(
            self._results, self._end_time, self._num_steps, engines, 0.0 if start is None else start
        )

    def _advance(self, w: int, until: float) -> None:
        """Run engine w through every event before `until` (step ends at `until` included).

        Engines only interact through routing, which happens at arrivals, so each can run its
        steps back to back up to the next arrival: events stay in time order per engine and
        relative to arrivals, without a global heap of step events.
        """
        engine = self.engines[w]
        ready = self._ready_at[w]
        end = self._step_end[w]
        while True:
            if ready is not None:
                if ready >= until:
                    break
                out = engine.step(ready)
                self._num_steps += 1
                self._pending[w] = out.outputs
                end = ready + out.duration
                ready = None
            elif end is not None:
                if end > until:
                    break
                self._deliver(w, end)
                ready = end if engine.has_work() else None
                end = None
            else:
                break
        self._ready_at[w] = ready
        self._step_end[w] = end

    def _deliver(self, w: int, now: float) -> None:
        live = self._live
        last_token = self._last_token
        for o in self._pending[w]:
            rid = o.request_id
            res = live[rid]
            if res.first_token_time is None:
                res.first_token_time = now
                res.cached_tokens = o.num_cached_tokens
            else:
                res.itl.append(now - last_token[rid])
            last_token[rid] = now
            res.output_tokens += len(o.new_token_ids)
            if o.finished:
                res.completion_time = now
                res.finish_reason = o.finish_reason
                res.preempted = o.num_preemptions
                del live[rid]
                del last_token[rid]
                self._in_flight[w] -= 1
                if now > self._end_time:
                    self._end_time = now
        self._pending[w] = []


def simulate(
    engines: Sequence[Engine], arrivals: Iterable[Arrival], route: Router
) -> SimulationResult:
    """One-shot convenience wrapper around `VirtualFleet(engines, route).run(arrivals)`."""
    return VirtualFleet(engines, route).run(arrivals)


def round_robin() -> Router:
    """The simplest router, for tests and baselines: ignore the snapshot, rotate."""
    counter = 0

    def route(arrival: Arrival, fleet: FleetSnapshot) -> int:
        nonlocal counter
        w = counter % len(fleet.engines)
        counter += 1
        return w

    return route
