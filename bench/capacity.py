"""Capacity search: the highest request rate a fleet sustains within latency SLOs, per policy.

    .venv/bin/kvgate bench capacity --trace bench/data/traces/mooncake/synthetic_trace.jsonl \\
        --workers 8 --policies round_robin,kv_aware --slo-ttft-p95 2 --slo-tpot-p95 0.1

The "validate capacity before launch" job: keep the trace's shape (lengths, prefix sharing,
burstiness) and compress or stretch its arrival times until the SLOs just hold. For each policy,
a bounded search over the rate scale (x arrival rate): double or halve from 1 until the answer is
bracketed, then bisect in log space for `--iterations` steps (4 give ~4% precision), each probe one
offline simulation (`bench.simulate`, virtual clock, real scoring policies); all policies' probes of
a round run in parallel processes. A probe passes when every request finished and every SLO
percentile holds (a request the fleet refuses, vLLM's 400 for a prompt too long for the context,
fails at every rate: it is left out and stated, not counted against the rate). Latency is not
always monotone in load (cache placement shifts with timing), so
the answer is the highest *passing* rate probed below the lowest failing one. A policy that
passes every probe up to `--max-scale` has no failing rate: its answer is that ceiling, stated as
"at least" (`at_least` in the JSON), since the fleet may hold far more.

Outputs one line per answer, the rate-vs-latency curve (PNG: every probe, SLO lines) and a JSON
with every probe's full summary.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.argtypes import positive
from bench.metrics import SLO, fmt_s, machine
from bench.paths import out_path, shown
from bench.simulate import (
    FleetSpec,
    PolicySpec,
    RunContext,
    SimTask,
    add_fleet_args,
    add_policy_args,
    add_trace_args,
    bound_rates,
    fleet_from_args,
    report_console,
    run_tasks,
    specs_from_args,
    trace_from_args,
)
from bench.traces import Trace, TraceError, exit_on_trace_error, mean_rate

METRICS = ("ttft", "tpot", "itl", "e2e")
MAX_SCALE_LIMIT = 2.0**30  # a billion times the trace's rate; past ~2^1023 a doubling overflows
QUANTS = ("p50", "p90", "p95", "p99")


@dataclass(slots=True, frozen=True)
class Objective:
    """One SLO percentile: `metric` (ttft/tpot/itl/e2e) at `quantile` (p95) <= `limit_s`."""

    metric: str
    quantile: str
    limit_s: float

    def value(self, summary: dict[str, Any]) -> float | None:
        return summary[self.metric][self.quantile]

    def describe(self) -> str:
        return f"{self.metric.upper()} {self.quantile} <= {self.limit_s:g} s"


def passes(summary: dict[str, Any], objectives: list[Objective]) -> bool:
    """Every request the fleet serves finished and every objective holds (a missing value
    fails). A refused request (`failed`: a 400 for a prompt that does not fit, at any rate) is
    not held against the rate; the answer states how many there were."""
    if summary["completed"] < summary["requests"] - summary.get("failed", 0):
        return False
    for o in objectives:
        v = o.value(summary)
        if v is None or v > o.limit_s:
            return False
    return True


@dataclass(slots=True)
class Search:
    """Bracket-then-bisect state of one policy's search, in log2(rate scale)."""

    spec: PolicySpec
    lo: float | None = None  # highest passing log2 scale so far (below any failure)
    hi: float | None = None  # lowest failing log2 scale so far
    probes: list[dict[str, Any]] = field(default_factory=list)
    bisections: int = 0

    def next_scale(self, iterations: int, max_log2: float) -> float | None:
        """The next rate scale to probe, or None when the answer is good enough."""
        if self.lo is None and self.hi is None:
            return 1.0
        if self.hi is None:  # everything passed so far: double
            assert self.lo is not None
            return None if self.lo >= max_log2 else 2.0 ** (self.lo + 1)
        if self.lo is None:  # everything failed so far: halve
            return None if self.hi <= -max_log2 else 2.0 ** (self.hi - 1)
        if self.bisections >= iterations:
            return None
        return 2.0 ** ((self.lo + self.hi) / 2)

    def record(self, rate_scale: float, summary: dict[str, Any], ok: bool) -> None:
        """Add a probe and re-derive the bracket from all probes: `hi` is the lowest failing
        scale, `lo` the highest passing one below it (robust to a non-monotone curve)."""
        if self.lo is not None and self.hi is not None:
            self.bisections += 1
        self.probes.append({"rate_scale": rate_scale, "passed": ok, "summary": summary})
        xs = [(math.log2(p["rate_scale"]), p["passed"]) for p in self.probes]
        fails = [x for x, passed in xs if not passed]
        self.hi = min(fails) if fails else None
        good = [x for x, passed in xs if passed and (self.hi is None or x < self.hi)]
        self.lo = max(good) if good else None

    @property
    def answer_scale(self) -> float | None:
        return None if self.lo is None else 2.0**self.lo

    @property
    def at_least(self) -> bool:
        """The answer is a lower bound: every probe passed, up to the search's ceiling
        (`--max-scale`), so the fleet holds at least that rate and maybe far more."""
        return self.lo is not None and self.hi is None


