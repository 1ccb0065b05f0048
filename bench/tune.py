"""`kvgate bench tune`: search kv_aware's weights and options on your trace, offline, and print the
TOML to paste.

Why: the defaults were tuned on the Mooncake sample; a fleet whose traffic is agentic, or
conversational, or far more loaded, wants other trade-offs between cache affinity and queueing
(`affinity_slack`, `commitment_slack`, the queue and KV weights, the saturation thresholds).
Measuring each candidate over HTTP would take hours; the offline simulator (`bench.simulate`: the
gateway's own policy code on a virtual clock) replays a trace in seconds, so a search of a few
dozen candidates takes minutes on a laptop.

    .venv/bin/kvgate bench tune --trace "conversation:sessions=120" --workers 4 --rate-scale 4
    .venv/bin/kvgate bench tune --sample 0.25 --rate-scale 5 --trials 24 \\
        --validate bench/data/traces/mooncake/synthetic_trace.jsonl

Search: the current config (`--config`, else the defaults) and random candidates first (seeded),
then rounds of perturbations around the best few, shrinking. Objective (`--objective`):
goodput (the fraction of requests meeting the TTFT/TPOT SLOs), tie-broken by p99 TTFT, then by
hit rate; or p99 TTFT alone. The best candidate is printed as `[routing.weights]` and
`[routing.options]` blocks with its predicted figures next to the current config's; pasted into
the config file they apply live (the gateway reloads the file on change). `--validate TRACE`
replays the current config and the suggestion on a second trace of the same family: a suggestion
that only fits the trace it was searched on shows there. Writes `bench/out/tune.json` and a PNG of
every trial (goodput against p99 TTFT).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.argtypes import positive
from bench.paths import out_path, shown
from bench.simulate import (
    PolicySpec,
    RunContext,
    SimTask,
    add_fleet_args,
    add_trace_args,
    bound_rates,
    fleet_from_args,
    print_table,
    report_console,
    run_tasks,
    slo_from_args,
    trace_from_args,
)
from bench.traces import (
    Trace,
    TraceError,
    check_time_scale,
    exit_on_trace_error,
    load_trace,
)
from scoring.views import RoutingOptions, Weights

# name -> (low, high, log scale): what the search may change. Tenant priority is left alone: it
# trades one tenant's latency for another's, which a trace without tenants' SLOs cannot judge.
WEIGHT_SPACE: dict[str, tuple[float, float, bool]] = {
    "prefix": (0.15, 0.9, False),
    "queue": (0.05, 0.6, False),
    "kv": (0.0, 0.4, False),
    "session": (0.0, 0.4, False),
}
OPTION_SPACE: dict[str, tuple[float, float, bool]] = {
    "affinity_slack": (1.0, 40.0, True),
    "commitment_slack": (0.5, 16.0, True),
    "queue_horizon_s": (0.1, 3.0, True),
    "saturation_kv": (0.75, 0.99, False),
    "saturation_waiting": (2.0, 48.0, True),
}
OBJECTIVES = ("goodput", "p99")


@dataclass(slots=True, frozen=True)
class Candidate:
    """One point of the search: full weight and option values (not deltas)."""

    weights: tuple[tuple[str, float], ...]
    options: tuple[tuple[str, float], ...]

    def spec(self, label: str) -> PolicySpec:
        return PolicySpec("kv_aware", label, self.weights, self.options)

    def toml(self) -> str:
        lines = ["[routing.weights]"]
        lines += [f"{k} = {_fmt(v)}" for k, v in self.weights]
        lines += ["", "[routing.options]"]
        lines += [f"{k} = {_fmt(v)}" for k, v in self.options]
        return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def baseline(config: Path | None) -> Candidate:
    """The searched values as the config sets them (defaults for what it leaves out)."""
    w = {f.name: getattr(Weights(), f.name) for f in fields(Weights)}
    o: dict[str, float] = {}
    if config is not None:
        from gateway.config import load_settings

        r = load_settings(config).routing
        w.update(r.weights.model_dump())
        o.update(r.options)
    defaults = RoutingOptions()
    return Candidate(
        tuple((k, float(w[k])) for k in WEIGHT_SPACE),
        tuple((k, float(o.get(k, getattr(defaults, k)))) for k in OPTION_SPACE),
    )


def _draw(rng: random.Random, lo: float, hi: float, log: bool) -> float:
    if log:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return rng.uniform(lo, hi)


def random_candidate(rng: random.Random) -> Candidate:
    return Candidate(
        tuple((k, round(_draw(rng, *WEIGHT_SPACE[k]), 3)) for k in WEIGHT_SPACE),
        tuple((k, round(_draw(rng, *OPTION_SPACE[k]), 3)) for k in OPTION_SPACE),
    )


def perturb(c: Candidate, rng: random.Random, scale: float) -> Candidate:
    """A neighbour: every value moved by up to `scale` of its range (in log space for log ones),
    clamped to the range."""

    def move(k: str, v: float, space: dict[str, tuple[float, float, bool]]) -> float:
        lo, hi, log = space[k]
        if log:
            span = math.log(hi) - math.log(lo)
            x = math.log(max(v, lo)) + rng.uniform(-scale, scale) * span
            return round(min(max(math.exp(x), lo), hi), 3)
        return round(min(max(v + rng.uniform(-scale, scale) * (hi - lo), lo), hi), 3)

    return Candidate(
        tuple((k, move(k, v, WEIGHT_SPACE)) for k, v in c.weights),
        tuple((k, move(k, v, OPTION_SPACE)) for k, v in c.options),
    )


def score(result: dict[str, Any], objective: str) -> tuple[float, ...]:
    """Higher is better. Goodput: fraction meeting the SLOs, then -p99 TTFT, then hit rate."""
    p99 = result["ttft"]["p99"]
    p99 = math.inf if p99 is None else p99
    if objective == "p99":
        return (-p99, result["goodput"]["fraction"], result["hit_rate"])
    return (round(result["goodput"]["fraction"], 4), -p99, result["hit_rate"])


def figures(result: dict[str, Any]) -> dict[str, float | None]:
    t = result["ttft"]
    return {
        "goodput": result["goodput"]["fraction"],
        "hit_rate": result["hit_rate"],
        "ttft_p50": t["p50"],
        "ttft_p99": t["p99"],
    }


def search(
    ctx: RunContext,
    base: Candidate,
    *,
    trials: int,
    time_scale: float,
    objective: str,
    seed: int,
    jobs: int | None,
    quiet: bool,
) -> list[tuple[Candidate, dict[str, Any]]]:
    """Every trial run, in order: the baseline first, then random, then refinements."""
    rng = random.Random(seed)
    first = max(2, trials // 2)
    rounds = [[base] + [random_candidate(rng) for _ in range(first - 1)]]
    left = trials - first
    scale = 0.25
    done: list[tuple[Candidate, dict[str, Any]]] = []
    progress = Progress(
        TextColumn("tuning"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=quiet,
        console=report_console(),
    )
    with progress:
        bar = progress.add_task("trials", total=trials)
        while rounds:
            batch = rounds.pop()
            tasks = [
                SimTask(c.spec(f"trial-{len(done) + i}"), time_scale) for i, c in enumerate(batch)
            ]
            for c, r in zip(batch, run_tasks(ctx, tasks, jobs, show_progress=False), strict=True):
                done.append((c, r))
                progress.advance(bar)
            if left > 0:
                size = min(left, max(2, trials // 4))
                ranked = sorted(done, key=lambda cr: score(cr[1], objective), reverse=True)
                top = [c for c, _ in ranked[:3]]
                rounds.append([perturb(top[i % len(top)], rng, scale) for i in range(size)])
                left -= size
                scale *= 0.6
    return done


def _table(rows: list[tuple[str, dict[str, float | None]]], title: str) -> Table:
    t = Table(title=title)
    for h in ("candidate", "goodput", "hit rate", "TTFT p50 s", "TTFT p99 s"):
        t.add_column(h, justify="left" if h == "candidate" else "right")
    for name, f in rows:
        t.add_row(
            name,
            f"{f['goodput']:.1%}",
            f"{f['hit_rate']:.1%}",
            f"{f['ttft_p50']:.3f}" if f["ttft_p50"] is not None else "-",
            f"{f['ttft_p99']:.3f}" if f["ttft_p99"] is not None else "-",
        )
    return t


def plot(done: list[tuple[Candidate, dict[str, Any]]], best: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["ttft"]["p99"] or 0.0 for _, r in done]
    ys = [r["goodput"]["fraction"] * 100 for _, r in done]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter(xs, ys, s=18, color="0.6", label="trial")
    ax.scatter([xs[0]], [ys[0]], s=60, marker="s", color="tab:blue", label="current config")
    ax.scatter([xs[best]], [ys[best]], s=90, marker="*", color="tab:red", label="suggested")
    ax.set_xlabel("TTFT p99 (s, simulated)")
    ax.set_ylabel("goodput (% of requests within SLO)")
    ax.set_title("kvgate bench tune: every trial")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench tune", description=__doc__.split("\n")[0])
    add_trace_args(p)
    add_fleet_args(p)
    g = p.add_argument_group("search")
    g.add_argument("--config", type=Path, default=None, help="current config (default: defaults)")
    g.add_argument("--trials", type=int, default=24, help="simulations in all (default 24)")
    g.add_argument("--objective", choices=OBJECTIVES, default="goodput")
    g.add_argument("--rate-scale", type=positive, default=1.0, help="x the trace's request rate")
    g.add_argument("--slo-ttft", type=positive, default=2.0, help="goodput SLO on TTFT (s)")
    g.add_argument("--slo-tpot", type=positive, default=0.1, help="goodput SLO on TPOT (s)")
    g.add_argument("--slo-e2e", type=positive, default=None, help="goodput SLO on E2E (s)")
    g.add_argument("--jobs", type=int, default=None, help="parallel processes (default: cores)")
    g.add_argument("--validate", default=None, metavar="TRACE", help="check on a second trace")
    g.add_argument("--json", type=Path, default=out_path("tune.json"), help="%(default)s")
    g.add_argument("--png", type=Path, default=out_path("tune.png"), help="%(default)s")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.trials < 2:
        p.error("--trials must be >= 2")
    console = report_console()
    t0 = time.perf_counter()
    trace = trace_from_args(args, p.prog)
    time_scale = 1.0 / args.rate_scale
    try:
        check_time_scale(trace, time_scale)
    except ValueError as e:
        p.error(f"--rate-scale: {e}")
    # The second trace is read and checked before the search: a typo in its path used to be a
    # traceback after minutes of trials, with nothing written.
    second = validation_trace(args.validate, time_scale, p.prog) if args.validate else None
    ctx = RunContext(
        trace=trace, fleet=fleet_from_args(args), seed=args.seed, slo=slo_from_args(args)
    )
    ctx.bound_rate, ctx.pooled_rate = bound_rates(trace.requests, ctx.fleet)
    base = baseline(args.config)
    done = search(
        ctx,
        base,
        trials=args.trials,
        time_scale=time_scale,
        objective=args.objective,
        seed=args.seed,
        jobs=args.jobs,
        quiet=args.quiet,
    )
    best = max(range(len(done)), key=lambda i: score(done[i][1], args.objective))
    best_c, best_r = done[best]
    rows = [("current config", figures(done[0][1])), (f"suggested (trial {best})", figures(best_r))]
    print_table(console, _table(rows, f"{trace.describe()} | rate x{args.rate_scale:g}"))
    out: dict[str, Any] = {
        "trace": trace.describe(),
        "fleet": ctx.fleet.to_json(),
        "rate_scale": args.rate_scale,
        "objective": args.objective,
        "slo": ctx.slo.to_json(),
        "current": {"values": _values(base), **figures(done[0][1])},
        "suggested": {"values": _values(best_c), "trial": best, **figures(best_r)},
        "trials": [{"values": _values(c), **figures(r)} for c, r in done],
    }
    if second is not None:
        vctx = RunContext(trace=second, fleet=ctx.fleet, seed=args.seed, slo=ctx.slo)
        tasks = [
            SimTask(base.spec("current"), time_scale),
            SimTask(best_c.spec("suggested"), time_scale),
        ]
        cur, sug = run_tasks(vctx, tasks, args.jobs, show_progress=False)
        fc, fs = figures(cur), figures(sug)
        print_table(
            console,
            _table([("current config", fc), ("suggested", fs)], f"validation: {second.describe()}"),
        )
        no_worse = score(sug, args.objective) >= score(cur, args.objective)
        verdict = "no worse" if no_worse else "WORSE"
        console.print(f"validation: the suggestion is {verdict} than the current config")
        out["validation"] = {
            "trace": second.describe(),
            "current": fc,
            "suggested": fs,
            "no_worse": no_worse,
        }
    console.print("\nPaste into the config file (it reloads live):\n")
    console.print(best_c.toml(), markup=False, highlight=False)
    console.print(f"\n{len(done)} trials in {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {shown(args.json)}", markup=False)
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot(done, best, args.png)
        console.print(f"wrote {shown(args.png)}", markup=False)
    return 0


def validation_trace(path: str, time_scale: float, prog: str) -> Trace:
    """`--validate`'s trace, or one line on stderr and exit 2 when it cannot be used (missing,
    malformed, without a request to replay, or not replayable at the search's time scale)."""
    try:
        trace = load_trace(path)
        if not trace.requests:
            raise TraceError(f"{path}: the trace has no request")
        check_time_scale(trace, time_scale)
    except ValueError as e:  # TraceError included
        exit_on_trace_error(prog, TraceError(f"--validate: {e}"))
    return trace


def _values(c: Candidate) -> dict[str, float]:
    return {**dict(c.weights), **dict(c.options)}


if __name__ == "__main__":
    sys.exit(main())
