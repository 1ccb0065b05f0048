"""Offline policy study: a trace x routing policies x a simulated fleet, under the virtual clock.

    .venv/bin/kvgate bench simulate --trace bench/data/traces/mooncake/synthetic_trace.jsonl \\
        --workers 8 --policies round_robin,least_loaded,prefix,kv_aware --rate-scale 2

Why offline: a policy question ("does kv_aware cut p99 TTFT on our traffic?") needs the whole trace
replayed several times, which takes hours over HTTP and seconds here. The routing is the *real*
`scoring` policy objects the gateway uses (`make_policy`, `choose`, `on_dispatch`), fed the same
kind of `WorkerView`s, and the workers are the real `workers.sim` engine; only the clock is virtual.

How a request is routed: its `RouteRequest.chain` is the chained 64-bit keys of its trace block ids
(`bench.traces.chain_keys`, `--keys trace`, the default; `block_tokens` = trace block size) or, with
`--keys gateway`, exactly what the gateway computes from the token-id prompt
(`scoring.route_key.route_request`). Views carry the engine's running/waiting/KV usage/capacity,
this runner's in-flight count and the gateway's `prefill_tokens` bookkeeping:
`Decision.prefill_tokens` is added at dispatch and removed at the request's first token, observed
exactly (the fleet below hooks the virtual clock's token delivery). The snapshot is fresh at every
decision: a real gateway's scraped numbers are up to a probe interval old, so this is the policy's
best case on load signals, and the same best case for every policy.

Several gateway replicas (`--replicas N`): arrivals are spread over N replicas at random, each
with its own policy state, learning the others' dispatches only as `--share` says (independent by
default, or what `[cluster]` shares through Redis, `--share-delay-s` late; `bench.replicas`), so
a deployment of N gateways can be predicted, and set against `bench.compare --gateways N`.

Policies run in parallel processes (`--jobs`), each on its own fleet, all seeded by `--seed`:
the same seed gives the same numbers on any machine (wall times aside).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.argtypes import count, positive
from bench.floor import floor_describe, ttft_floor
from bench.metrics import SLO, balance, dist, fmt_s, machine, tpot
from bench.paths import MOONCAKE_TRACE, out_path, shown
from bench.replicas import CLUSTER_PARTS, DEFAULT_DELAY_S, PARTS, ReplicaSync, ShareModel
from bench.traces import (
    SAMPLE_BY,
    Trace,
    TraceError,
    TraceRequest,
    cache_bound,
    chain_keys,
    check_time_scale,
    exit_on_trace_error,
    head,
    load_trace,
    prompt_token_ids,
    sample,
    scale_time,
)
from gateway.keying import route_key_now
from gateway.tokenizers import sim_token_keyer
from scoring.policy import POLICY_NAMES, make_policy
from scoring.precise import PreciseIndex
from scoring.state import RoutingState
from scoring.views import RouteRequest, RoutingOptions, Weights, WorkerView
from workers.kv_intake import PreciseSink
from workers.sim.engine import Engine, admitted_max_tokens
from workers.sim.engine_types import EngineConfig, SimRequest
from workers.sim.kv_publisher import wire_events
from workers.sim.profiles import PROFILES, TimingProfile, get_profile
from workers.sim.vclock import Arrival, FleetSnapshot, SimulationResult, VirtualFleet

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = MOONCAKE_TRACE
DEFAULT_POLICIES = "round_robin,least_loaded,prefix,kv_aware"
MODEL = "sim-llama"
DEFAULT_PRIORITY = 0.5  # a request with no tenant's priority, as the gateway gives it
PRECISE = "kv_aware_precise"  # kv_aware over the precise index fed by the engines' KV events


# ==================================================================================================
# What is simulated
# ==================================================================================================


@dataclass(slots=True, frozen=True)
class FleetSpec:
    """N identical simulated engines. Defaults: H100-80GB-like workers serving an 8B model.

    32,768 blocks of 16 tokens (~512k tokens of KV, what vLLM leaves for the cache at 0.9 GPU
    memory utilisation) hold the longest Mooncake prompts (191k tokens) but far less than its
    22M-token working set, so cache placement matters. `profile_scale` > 1 makes every step
    slower (a bigger model or a slower GPU) without refitting the curves.
    """

    workers: int = 8
    num_blocks: int = 32768
    block_size: int = 16
    profile: str = "default"
    profile_scale: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 262144

    def engine_config(self, kv_events: bool = False) -> EngineConfig:
        return EngineConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_kv_events=kv_events,
        )

    def engines(self, kv_events: bool = False) -> list[Engine]:
        config = self.engine_config(kv_events)
        profile = self.timing()
        return [Engine(config, profile) for _ in range(self.workers)]

    def servable(self, requests: Sequence[TraceRequest]) -> list[TraceRequest]:
        """The requests these workers serve, as they run them: a request the engine refuses
        (vLLM's 400: a prompt with no room for an output token in the context or the KV cache)
        is left out, and an output that does not fit is clamped as vLLM clamps `max_tokens`
        (`workers.sim.engine.admitted_max_tokens`, the engine's own rule).

        What the bounds and the TTFT floor are computed over: a refused request is in no
        policy's hit rate, and its blocks are in no cache for a later request to hit."""
        config = self.engine_config()
        out = []
        for r in requests:
            try:
                n = admitted_max_tokens(config, r.input_length, max(1, r.output_length))
            except ValueError:
                continue
            out.append(r if n >= r.output_length else replace(r, output_length=n))
        return out

    def timing(self) -> TimingProfile:
        """The workers' timing profile, scaled."""
        profile = get_profile(self.profile)
        if self.profile_scale != 1.0:
            profile = profile.with_overrides(scale=self.profile_scale)
        return profile

    def ttft_floor(self, requests: Sequence[TraceRequest]) -> list[float]:
        """Each served request's TTFT alone on one of these workers holding every block an
        earlier *served* request computed (`bench.floor`, over `servable`)."""
        return ttft_floor(
            self.servable(requests),
            self.timing(),
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_tokens=self.num_blocks * self.block_size,
            max_model_len=self.max_model_len,
        )

    @property
    def capacity_tokens(self) -> int:
        """KV tokens of the whole fleet (the pooled-cache reference's size)."""
        return self.workers * self.num_blocks * self.block_size

    def describe(self) -> str:
        scale = f" x{self.profile_scale:g}" if self.profile_scale != 1.0 else ""
        return (
            f"{self.workers} workers, profile {self.profile}{scale}, {self.num_blocks} blocks x "
            f"{self.block_size} tokens, max_num_seqs {self.max_num_seqs}, "
            f"max_num_batched_tokens {self.max_num_batched_tokens}"
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True, frozen=True)
class PolicySpec:
    """A policy name plus weight/option overrides: `kv_aware[queue=0.4;prefill_tokens_per_s=4e4]`.

    Variants of one policy side by side are how tuning findings are measured (label = as written).
    """

    name: str
    label: str
    weights: tuple[tuple[str, float], ...] = ()
    options: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(
        cls,
        text: str,
        weights: dict[str, float] | None = None,
        options: dict[str, float] | None = None,
    ) -> PolicySpec:
        text = text.strip()
        name, _, rest = text.partition("[")
        w = dict(weights or {})
        o = dict(options or {})
        wnames = {f.name for f in fields(Weights)}
        onames = {f.name for f in fields(RoutingOptions)}
        for part in filter(None, (p.strip() for p in rest.rstrip("]").split(";"))):
            k, _, v = part.partition("=")
            k = k.strip()
            if k not in wnames and k not in onames:
                raise ValueError(f"{text}: {k!r} is neither a weight nor a routing option")
            try:
                value = float(v)
            except ValueError:
                raise ValueError(f"{text}: {k} = {v.strip()!r} is not a number") from None
            (w if k in wnames else o)[k] = value
        return cls(name.strip(), text, tuple(sorted(w.items())), tuple(sorted(o.items())))

    def check(self) -> PolicySpec:
        """This spec, or ValueError when its policy name is none the simulator runs (`parse`
        takes any name, so a test can label a search; a run would fail in make_policy)."""
        if self.name not in (*POLICY_NAMES, PRECISE):
            raise ValueError(
                f"unknown routing policy {self.name!r}; known: "
                f"{', '.join([*POLICY_NAMES, PRECISE])}"
            )
        # A weight or option out of its range (`affinity_slack=nan`, `-5`, `inf`) or with no such
        # name (`--weights nosuch=1`) is refused here, as a usage error before a run or gateway
        # starts, rather than as a ValueError/TypeError/AttributeError from inside the run.
        wnames = {f.name for f in fields(Weights)}
        onames = {f.name for f in fields(RoutingOptions)}
        checks = (("a weight", self.weights, wnames), ("a routing option", self.options, onames))
        for kind, pairs, names in checks:
            for k, _ in pairs:
                if k not in names:
                    raise ValueError(
                        f"{self.label}: {k!r} is not {kind}; known: {', '.join(sorted(names))}"
                    )
        try:
            Weights(**dict(self.weights))
            self.routing_options(64, "text")
            self.routing_options(16, "trace")
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"{self.label}: {e}") from None
        return self

    def routing_options(self, trace_block: int, keys: str) -> RoutingOptions:
        """Options for the run. With trace keys one chain entry is one trace block, so the index
        sizes a worker's capacity in trace blocks (block_chars / chars_per_token = trace block)."""
        base: dict[str, Any] = {}
        if keys == "trace":
            base = {"block_chars": trace_block, "chars_per_token": 1.0}
        for k, v in self.options:
            default = getattr(RoutingOptions(), k)
            base[k] = int(v) if isinstance(default, int) and math.isfinite(v) else v
        return RoutingOptions(**base)


# ==================================================================================================
# The router adapter and the fleet
# ==================================================================================================


class PolicyRouter:
    """Adapts a scoring policy to the virtual fleet: snapshot -> WorkerViews -> choose/dispatch.

    Keeps the gateway's own per-worker bookkeeping the views need, by the gateway's own rules
    (`workers.dispatch_load`): the uncached prompt tokens of dispatched requests that have not
    produced a first token yet (`prefill_tokens`), and with several replicas the requests each
    counts in flight.

    `kv_aware_precise` is `kv_aware` over the precise index fed by the engines' own KV events
    (what the gateway does with vLLM's), drained before every decision: the events of every step
    simulated so far, so the index lags the engines exactly as it lags vLLM (blocks appear after
    their prefill step). Requests are keyed from their token ids as the gateway's token mode keys
    them, instead of by trace blocks: one key per engine block for the precise index, and the
    dense-head-and-tail chain the approximate index records dispatches under (its fill is part of
    the kv signal; leaving it out made one worker of eight a hot spot under eviction pressure).

    With `replicas` > 1, arrivals reach one of several gateway replicas at random, each with its
    own policy state (approximate index, sessions, pending dispatches, prefill bookkeeping and
    in-flight counts), as replicas behind a load balancer have; the engines' own figures (running,
    waiting, KV usage) are read by all alike (an instant scrape). With events, every replica's
    precise index is fed every engine's events. `share` says what replicas learn from each other
    and how late (`bench.replicas`: independent by default, or the `[cluster]` sync's model).
    """

    def __init__(
        self,
        spec: PolicySpec,
        requests: dict[str, TraceRequest],
        workers: int,
        seed: int,
        keys: str,
        trace_block: int,
        replicas: int = 1,
        share: ShareModel | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        precise = spec.name == PRECISE
        # Precise runs key requests as the gateway's token mode does (engine blocks), so their
        # options are the gateway's, not the trace-block ones.
        self.options = spec.routing_options(trace_block, "gateway" if precise else keys)
        self.now = 0.0
        self.names = [f"w{i}" for i in range(workers)]
        # One policy per gateway replica, each learning only from its own dispatches; with
        # events, each has its own precise index fed every engine's events (what replicas
        # subscribed to the same workers see).
        self.precises: list[PreciseIndex | None] = [
            PreciseIndex() if precise else None for _ in range(replicas)
        ]
        self.policies = [
            make_policy(
                "kv_aware" if idx is not None else spec.name,
                weights=Weights(**dict(spec.weights)) if spec.weights else None,
                options=self.options,
                rng=random.Random(seed + 7919 * r),
                state=RoutingState(self.options, idx) if idx is not None else None,
                clock=lambda: self.now,
            )
            for r, idx in enumerate(self.precises)
        ]
        # The gateway's KV-event intake, one per replica's precise index.
        self.sinks = [
            PreciseSink(idx, lambda _w: MODEL, lambda _w: self.block_size, lambda: self.now)
            for idx in self.precises
            if idx is not None
        ]
        for sink in self.sinks:
            for n in self.names:
                sink.set_live(n, True)
        self.precise = self.precises[0]
        self.policy = self.policies[0]
        self._spread = random.Random(seed ^ 0x5EED)  # which replica an arrival reaches
        self.requests = requests
        self.keys = keys
        self.index = {n: i for i, n in enumerate(self.names)}
        self.share = share or ShareModel()
        # Per replica: the prefill tokens and in-flight requests it counts on each worker, its own
        # and (shared model) the others' as delivered; and the changes still in transit.
        self.sync = ReplicaSync(replicas, self.names, self.share, self.policies)
        # One gateway counts every request, which the fleet's own count already is; several
        # count their own (plus what is shared), which needs each request's completion.
        self.track_done = replicas > 1
        self.awaiting = [0] * workers  # requests per worker still before their first token
        self.pending: dict[str, tuple[int, int, int]] = {}  # id -> (replica, worker, tokens)
        self.running: dict[str, tuple[int, int]] = {}  # id -> (replica, worker) until done
        self.reasons: Counter[str] = Counter()
        self.engines: Sequence[Engine] = ()
        # id -> (route, on_dispatch's receipt) until the first token: a refusal takes it back,
        # and the precise index hears of the prefill's end with the route
        self.learned: dict[str, tuple[RouteRequest, Any]] = {}
        self.block_size = 16
        # Token mode's keyer (precise runs): requests arrive with token-id prompts, so it
        # tokenizes nothing.
        self.keyer = sim_token_keyer() if precise else None

    @property
    def prefill(self) -> list[int]:
        """Uncached prompt tokens dispatched per worker and not yet at a first token (all
        replicas)."""
        per_replica = ([x.prefill_tokens for x in own] for own in self.sync.own)
        return [sum(col) for col in zip(*per_replica, strict=True)]

    def attach(self, engines: Sequence[Engine], block_size: int) -> None:
        self.engines = engines
        self.block_size = block_size

    def _drain_events(self) -> None:
        """Apply the KV events every engine published since the last decision, to every
        replica's index, through the gateway's own intake (workers.kv_intake.PreciseSink), in
        the types its decoder produces (workers.sim.kv_publisher.wire_events)."""
        for name, engine in zip(self.names, self.engines, strict=True):
            events = engine.take_kv_events()
            if events:
                decoded = wire_events(events)
                for sink in self.sinks:
                    sink.apply(name, decoded)

    def route_key(self, arrival: Arrival) -> RouteRequest:
        """The request's route key. With the gateway's keys (`--keys gateway`, and every
        `kv_aware_precise` run, keyed as token mode keys) it is the gateway's own keying
        (gateway.keying.route_key_now) over the body the request would arrive as: a completion
        with token-id prompt, its session in the session header; with the trace's keys, its
        block ids."""
        req = self.requests[arrival.request.request_id]
        if self.precise is not None or self.keys == "gateway":
            return route_key_now(
                needs_chain=self.policy.needs_chain,
                keyer=self.keyer,
                block_size=self.block_size,
                options=self.options,
                is_chat=False,
                data={"model": MODEL, "prompt": arrival.request.prompt_token_ids},
                model=MODEL,
                namespace="",
                session_id=req.session_id,
                tenant_priority=DEFAULT_PRIORITY,
                request_id=req.request_id,
                precise=self.precise is not None,
            )
        chain = tuple(chain_keys(req)) if self.policy.needs_chain else ()
        return RouteRequest(
            model=MODEL,
            request_id=req.request_id,
            chain=chain,
            block_tokens=float(req.block_size),
            prompt_tokens=req.input_length,
            session_id=req.session_id,
        )

    def __call__(self, arrival: Arrival, fleet: FleetSnapshot) -> int:
        self.now = now = fleet.now
        if self.precise is not None:
            self._drain_events()
        sync = self.sync
        if sync.in_transit:
            sync.deliver(now)
        r = self._spread.randrange(len(self.policies)) if len(self.policies) > 1 else 0
        policy = self.policies[r]
        seen = sync.seen[r]
        # One gateway: the fleet's count of requests in flight is this gateway's own.
        track = self.track_done
        views = [
            WorkerView(
                name=self.names[s.index],
                in_flight=seen[s.index].in_flight if track else s.in_flight,
                running=s.running,
                waiting=s.waiting,
                kv_usage=s.kv_usage,
                block_size=s.block_size,
                num_blocks=s.num_blocks,
                prefill_tokens=seen[s.index].prefill_tokens,
            )
            for s in fleet.engines
        ]
        route = self.route_key(arrival)
        decision = policy.choose(views, route)
        name = decision.worker.name
        receipt = policy.on_dispatch(name, route)
        w = self.index[name]
        self.reasons[decision.reason] += 1
        tokens = decision.prefill_tokens
        sync.dispatched(r, now, w, route, tokens, decision.worker)
        self.awaiting[w] += 1
        rid = arrival.request.request_id
        self.pending[rid] = (r, w, tokens)
        self.learned[rid] = (route, receipt)
        if self.track_done:
            self.running[rid] = (r, w)
        return w

    def first_token(self, request_id: str, now: float | None = None) -> None:
        r, w, tokens = self.pending.pop(request_id)
        sent = self.learned.pop(request_id)[0]
        route = sent if self.precise is not None else None  # the replicas' model reads it then
        self.sync.prefill_done(r, self.now if now is None else now, w, tokens, route)
        self.awaiting[w] -= 1
        if route is not None:
            self.policies[r].on_prefill_done(self.names[w], route)

    def finished(self, request_id: str, now: float) -> None:
        """A request completed (tracked with several replicas: each counts its own in flight)."""
        r, w = self.running.pop(request_id)
        self.sync.finished(r, now, w)

    def rejected(self, request_id: str, now: float) -> None:
        """The engine refused the request it was sent (too long: vLLM's 400): whatever the
        dispatch counted ends here, as a failed request's does in the gateway, and the policy
        forgets what it learned from it (``on_refused``)."""
        route, receipt = self.learned[request_id]
        r, w, _tokens = self.pending[request_id]
        self.policies[r].on_refused(self.names[w], route, receipt)
        self.first_token(request_id, now)
        if self.track_done:
            self.finished(request_id, now)


class ObservedFleet(VirtualFleet):
    """A VirtualFleet that tells the router when a request delivers its first token (and, with
    several replicas, when it completes: each replica counts its own requests in flight).

    The virtual clock has no public hook for it, so this wraps its delivery step; with one replica
    it only looks at outputs while the worker has requests before their first token (cheap on
    long decodes).
    """

    def __init__(self, engines: Sequence[Engine], router: PolicyRouter) -> None:
        super().__init__(engines, router)
        self._router = router

    def _deliver(self, w: int, now: float) -> None:
        router = self._router
        if router.track_done:
            live = self._live
            for o in self._pending[w]:
                res = live.get(o.request_id)
                if res is not None:
                    if res.first_token_time is None:
                        router.first_token(o.request_id, now)
                    if o.finished:
                        router.finished(o.request_id, now)
        elif router.awaiting[w]:
            live = self._live
            for o in self._pending[w]:
                res = live.get(o.request_id)
                if res is not None and res.first_token_time is None:
                    router.first_token(o.request_id, now)
        super()._deliver(w, now)


class _RefusedPrompt(list):
    """The prompt of a request the fleet refuses (too long for the model or the KV cache),
    without its tokens: `len()` is the request's true length, which is all the engine reads
    before it refuses it (`admitted_max_tokens`: the same 400 and reason as for the full
    prompt), while the list holds only a bounded head (for the gateway's keying, which hashes
    a bounded prefix). A 10^8-token request used to be built in full (GBs) to be refused."""

    __slots__ = ("_length",)

    def __init__(self, head: list[int], length: int) -> None:
        super().__init__(head)
        self._length = length

    def __len__(self) -> int:
        return self._length


# Tokens of a refused request's prompt that are built (for `--keys gateway`, whose keyer reads
# a bounded prefix; `RoutingOptions` hashes ~2M tokens at most): the rest are never built.
REFUSED_HEAD_TOKENS = 1 << 21


def _arrivals(
    reqs: Sequence[TraceRequest],
    progress: Callable[[int], None] | None,
    every: int = 50,
    *,
    config: EngineConfig | None = None,
    refused_head: int = 0,
) -> Iterator[Arrival]:
    """Prompts are materialised one at a time as the replay reaches them (Mooncake: 61M tokens).

    With the fleet's `config`, a request the engine will refuse (`admitted_max_tokens`: its
    prompt over `max_model_len` or the KV cache) is not built: its prompt is a `_RefusedPrompt`
    of its length holding at most `refused_head` tokens, which the engine refuses as it refuses
    the full prompt (counted in `failed` by reason), the replay going on."""
    for i, r in enumerate(reqs):
        if progress is not None and i % every == 0:
            progress(i)
        tag = r.session_id or r.tenant or None
        out = max(1, r.output_length)
        prompt: list[int] | None = None
        if config is not None and r.prompt_token_ids is None:
            try:
                admitted_max_tokens(config, r.input_length, out)
            except ValueError:
                head = min(r.input_length, refused_head)
                part = prompt_token_ids(replace(r, input_length=head)) if head else []
                prompt = _RefusedPrompt(part, r.input_length)
        if prompt is None:
            prompt = prompt_token_ids(r)
        yield Arrival(r.arrival_s, SimRequest(r.request_id, prompt, out), tag)
    if progress is not None:
        progress(len(reqs))


def simulate_policy(
    trace: Trace,
    spec: PolicySpec,
    fleet: FleetSpec,
    *,
    seed: int = 0,
    keys: str = "trace",
    slo: SLO | None = None,
    bound_rate: float | None = None,
    pooled_rate: float | None = None,
    progress: Callable[[int], None] | None = None,
    keep_samples: bool = False,
    replicas: int = 1,
    share: ShareModel | None = None,
) -> dict[str, Any]:
    """Replay `trace` through `spec` onto a fresh `fleet`; the per-policy summary (seconds).

    `replicas` gateways share the traffic at random, each with its own learned state, learning
    the others' as `share` says (independent by default; see PolicyRouter, bench.replicas)."""
    reqs = trace.requests
    if not reqs:
        raise ValueError("empty trace")
    # A request longer than the model's context or the worker's whole KV cache is refused as
    # vLLM refuses it (a 400), counted per reason in `failed`; the replay goes on.
    router = PolicyRouter(
        spec,
        {r.request_id: r for r in reqs},
        fleet.workers,
        seed,
        keys,
        trace.block_size,
        replicas=replicas,
        share=share,
    )
    engines = fleet.engines(kv_events=router.precise is not None)
    router.attach(engines, fleet.block_size)
    sim = ObservedFleet(engines, router)
    t0, c0 = time.perf_counter(), time.process_time()
    head = REFUSED_HEAD_TOKENS if router.precise is not None or keys == "gateway" else 0
    result = sim.run(_arrivals(reqs, progress, config=fleet.engine_config(), refused_head=head))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if bound_rate is None or pooled_rate is None:
        bound_rate, pooled_rate = bound_rates(reqs, fleet)
    out = summarize(result, spec, slo or SLO(), bound_rate, fleet.workers, router.reasons)
    out["pooled_bound_hit_rate"] = pooled_rate
    out["hit_vs_pooled_bound"] = out["hit_rate"] / pooled_rate if pooled_rate else None
    out.update(wall_s=round(wall, 3), cpu_s=round(cpu, 3), steps=result.num_steps)
    out["preemptions"] = sum(e.stats().num_preemptions for e in engines)
    out["replicas"] = replicas
    out["share"] = router.share.to_json(replicas)
    if keep_samples:
        out["samples"] = {
            "ttft": [r.ttft for r in result.results],
            "worker": [r.worker for r in result.results],
        }
    return out


def bound_rates(reqs: Sequence[TraceRequest], fleet: FleetSpec) -> tuple[float, float]:
    """The infinite-cache bound's and the pooled-cache reference's token hit rates over the
    requests `fleet` serves (`FleetSpec.servable`): the same request set as a policy's hit rate,
    which leaves refused requests out."""
    served = fleet.servable(reqs)
    return (
        cache_bound(served).token_hit_rate,
        cache_bound(served, fleet.capacity_tokens).token_hit_rate,
    )


def summarize(
    result: SimulationResult,
    spec: PolicySpec,
    slo: SLO,
    bound_rate: float,
    workers: int,
    reasons: Counter[str],
) -> dict[str, Any]:
    """Per-policy metrics in seconds, names as in the JSON report (see the module docstring)."""
    res = result.results
    failed = Counter(r.rejected for r in res if r.rejected is not None)
    done = [r for r in res if r.completion_time is not None]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    e2es = [r.e2e for r in done if r.e2e is not None]
    tpots = [t for r in done if (t := tpot(r.e2e, r.ttft, r.output_tokens)) is not None]
    itls = [g for r in done for g in r.itl]
    good = sum(1 for r in done if slo.met(r.ttft, tpot(r.e2e, r.ttft, r.output_tokens), r.e2e))
    # Rates are over the replay's own span, first arrival to last completion: a trace (or a
    # window sample, which keeps its times) that starts late has served nothing before it.
    span = max(result.span, 1e-9)
    per_worker = [0] * workers
    prefill_per_worker = [0] * workers
    for r in res:
        per_worker[r.worker] += 1
        prefill_per_worker[r.worker] += r.prompt_tokens - r.cached_tokens
    prompt = sum(r.prompt_tokens for r in res)
    cached = sum(r.cached_tokens for r in res)
    hit = cached / prompt if prompt else 0.0
    return {
        "policy": spec.label,
        "base_policy": spec.name,
        "weights": dict(spec.weights),
        "options": dict(spec.options),
        "requests": len(res),
        "completed": len(done),
        "failed": sum(failed.values()),
        "failed_by_reason": dict(sorted(failed.items())),
        "hit_rate": hit,
        "bound_hit_rate": bound_rate,
        "hit_vs_bound": hit / bound_rate if bound_rate else None,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "ttft": dist(ttfts),
        "tpot": dist(tpots),
        "itl": dist(itls),
        "e2e": dist(e2es),
        "goodput": {
            "slo": slo.to_json(),
            "requests_s": good / span,
            "fraction": good / len(res) if res else 0.0,
        },
        "throughput": {
            "requests_s": len(done) / span,
            "output_tokens_s": sum(r.output_tokens for r in done) / span,
            "prompt_tokens_s": prompt / span,
        },
        "duration_s": result.duration,
        "span_s": result.span,
        "load": {
            "requests_per_worker": per_worker,
            "requests_max_over_mean": balance(per_worker),
            "prefill_tokens_per_worker": prefill_per_worker,
            "prefill_max_over_mean": balance(prefill_per_worker),
        },
        "preempted_requests": sum(1 for r in res if r.preempted),
        "reasons": dict(sorted(reasons.items())),
    }


# ==================================================================================================
# Running several policies (and rates) in parallel processes
# ==================================================================================================


@dataclass(slots=True, frozen=True)
class SimTask:
    """One simulation: a policy at a time scale of the (already sampled) base trace."""

    spec: PolicySpec
    time_scale: float = 1.0
    label: str = ""
    seed: int | None = None  # tie-break and replica-spread seed; None = the run's


@dataclass(slots=True)
class RunContext:
    trace: Trace
    fleet: FleetSpec
    seed: int = 0
    keys: str = "trace"
    slo: SLO = field(default_factory=SLO)
    bound_rate: float | None = None
    pooled_rate: float | None = None
    keep_samples: bool = False
    replicas: int = 1
    share: ShareModel = field(default_factory=ShareModel)


_CTX: RunContext | None = None  # inherited by forked children: the trace is never pickled


def _run_task(ctx: RunContext, task: SimTask, progress: Callable[[int], None] | None) -> dict:
    trace = scale_time(ctx.trace, task.time_scale)
    out = simulate_policy(
        trace,
        task.spec,
        ctx.fleet,
        seed=ctx.seed if task.seed is None else task.seed,
        keys=ctx.keys,
        slo=ctx.slo,
        bound_rate=ctx.bound_rate,
        pooled_rate=ctx.pooled_rate,
        progress=progress,
        keep_samples=ctx.keep_samples,
        replicas=ctx.replicas,
        share=ctx.share,
    )
    out["time_scale"] = task.time_scale
    return out


def _child(i: int, task: SimTask, q: Any) -> None:
    assert _CTX is not None
    try:
        out = _run_task(_CTX, task, lambda n: q.put(("progress", i, n)))
        q.put(("done", i, out))
    except BaseException:  # reported to the parent, which raises
        q.put(("error", i, traceback.format_exc()))


def run_tasks(
    ctx: RunContext,
    tasks: Sequence[SimTask],
    jobs: int | None = None,
    show_progress: bool = True,
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Run every task, `jobs` processes at a time (forked: children inherit the trace), with one
    progress bar per task; results in task order. `jobs=1` runs in this process."""
    global _CTX
    n = len(ctx.trace.requests)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    results: list[dict[str, Any] | None] = [None] * len(tasks)
    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show_progress,
        transient=False,
    )
    with progress:
        bars = [progress.add_task(t.label or t.spec.label, total=n, start=False) for t in tasks]
        if jobs == 1 or "fork" not in mp.get_all_start_methods():
            for i, t in enumerate(tasks):
                progress.start_task(bars[i])
                results[i] = _run_task(ctx, t, lambda k, b=bars[i]: progress.update(b, completed=k))
            return [r for r in results if r is not None]
        fork = mp.get_context("fork")
        q = fork.Queue()
        _CTX = ctx
        procs: dict[int, Any] = {}
        todo = list(range(len(tasks)))
        try:
            while todo or procs:
                while todo and len(procs) < jobs:
                    i = todo.pop(0)
                    p = fork.Process(target=_child, args=(i, tasks[i], q), daemon=True)
                    p.start()
                    procs[i] = p
                    progress.start_task(bars[i])
                try:
                    kind, i, payload = q.get(timeout=0.5)
                except queue.Empty:
                    dead = [i for i, p in procs.items() if p.exitcode not in (0, None)]
                    if dead:
                        code = procs[dead[0]].exitcode
                        raise RuntimeError(
                            f"simulation {tasks[dead[0]].spec.label} died: {code}"
                        ) from None
                    continue
                if kind == "progress":
                    progress.update(bars[i], completed=payload)
                elif kind == "done":
                    results[i] = payload
                    progress.update(bars[i], completed=n)
                    procs.pop(i).join()
                else:
                    raise RuntimeError(f"simulation {tasks[i].spec.label} failed:\n{payload}")
        finally:
            for p in procs.values():
                p.kill()
            _CTX = None
    return [r for r in results if r is not None]


# ==================================================================================================
# Report
# ==================================================================================================


def report_console() -> Console:
    """A console wide enough for the tables when the output is a file or a pipe (rich's default
    there is 80 columns, which folds every number)."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def report_table(report: dict[str, Any], wide: bool = False) -> Table:
    """One table, one row per policy, with what a reviewer needs to judge the numbers.

    The default columns fit a 100-column terminal; `wide` adds every other figure (all of them
    are in the JSON report either way)."""
    cols = [c for c in REPORT_COLUMNS if wide or not c[1]]
    tr, fl = report["trace"], report["fleet"]
    caption = (
        f"trace {tr['describe']} | time scale x{report['time_scale']:g} | fleet "
        f"{report['fleet_describe']} | keys {report['keys']} | gateway replicas "
        f"{replicas_caption(report)} | {seeds_caption(report)} | "
        f"goodput SLO {report['slo_describe']} | bound (infinite cache) "
        f"{tr['bound']['token_hit_rate']:.1%} of prompt tokens, "
        f"{tr['bound']['block_hit_rate']:.1%} of blocks{bound_granularity(report)}; pooled "
        "fleet cache (LRU, "
        f"{report['fleet']['workers']} x {report['fleet']['num_blocks']} blocks) "
        f"{tr['pooled_bound']['token_hit_rate']:.1%} | TTFT floor (each request alone, "
        f"infinite cache) {floor_describe(tr)} | machine "
        f"{report['machine']['cpu']} x{report['machine']['cores']} | seconds unless stated"
    )
    t = Table(
        title=f"virtual-clock simulation, {fl['workers']} workers"
        + (
            f", {report['replicas']} gateway replicas: {report['share']['label']}"
            if report.get("replicas", 1) > 1 and report.get("share")
            else ""
        ),
        caption=caption,
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    for i, (header, _, _) in enumerate(cols):
        add_number_column(t, header, left=i == 0)
    for p in report["policies"]:
        t.add_row(*(cell(p) for _, _, cell in cols))
    return t


def bound_granularity(report: dict[str, Any]) -> str:
    """Why `/bound` can pass 1, when it can: the bounds count hits in whole trace blocks (the
    only equality a trace records), capped at `input_length - 1` tokens, so a request's last
    trace block never hits; workers caching smaller blocks hit most of it. On 512-token blocks
    a repeated short prompt hits ~2x its bound."""
    tb, fb = report["trace"].get("block_size"), report["fleet"].get("block_size")
    if not tb or not fb or tb <= fb:
        return ""
    return (
        f" (counted in {tb}-token trace blocks: workers caching {fb}-token blocks can pass it, "
        "/bound > 1)"
    )


def seeds_caption(report: dict[str, Any]) -> str:
    seeds = report.get("seeds")
    if not seeds:
        return f"seed {report['seed']}"
    return f"seeds {seeds[0]}-{seeds[-1]}: medians"


def replicas_caption(report: dict[str, Any]) -> str:
    """`4 (shared all, 0.1 s late)`: how many gateways the run modelled, and what they knew."""
    n = report.get("replicas", 1)
    share = report.get("share")
    return f"{n} ({share['label']})" if n > 1 and share else str(n)


LABEL_MIN_WIDTH = 8


def add_number_column(t: Table, header: str, left: bool = False) -> None:
    """A column whose numbers are never cut to `0.…`.

    rich's default overflow ("ellipsis") hides every digit once a table is wider than the
    terminal, which is worse than no table. Number columns are `no_wrap`, so rich never narrows
    them to fit; only the `left` label column gives way, folding onto more lines. `print_table`
    makes sure that is always enough."""
    t.add_column(header, justify="left" if left else "right", no_wrap=not left, overflow="fold")


def print_table(console: Console, table: Table) -> None:
    """Print `table` with every number whole, in a terminal of any width.

    A table that fits (the default report columns fit 100 columns) prints as is; a long policy
    label folds. A table that does not fit even with its label folded to `LABEL_MIN_WIDTH`
    (`--wide` in a narrow terminal) is printed at its full width and left to the terminal (or
    `less -S`) to wrap, since squeezing it further would make rich crop numbers."""
    unbounded = console.options.update_width(1 << 16)  # measure() is capped at the console's
    full = Measurement.get(console, unbounded, table).maximum
    need = full
    if table.columns:
        label = table.columns[0]
        label_width = max(
            Measurement.get(console, unbounded, c).maximum for c in [label.header, *label.cells]
        )
        need -= max(0, label_width - LABEL_MIN_WIDTH)
    if need <= console.width:
        console.print(table)
        return
    Console(
        file=console.file,
        width=full,
        force_terminal=console.is_terminal,
        color_system=console.color_system,  # type: ignore[arg-type]
    ).print(table)


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratio(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "-"


Cell = Callable[[dict[str, Any]], str]

# (header, wide only, cell): the default set fits a 100-column terminal with a 16-character policy
# label (`kv_aware_precise`); `--wide` adds the rest (~150 columns).
REPORT_COLUMNS: tuple[tuple[str, bool, Cell], ...] = (
    ("policy", False, lambda p: escape(p["policy"])),
    ("hit rate", False, lambda p: f"{p['hit_rate']:.1%}"),
    ("/bound", False, lambda p: _ratio(p["hit_vs_bound"])),
    ("/pooled", True, lambda p: _ratio(p.get("hit_vs_pooled_bound"))),
    ("TTFT\nmean", True, lambda p: fmt_s(p["ttft"]["mean"])),
    ("TTFT\np50", False, lambda p: fmt_s(p["ttft"]["p50"])),
    ("TTFT\np90", False, lambda p: fmt_s(p["ttft"]["p90"])),
    ("TTFT\np99", False, lambda p: fmt_s(p["ttft"]["p99"])),
    ("p99\n/floor", True, lambda p: _ratio(p.get("ttft_p99_vs_floor"))),
    ("TPOT\np50", True, lambda p: fmt_s(p["tpot"]["p50"], 4)),
    ("TPOT\np99", False, lambda p: fmt_s(p["tpot"]["p99"], 4)),
    ("ITL\np99", True, lambda p: fmt_s(p["itl"]["p99"], 4)),
    ("E2E\np50", True, lambda p: fmt_s(p["e2e"]["p50"], 2)),
    ("E2E\np99", False, lambda p: fmt_s(p["e2e"]["p99"], 2)),
    ("goodput", False, lambda p: f"{p['goodput']['fraction']:.1%}"),
    ("req/s", False, lambda p: f"{p['throughput']['requests_s']:.2f}"),
    ("out\ntok/s", True, lambda p: f"{p['throughput']['output_tokens_s']:.0f}"),
    (
        "load max/mean\nreqs/prefill",
        True,
        lambda p: (
            f"{p['load']['requests_max_over_mean']:.2f}/{p['load']['prefill_max_over_mean']:.2f}"
        ),
    ),
    ("pre-\nempted", False, lambda p: str(p["preempted_requests"])),
)


def reasons_table(report: dict[str, Any]) -> Table | None:
    rows = [(p["policy"], p["reasons"]) for p in report["policies"] if len(p["reasons"]) > 1]
    if not rows:
        return None
    names = sorted({k for _, r in rows for k in r})
    t = Table(title="routing decisions by reason (Decision.reason)", box=box.SIMPLE_HEAD)
    for i, header in enumerate(["policy", *names]):
        add_number_column(t, header, left=i == 0)
    for label, r in rows:
        t.add_row(escape(label), *(str(r.get(n, 0)) for n in names))
    return t


# ==================================================================================================
# CLI
# ==================================================================================================


def _kv(text: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        k, _, v = part.partition("=")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise ValueError(f"{k.strip()} = {v.strip()!r} is not a number") from None
    return out


def split_policies(text: str) -> list[str]:
    """Split `a,b[x=1;y=2],c` on the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    out.append(cur)
    return [p.strip() for p in out if p.strip()]


def add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace")
    g.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        help="trace file/dir or synthetic:k=v,... (default: the Mooncake sample, %(default)s)",
    )
    g.add_argument("--format", default=None, help="skip format detection")
    g.add_argument("--sample", type=positive, default=None, help="fraction (<=1) or count (>1)")
    g.add_argument("--sample-by", default="auto", choices=SAMPLE_BY)
    g.add_argument("--limit", type=count, default=None, help="keep only the first N requests")
    g.add_argument("--seed", type=int, default=0, help="sampling and tie-break seed")


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet")
    d = FleetSpec()
    # Typed, so a fleet no engine can be built from (0 workers, 0 blocks, an unknown profile, a
    # zero step time) is a usage error before the trace loads, not a traceback from a worker
    # process (or, for --profile-scale 0, a run reporting every latency as 0).
    g.add_argument("--workers", type=count, default=d.workers)
    g.add_argument("--num-blocks", type=count, default=d.num_blocks, help="KV blocks per worker")
    g.add_argument("--block-size", type=count, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--profile",
        default=d.profile,
        choices=sorted(PROFILES),
        help="timing profile (workers/sim/profiles)",
    )
    g.add_argument("--profile-scale", type=positive, default=1.0, help="x step time (slower GPU)")
    g.add_argument("--max-num-seqs", type=count, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=count, default=d.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=count, default=d.max_model_len)


def add_policy_args(p: argparse.ArgumentParser, default: str = DEFAULT_POLICIES) -> None:
    g = p.add_argument_group("routing")
    g.add_argument(
        "--policies",
        default=default,
        help=f"comma-separated, of {', '.join([*POLICY_NAMES, PRECISE])} (KV events); a variant "
        "carries overrides: kv_aware[queue=0.4;affinity_slack=2]",
    )
    g.add_argument("--weights", default=None, help="kv_aware weights for every policy: k=v,...")
    g.add_argument("--options", default=None, help="RoutingOptions for every policy: k=v,...")
    g.add_argument(
        "--keys",
        choices=["trace", "gateway"],
        default="trace",
        help="route on trace block ids (default) or on the gateway's own hash of the prompt",
    )
    g.add_argument("--slo-ttft", type=positive, default=2.0, help="goodput SLO on TTFT (s)")
    g.add_argument("--slo-tpot", type=positive, default=0.1, help="goodput SLO on TPOT (s)")
    g.add_argument("--slo-e2e", type=positive, default=None, help="goodput SLO on E2E (s)")
    g.add_argument("--jobs", type=int, default=None, help="parallel processes (default: cores)")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway replicas")
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="gateway replicas sharing the traffic at random, each learning from its own "
        "dispatches (kv_aware_precise: each also fed every worker's KV events)",
    )
    g.add_argument(
        "--share",
        default="none",
        metavar="PARTS",
        help="what replicas learn from each other: none (independent, the default), all (what "
        f"[cluster] shares through Redis: {','.join(CLUSTER_PARTS)}), or some of "
        f"{','.join(PARTS)} (pending: the precise index's pending dispatches)",
    )
    g.add_argument(
        "--share-delay-s",
        type=float,
        default=None,
        metavar="S",
        help="virtual seconds until a change reaches the other replicas (default "
        f"{DEFAULT_DELAY_S:g}: two 50 ms sync intervals, the cluster's staleness target)",
    )


def share_from_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> ShareModel:
    """The replica model the flags name; a delay without anything shared is a usage error (it
    would silently do nothing)."""
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    delay = DEFAULT_DELAY_S if args.share_delay_s is None else args.share_delay_s
    try:
        share = ShareModel.parse(args.share, delay)
    except ValueError as e:
        p.error(f"--share/--share-delay-s: {e}")
    if args.share_delay_s is not None and share.independent:
        p.error("--share-delay-s needs --share (all, or some of load,index,sessions,pending)")
    return share


def trace_from_args(args: argparse.Namespace, prog: str | None = None) -> Trace:
    """The trace the flags name; with `prog`, a trace that cannot be used (unreadable, a
    malformed record, a bad generator spec, no request at all, a bad sample) ends the program
    with one line on stderr (exit 2) rather than a traceback; without, it is a `TraceError`."""
    try:
        trace = load_trace(args.trace, args.format)
        if not trace.requests:
            raise TraceError(f"{args.trace}: the trace has no request")
        if args.limit is not None:
            trace = head(trace, args.limit)
        if args.sample is not None:
            try:
                trace = sample(trace, args.sample, args.seed, by=args.sample_by)
            except ValueError as e:
                raise TraceError(f"--sample: {e}") from e
    except TraceError as e:
        if prog is None:
            raise
        exit_on_trace_error(prog, e)
    return trace


def fleet_from_args(args: argparse.Namespace) -> FleetSpec:
    return FleetSpec(
        workers=args.workers,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        profile=args.profile,
        profile_scale=args.profile_scale,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )


def specs_from_args(
    args: argparse.Namespace, p: argparse.ArgumentParser | None = None
) -> list[PolicySpec]:
    """The policies the flags name, checked before anything runs (an unknown name or option is
    a usage error with `p`, exit 2, rather than a traceback from a worker process)."""
    try:
        w, o = _kv(args.weights), _kv(args.options)
        specs = [PolicySpec.parse(s, w, o).check() for s in split_policies(args.policies)]
        if not specs:
            raise ValueError("no policy given")
    except ValueError as e:
        if p is None:
            raise
        p.error(f"--policies/--weights/--options: {e}")
    return specs


def slo_from_args(args: argparse.Namespace) -> SLO:
    return SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e)


def over_seeds(runs: list[dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """One policy over several seeds: every figure the table prints is the median over seeds
    (hit rates, the distributions, goodput, throughput, pre-emptions, load balance, decision
    reasons; `spread` holds the (min, max) of p99 TTFT, hit rate and goodput, `per_seed` each
    seed's headline figures. Lists (per-worker counts) and the wall times stay the first
    seed's. The request set is the same for every seed, so completed/failed are too. One run:
    unchanged."""
    if len(runs) == 1:
        return runs[0]
    out = copy.deepcopy(runs[0])

    def med(get: Callable[[dict[str, Any]], Any]) -> float | None:
        vals = [v for r in runs if (v := get(r)) is not None]
        return statistics.median(vals) if vals else None

    for key in ("hit_rate", "hit_vs_bound", "hit_vs_pooled_bound"):
        out[key] = med(lambda r, k=key: r.get(k))
    for dist_key in ("ttft", "tpot", "e2e", "itl"):
        out[dist_key] = {q: med(lambda r, d=dist_key, q=q: r[d].get(q)) for q in runs[0][dist_key]}
    out["goodput"] = {
        **runs[0]["goodput"],
        "fraction": med(lambda r: r["goodput"]["fraction"]),
        "requests_s": med(lambda r: r["goodput"]["requests_s"]),
    }
    out["throughput"] = {k: med(lambda r, k=k: r["throughput"][k]) for k in runs[0]["throughput"]}
    for key in ("preempted_requests", "preemptions", "duration_s", "span_s"):
        if key in runs[0]:
            out[key] = med(lambda r, k=key: r.get(k))
    for key in ("requests_max_over_mean", "prefill_max_over_mean"):
        out["load"][key] = med(lambda r, k=key: r["load"][k])
    names = sorted({k for r in runs for k in r.get("reasons", {})})
    out["reasons"] = {k: med(lambda r, k=k: r.get("reasons", {}).get(k, 0)) for k in names}

    def span(get: Callable[[dict[str, Any]], Any]) -> list[float]:
        vals = [v for r in runs if (v := get(r)) is not None]
        return [min(vals), max(vals)] if vals else []

    out["spread"] = {
        "ttft_p99": span(lambda r: r["ttft"]["p99"]),
        "hit_rate": span(lambda r: r["hit_rate"]),
        "goodput": span(lambda r: r["goodput"]["fraction"]),
    }
    out["per_seed"] = [
        {
            "seed": sd,
            "hit_rate": r["hit_rate"],
            "ttft_p50": r["ttft"]["p50"],
            "ttft_p99": r["ttft"]["p99"],
            "goodput": r["goodput"]["fraction"],
            "requests_s": r["throughput"]["requests_s"],
            "preempted_requests": r["preempted_requests"],
            "requests_max_over_mean": r["load"]["requests_max_over_mean"],
        }
        for sd, r in zip(seeds, runs, strict=True)
    ]
    out["seeds"] = len(runs)
    return out


def build_report(
    ctx: RunContext, results: list[dict[str, Any]], time_scale: float, wall: float
) -> dict[str, Any]:
    served = ctx.fleet.servable(ctx.trace.requests)
    bound = cache_bound(served)
    pooled = cache_bound(served, ctx.fleet.capacity_tokens)
    floor = dist(ctx.fleet.ttft_floor(ctx.trace.requests))
    for p in results:
        p["ttft_p99_vs_floor"] = _over(p["ttft"]["p99"], floor["p99"])
    return {
        "policies": results,
        "trace": {
            **ctx.trace.meta(),
            "describe": ctx.trace.describe(),
            "bound": bound.to_json(),
            "pooled_bound": pooled.to_json(),
            "ttft_floor": floor,
        },
        "time_scale": time_scale,
        "rate_scale": 1.0 / time_scale,
        "fleet": ctx.fleet.to_json(),
        "fleet_describe": ctx.fleet.describe(),
        "keys": ctx.keys,
        "replicas": ctx.replicas,
        "share": ctx.share.to_json(ctx.replicas),
        "seed": ctx.seed,
        "slo": ctx.slo.to_json(),
        "slo_describe": ctx.slo.describe(),
        "machine": machine(),
        "wall_s": round(wall, 3),
        "units": "seconds",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench simulate", description=__doc__.split("\n")[0])
    add_trace_args(p)
    add_fleet_args(p)
    add_policy_args(p)
    add_replica_args(p)
    g = p.add_argument_group("load and output")
    g.add_argument(
        "--time-scale", type=positive, default=None, help="x arrival times (0.5 = 2x rate)"
    )
    g.add_argument(
        "--rate-scale", type=positive, default=None, help="x request rate (= 1/time-scale)"
    )
    g.add_argument(
        "--json",
        type=Path,
        default=out_path("simulate.json"),
        help="write the full report here (default: %(default)s)",
    )
    g.add_argument("--wide", action="store_true", help="every column (~150 characters wide)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="run each policy with seeds --seed.. --seed+N-1 (tie-breaks, replica spread) and "
        "report the median, with the spread of p99 TTFT, hit rate and goodput (a single seed's "
        "p99 can swing 3-15 s on ~1,300 requests)",
    )
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.time_scale is not None and args.rate_scale is not None:
        p.error("give --time-scale or --rate-scale, not both")
    share = share_from_args(args, p)
    specs = specs_from_args(args, p)
    time_scale = 1.0
    if args.time_scale is not None:
        time_scale = args.time_scale
    elif args.rate_scale is not None:
        time_scale = 1.0 / args.rate_scale
    console = report_console()
    t0 = time.perf_counter()
    trace = trace_from_args(args, p.prog)
    try:  # checked here: in a forked run it would be a traceback per policy
        check_time_scale(trace, time_scale)
    except ValueError as e:
        p.error(f"--time-scale/--rate-scale: {e}")
    ctx = RunContext(
        trace=trace,
        fleet=fleet_from_args(args),
        seed=args.seed,
        keys=args.keys,
        slo=slo_from_args(args),
        replicas=args.replicas,
        share=share,
    )
    ctx.bound_rate, ctx.pooled_rate = bound_rates(trace.requests, ctx.fleet)
    seeds = [args.seed + k for k in range(args.seeds)]
    tasks = [
        SimTask(spec, time_scale, f"{spec.label} seed {sd}" if args.seeds > 1 else "", sd)
        for spec in specs
        for sd in seeds
    ]
    runs = run_tasks(ctx, tasks, args.jobs, not args.quiet, console)
    n = len(seeds)
    results = [over_seeds(runs[i * n : (i + 1) * n], seeds) for i in range(len(specs))]
    report = build_report(ctx, results, time_scale, time.perf_counter() - t0)
    if n > 1:
        report["seeds"] = seeds
    print_table(console, report_table(report, args.wide))
    for pol in report["policies"]:
        sp = pol.get("spread")
        if sp and sp["ttft_p99"]:
            console.print(
                f"{pol['policy']} over {pol['seeds']} seeds: TTFT p99 {sp['ttft_p99'][0]:.2f}-"
                f"{sp['ttft_p99'][1]:.2f} s, hit rate {sp['hit_rate'][0]:.1%}-"
                f"{sp['hit_rate'][1]:.1%}, goodput {sp['goodput'][0]:.1%}-{sp['goodput'][1]:.1%}",
                markup=False,
            )
        if pol["failed"]:
            why = ", ".join(f"{k} {v}" for k, v in pol["failed_by_reason"].items())
            console.print(
                f"{pol['policy']}: {pol['failed']} requests refused as vLLM refuses them (400): "
                f"{why}",
                markup=False,
            )
    rt = reasons_table(report)
    if rt is not None:
        print_table(console, rt)
    console.print(f"total wall time {report['wall_s']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {shown(args.json)}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