def run_search(
    ctx: RunContext,
    specs: list[PolicySpec],
    objectives: list[Objective],
    *,
    iterations: int = 4,
    max_log2: float = 6.0,
    jobs: int | None = None,
    log: Any = print,
) -> list[Search]:
    """Search every policy at once, one round of parallel probes at a time."""
    searches = [Search(s) for s in specs]
    base_rate = _base_rate(ctx)
    rnd = 0
    while True:
        todo = [(s, s.next_scale(iterations, max_log2)) for s in searches]
        todo = [(s, r) for s, r in todo if r is not None]
        if not todo:
            return searches
        rnd += 1
        tasks = [SimTask(s.spec, 1.0 / r, f"{s.spec.label} x{r:.3g}") for s, r in todo]
        t0 = time.perf_counter()
        results = run_tasks(ctx, tasks, jobs, show_progress=False)
        for (s, r), out in zip(todo, results, strict=True):
            ok = passes(out, objectives)
            s.record(r, out, ok)
            vals = ", ".join(
                f"{o.describe().split(' <=')[0]} {fmt_s(o.value(out))}" for o in objectives
            )
            log(
                f"round {rnd}: {s.spec.label} at x{r:.3g} ({base_rate * r:.2f} req/s): {vals} "
                f"-> {'pass' if ok else 'FAIL'}"
            )
        log(f"round {rnd} took {time.perf_counter() - t0:.1f} s")


def _base_rate(ctx: RunContext) -> float:
    """Mean offered rate of the (sampled) trace at scale 1, req/s: `bench.traces.mean_rate`,
    the definition `rate_time_scale` inverts, so `compare --load 1` replays at the capacity
    found. A trace without a span has no rate to search (`TraceError`)."""
    rate = mean_rate(ctx.trace)
    if rate is None:
        raise TraceError(
            f"a trace of {len(ctx.trace.requests)} requests arriving at one instant has no "
            "request rate to search: sample more requests, or a trace spanning some time"
        )
    return rate


def refused(trace: Trace, fleet: FleetSpec) -> int:
    """Requests the fleet refuses whatever the rate (vLLM's 400; `FleetSpec.servable`)."""
    return len(trace.requests) - len(fleet.servable(trace.requests))


@dataclass(slots=True, frozen=True)
class Capacity:
    """One policy's sustainable mean rate on a fleet, for pacing a replay (`bench.compare
    --load`): ``at_least`` when every probe up to the search's limit passed."""

    request_rate: float
    rate_scale: float
    at_least: bool
    probes: int


def capacity_of(
    trace: Trace,
    fleet: FleetSpec,
    spec: PolicySpec,
    objectives: list[Objective],
    *,
    seed: int = 0,
    iterations: int = 3,
    max_log2: float = 10.0,
    log: Any = print,
) -> Capacity | None:
    """The highest mean request rate at which ``spec`` keeps ``objectives`` on ``fleet`` for
    ``trace`` (its arrival shape kept), by the same offline search as this tool's; None when
    even the slowest rate probed fails, or when the fleet serves none of the requests.
    Requests the fleet refuses (vLLM's 400, at any rate) are left out of the verdict."""
    ctx = RunContext(trace=trace, fleet=fleet, seed=seed)
    if refused(trace, fleet) == len(trace.requests):
        log(f"capacity: the fleet refuses all {len(trace.requests)} requests (too long for it)")
        return None
    (s,) = run_search(ctx, [spec], objectives, iterations=iterations, max_log2=max_log2, log=log)
    scale = s.answer_scale
    if scale is None:
        return None
    return Capacity(
        request_rate=scale * _base_rate(ctx),
        rate_scale=scale,
        at_least=s.at_least,
        probes=len(s.probes),
    )


def answer_lines(
    searches: list[Search],
    objectives: list[Objective],
    base_rate: float,
    workers: int,
    refused: int = 0,
) -> list[str]:
    """ "8 workers hold 42 req/s at TTFT p95 <= 2 s with kv_aware, 17 req/s with round_robin",
    plus a line for the requests the fleet refuses at any rate, when there are some. A search
    that passed every probe up to its ceiling says "at least": its rate is where it stopped
    looking, not where the fleet stops holding."""
    slo = ", ".join(o.describe() for o in objectives)
    parts = []
    for s in sorted(searches, key=lambda s: -(s.answer_scale or 0)):
        a = s.answer_scale
        if a is None:
            parts.append(f"none of the probed rates with {s.spec.label}")
        elif s.at_least:
            parts.append(
                f"at least {base_rate * a:.1f} req/s (rate x{a:.2f}, the search ceiling "
                f"--max-scale: every probe passed) with {s.spec.label}"
            )
        else:
            parts.append(f"{base_rate * a:.1f} req/s (rate x{a:.2f}) with {s.spec.label}")
    lines = [f"{workers} workers hold " + parts[0] + f" at {slo}"] + [f"    {p}" for p in parts[1:]]
    if refused:
        lines.append(
            f"    ({refused} requests refused at every rate, as vLLM refuses them (400), and left "
            "out: too long for the context or the KV cache)"
        )
    return lines


def plot(
    searches: list[Search],
    objectives: list[Objective],
    base_rate: float,
    path: Path,
    title: str,
) -> None:
    """Rate vs each constrained latency percentile, one line per policy, SLOs dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((o.metric, o.quantile) for o in objectives)) or [("ttft", "p95")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (metric, q) in zip(axes[0], panels, strict=True):
        for s in searches:
            pts = sorted((p["rate_scale"] * base_rate, p["summary"][metric][q]) for p in s.probes)
            pts = [(x, y) for x, y in pts if y is not None]
            if not pts:
                continue
            (line,) = ax.plot(*zip(*pts, strict=True), marker="o", label=s.spec.label)
            if s.answer_scale is not None:
                ax.axvline(s.answer_scale * base_rate, color=line.get_color(), ls=":", lw=1)
        for o in objectives:
            if (o.metric, o.quantile) == (metric, q):
                ax.axhline(o.limit_s, color="red", ls="--", lw=1, label=f"SLO {o.limit_s:g} s")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{metric.upper()} {q} (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 60 * len(panels)), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def objectives_from_args(args: argparse.Namespace) -> list[Objective]:
    out = []
    for m in METRICS:
        for q in QUANTS:
            v = getattr(args, f"slo_{m}_{q}", None)
            if v is not None:
                out.append(Objective(m, q, v))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench capacity", description=__doc__.split("\n")[0])
    add_trace_args(p)
    add_fleet_args(p)
    add_policy_args(p, default="round_robin,kv_aware")
    g = p.add_argument_group("search")
    for m in METRICS:
        for q in QUANTS:
            g.add_argument(f"--slo-{m}-{q}", type=positive, default=None, help=argparse.SUPPRESS)
    g.add_argument("--iterations", type=int, default=4, help="bisection steps after bracketing")
    g.add_argument("--max-scale", type=positive, default=64.0, help="search within [1/x, x]")
    g.add_argument("--png", type=Path, default=out_path("capacity.png"), help="%(default)s")
    g.add_argument(
        "--json", type=Path, default=out_path("capacity.json"), help="every probe: %(default)s"
    )
    p.epilog = "SLOs: --slo-{ttft,tpot,itl,e2e}-{p50,p90,p95,p99} SECONDS (default TTFT p95 2 s)"
    args = p.parse_args(argv)
    if not 1 <= args.max_scale <= MAX_SCALE_LIMIT:
        p.error(
            f"--max-scale must be in [1, 2^{math.log2(MAX_SCALE_LIMIT):.0f}] (the search spans "
            f"1/x to x), not {args.max_scale:g}"
        )
    objectives = objectives_from_args(args) or [Objective("ttft", "p95", 2.0)]
    console = report_console()
    t0 = time.perf_counter()
    specs = specs_from_args(args, p)
    trace = trace_from_args(args, p.prog)
    fleet = fleet_from_args(args)
    n_refused = refused(trace, fleet)
    if n_refused == len(trace.requests):
        exit_on_trace_error(
            p.prog,
            TraceError(
                f"the fleet refuses all {n_refused} requests (longer than --max-model-len or a "
                "worker's KV cache): nothing to search"
            ),
        )
    bound, pooled = bound_rates(trace.requests, fleet)
    ctx = RunContext(
        trace=trace,
        fleet=fleet,
        seed=args.seed,
        keys=args.keys,
        slo=SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e),
        bound_rate=bound,
        pooled_rate=pooled,
    )
    try:
        base = _base_rate(ctx)
    except TraceError as e:
        exit_on_trace_error(p.prog, e)
    console.print(
        f"capacity search: {trace.describe()}, {base:.2f} req/s at x1 | {fleet.describe()} | "
        f"keys {args.keys} | seed {args.seed} | {', '.join(o.describe() for o in objectives)}"
    )
    searches = run_search(
        ctx,
        specs,
        objectives,
        iterations=args.iterations,
        max_log2=math.log2(args.max_scale),
        jobs=args.jobs,
        log=lambda s: console.print(s, markup=False),
    )
    lines = answer_lines(searches, objectives, base, fleet.workers, n_refused)
    title = (
        f"{trace.describe()} | {fleet.describe()} | seed {args.seed} | "
        f"{machine()['cpu']} x{machine()['cores']}"
    )
    plot(searches, objectives, base, args.png, title)
    for line in lines:
        console.print(line, markup=False)
    console.print(
        f"plot: {shown(args.png)}  (total {time.perf_counter() - t0:.0f} s)", markup=False
    )
    if args.json:
        out = {
            "answers": [
                {
                    "policy": s.spec.label,
                    "rate_scale": s.answer_scale,
                    "request_rate": None if s.answer_scale is None else s.answer_scale * base,
                    "at_least": s.at_least,
                    "probes": [
                        {
                            "rate_scale": pr["rate_scale"],
                            "request_rate": pr["rate_scale"] * base,
                            "passed": pr["passed"],
                            "summary": pr["summary"],
                        }
                        for pr in s.probes
                    ],
                }
                for s in searches
            ],
            "lines": lines,
            "refused_requests": n_refused,
            "objectives": [_obj(o) for o in objectives],
            "trace": {**trace.meta(), "describe": trace.describe(), "rate_at_x1": base},
            "fleet": fleet.to_json(),
            "seed": args.seed,
            "keys": args.keys,
            "machine": machine(),
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {shown(args.json)}", markup=False)
    return 0


def _obj(o: Objective) -> dict[str, Any]:
    return {"metric": o.metric, "quantile": o.quantile, "limit_s": o.limit_s}


if __name__ == "__main__":
    sys.exit(main())
