"""Side-by-side: the same trace sample through kvgate (each policy), the peer routers and direct to
one worker, against the same simulated fleet, in one run.

    .venv/bin/kvgate bench compare              # Mooncake sample, 8 workers, everything
    .venv/bin/kvgate bench compare --peers none --policies round_robin,kv_aware --sample 0.03

For each target, in turn: a fresh simulated fleet (`kvgate sim` in a subprocess, so every router
starts from empty caches), the router (`kvgate serve` with a generated config, or a peer from its
own virtualenv under `.build/peers/`, installed on first use by `bench.peers`, which
`bench.overhead --peers` shares), one warm-up request, then the open
loop HTTP replay (`bench.replay`) of the same trace sample, then the workers' own counters
(`vllm:request_success_total`, `vllm:prefix_cache_*`) for per-worker load and hit rates, which every
router is measured by alike. A peer that cannot be installed or started is reported as skipped,
with the reason. Everything binds 127.0.0.1.

`--gateways N` runs each kvgate target as N `kvgate serve` processes (replicas) in front of the
fleet, sharing quotas, learned state and per-worker load through one real `redis-server` started
for the run (`[quota] backend = "redis"`, `[cluster] enabled = true`, a fresh key prefix per
target; `bench.gateways`), and the replay sends each request to one of them at random, as an L4
balancer would. Peers and the direct run are unchanged (one process each). `--no-cluster` leaves
`[cluster]` off: the same N replicas, each learning and counting only its own dispatches (the
figure sharing is measured against). The offline prediction models N replicas too, sharing what
`--predict-share` says (all of it, 0.1 s late, by default: what `[cluster]` ships; none with
`--no-cluster`; `bench.replicas`). `kvgate:kv_aware_precise` is kv_aware over the workers' KV
events (the fleet publishes them for that target only).

Defaults are sized for a 2-core machine and the 15-minute budget: a ~5% sample of the Mooncake
trace by prefix family (whole families of requests sharing a document, so the sample keeps the
trace's sharing: its infinite-cache bound stays ~0.65), compressed to ~45 s, on 8 workers whose
modelled GPU is 2x slower than the default profile (`--gpu-slowdown 2`): the fleet sees the load
of a 2x faster arrival rate while the CPU that runs the simulator, the router and the client sees
half the HTTP traffic. The offline simulator's prediction for the same sample and fleet is printed
next to the HTTP numbers (`--no-predict` skips it).

Writes `<out>/compare.md` (every column), `compare.json`, `ttft_cdf.png`, `hit_rate.png`,
`worker_load.png`, and every process's log under `<out>/logs/` (`--out`, default
`bench/out/compare/`). The table printed on the terminal fits 100 columns; `--wide` prints every
column there too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from rich import box
from rich.console import Console
from rich.table import Table

from bench.argtypes import count, goodput, nonnegative_int, positive
from bench.floor import floor_describe
from bench.gateways import (  # noqa: F401 - kvgate_config: part of this module's interface
    kv_event_endpoints,
    kvgate_config,
    needs_kv_events,
    start_kvgates,
)
from bench.metrics import SLO, balance, dist, machine
from bench.paths import MOONCAKE_TRACE, out_path, shown
from bench.peers import (  # noqa: F401 - PEERS_DIR and Peer: part of this module's interface
    HOST,
    MODEL,
    PEERS,
    PEERS_DIR,
    Peer,
    Proc,
    ensure_peer,
    free_ports,
    start,
    start_peer,
    wait_for,
    warm,
)
from bench.redis_server import RedisServer, RedisServerError
from bench.replay import ReplayOptions, parse_goodput, run_replay
from bench.replicas import DEFAULT_DELAY_S, ShareModel
from bench.simulate import (
    FleetSpec,
    PolicySpec,
    add_number_column,
    print_table,
    simulate_policy,
    split_policies,
)
from bench.traces import (
    SAMPLE_BY,
    Trace,
    TraceError,
    cache_bound,
    cap_output,
    exit_on_trace_error,
    head,
    load_trace,
    rate_time_scale,
    sample,
    scale_time,
)
from workers.sim.profiles import PROFILES

DEFAULT_TRACE = MOONCAKE_TRACE


# ==================================================================================================
# The fleet, kvgate and the peers
# ==================================================================================================


@dataclass(slots=True, frozen=True)
class SimFleet:
    """How `kvgate sim` is started for every target (identical each time)."""

    workers: int = 8
    num_blocks: int = 16384
    block_size: int = 16
    profile: str = "default"
    gpu_slowdown: float = 2.0
    max_model_len: int = 262144

    def argv(self, port: int, kv_events_port: int | None = None) -> list[str]:
        """`kvgate sim` for the whole fleet; with `kv_events_port` the workers publish KV events
        (worker i on kv_events_port + 2i, replay on the next port), as vLLM does."""
        kv = ("--kv-events-port", str(kv_events_port)) if kv_events_port else ()
        return [
            *(sys.executable, "-m", "gateway.cli", "sim"),
            *("--host", HOST, "--port", str(port), "--workers", str(self.workers)),
            *("--model", MODEL, "--profile", self.profile, "--time-scale", str(self.gpu_slowdown)),
            *("--num-blocks", str(self.num_blocks), "--block-size", str(self.block_size)),
            *("--max-model-len", str(self.max_model_len)),
            *kv,
        ]

    def spec(self) -> FleetSpec:
        """The same fleet for the offline prediction."""
        return FleetSpec(
            workers=self.workers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            profile=self.profile,
            profile_scale=self.gpu_slowdown,
            max_model_len=self.max_model_len,
        )

    def describe(self) -> str:
        return (
            f"{self.workers} simulated workers, profile {self.profile} x{self.gpu_slowdown:g} "
            f"slower, {self.num_blocks} blocks x {self.block_size} tokens"
        )


def start_fleet(
    fleet: SimFleet, logs: Path, tag: str, kv_events: bool = False
) -> tuple[Proc, list[str], list[tuple[str, str]]]:
    """A fresh fleet; its base URLs and, with `kv_events`, its (PUB, replay) event endpoints."""
    port = free_ports(fleet.workers)
    kv_port = None
    if kv_events:
        kv_port = free_ports(2 * fleet.workers)
        while port <= kv_port + 2 * fleet.workers and kv_port <= port + fleet.workers:
            kv_port = free_ports(2 * fleet.workers)  # the HTTP ports are not bound yet
    proc = start(f"sim-{tag}", fleet.argv(port, kv_port), logs)
    urls = [f"http://{HOST}:{port + i}" for i in range(fleet.workers)]
    endpoints = kv_event_endpoints(kv_port, fleet.workers) if kv_port else []
    pending = set(urls)

    def healthy() -> bool:
        for u in list(pending):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(u + "/health", timeout=1.0).status_code == 200:
                    pending.discard(u)
        return not pending

    wait_for(healthy, proc, 60, "simulated fleet")
    return proc, urls, endpoints


# ==================================================================================================
# Measuring the workers
# ==================================================================================================


def scrape(urls: list[str]) -> list[dict[str, float]]:
    """Per worker: finished requests, prefix-cache queries/hits, preemptions (vLLM's counters).

    Requests served are the `stop` and `length` samples of `vllm:request_success_total`: vLLM
    0.32 counts a client's abort in none, but any other reason ("abort" when the engine itself
    aborts, "error") is not a request the worker served either."""
    out = []
    for u in urls:
        text = httpx.get(u + "/metrics", timeout=5.0).text
        m = {"requests": 0.0, "queries": 0.0, "hits": 0.0, "preemptions": 0.0}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            if key == "vllm:request_success_total":
                if 'finished_reason="stop"' in name or 'finished_reason="length"' in name:
                    m["requests"] += float(value)
            elif key == "vllm:prefix_cache_queries_total":
                m["queries"] += float(value)
            elif key == "vllm:prefix_cache_hits_total":
                m["hits"] += float(value)
            elif key == "vllm:num_preemptions_total":
                m["preemptions"] += float(value)
        out.append(m)
    return out


def diff(after: list[dict[str, float]], before: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]


# ==================================================================================================
# One target
# ==================================================================================================


@dataclass
class Target:
    name: str
    kind: str  # kvgate | peer | direct
    spec: PolicySpec | None = None
    peer: Peer | None = None
    status: str = "pending"  # ok | skipped | failed
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    gateways: int = 1  # kvgate processes that ran (replicas sharing one Redis when > 1)
    cluster: bool = True  # with several: [cluster] on (shared learned state and load)


def run_target(
    t: Target,
    trace: Trace,
    fleet: SimFleet,
    opts: ReplayOptions,
    slo: SLO,
    logs: Path,
    console: Console,
    venv: Path | None,
    redis_url: str | None = None,
) -> None:
    """One target on a fresh fleet; kvgate with `t.gateways` > 1 runs that many replicas on
    `redis_url`, the replay spreading requests over them."""
    procs: list[Proc] = []
    try:
        precise = t.kind == "kvgate" and t.spec is not None and needs_kv_events(t.spec)
        tag = t.name.replace(":", "-")
        sim, urls, kv = start_fleet(fleet, logs, tag, kv_events=precise)
        procs.append(sim)
        shared_prefix = None
        if t.kind == "kvgate":
            assert t.spec is not None
            gws, bases, shared = start_kvgates(
                t.spec,
                urls,
                logs,
                t.spec.name,
                gateways=t.gateways,
                kv_events=kv,
                redis_url=redis_url,
                cluster=t.cluster,
            )
            procs += gws
            url = ",".join(bases)
            shared_prefix = shared.namespace if shared else None
        elif t.kind == "peer":
            assert t.peer is not None and venv is not None
            pr, url = start_peer(t.peer, venv, urls, logs)
            procs.append(pr)
        else:
            url = urls[0]
            wait_for(lambda: warm(url), sim, 30, "worker warm-up")
        before = scrape(urls)
        res = run_replay(trace, replace(opts, url=url), slo, console=console, keep_records=True)
        per_worker = diff(scrape(urls), before)
        records = res.pop("records")
        res["ttfts_s"] = [r["ttft"] for r in records if r["ok"]]
        res["per_worker"] = per_worker
        reqs = [w["requests"] for w in per_worker]
        res["worker_requests"] = reqs
        res["worker_balance"] = balance(reqs)
        q = sum(w["queries"] for w in per_worker)
        res["worker_hit_rate"] = sum(w["hits"] for w in per_worker) / q if q else None
        res["preemptions"] = sum(w["preemptions"] for w in per_worker)
        if t.kind == "kvgate":
            res["gateways"] = t.gateways
            res["cluster"] = t.gateways > 1 and t.cluster
            res["shared_namespace"] = shared_prefix
        t.result = res
        t.status = "ok"
    except Exception as e:  # a target that cannot run is reported, the others still run
        t.status = "failed"
        t.reason = str(e)[:600]
    finally:
        for p in reversed(procs):
            p.stop()


# ==================================================================================================
# Report
# ==================================================================================================


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v / 1000:.3f}"


def _ratio(v: float | None, of: float) -> str:
    return "-" if v is None or not of else f"{v / of:.2f}"


def pacing_describe(p: dict[str, Any] | None) -> str:
    """How the sample's clock was set, in words."""
    if not p:
        return "trace times as sampled"
    if p["by"] == "load":
        at_least = "at least " if p["capacity_at_least"] else ""
        return (
            f"{p['load']:g} x round-robin's capacity on this fleet ({at_least}"
            f"{p['capacity_req_s']:.3g} req/s with TTFT p95 <= {p['objective_ttft_p95_s']:.3g} s, "
            f"offline search): {p['rate']:.3g} req/s, "
            f"time scale x{p['time_scale']:.3g}"
        )
    if p["by"] == "rate":
        return f"{p['rate']:g} req/s on average, time scale x{p['time_scale']:.3g}"
    return f"time scale x{p['time_scale']:.3g}"


def markdown(report: dict[str, Any]) -> str:
    """The table a capacity reviewer reads, headed by everything needed to reproduce it."""
    tr = report["trace"]
    lines = [
        "# kvgate bench.compare",
        "",
        f"- trace: {tr['describe']}",
        f"- pacing: {pacing_describe(tr.get('pacing'))}",
        f"- infinite-cache bound: {tr['bound']['token_hit_rate']:.1%} of prompt tokens "
        f"({tr['bound']['block_hit_rate']:.1%} of blocks); pooled fleet cache (LRU) "
        f"{tr['pooled_bound']['token_hit_rate']:.1%}",
        f"- TTFT floor (each request alone on an idle worker holding every earlier block; "
        f"bench/floor.py): {floor_describe(tr)}",
        f"- fleet: {report['fleet_describe']} (fresh for every target)",
        f"- kvgate: {gateways_describe(report)}",
        f"- replay: open loop, {report['replay']['endpoint']}, max concurrency "
        f"{report['replay']['max_concurrency']}; goodput SLO {report['slo_describe']}",
        f"- seed {report['seed']}; machine: {report['machine']['cpu']} x"
        f"{report['machine']['cores']}, Python {report['machine']['python']}; "
        f"wall {report['wall_s']:.0f} s",
        "- latencies in seconds; hit rate = cached / prompt tokens (usage); load = max/mean "
        "requests per worker (workers' own counters)",
        "",
        "| router | ok/failed | hit rate | /bound | TTFT p50 | p90 | p99 | p99/floor | TPOT p50 | "
        "p99 | E2E p99 | req/s | goodput | load | predicted hit / TTFT p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bound = tr["bound"]["token_hit_rate"]
    floor_ms = 1000 * ((tr.get("ttft_floor") or {}).get("p99") or 0.0)
    for t in report["targets"]:
        if t["status"] != "ok":
            continue
        r = t["result"]
        hr = r["hit_rate"]
        wb = r["worker_balance"]
        pred = t.get("predicted")
        lines.append(
            f"| {t['name']} | {r['completed']}/{r['failed'] + r['not_sent']} | "
            f"{'-' if hr is None else f'{hr:.1%}'} | "
            f"{'-' if hr is None or not bound else f'{hr / bound:.2f}'} | "
            f"{_ms(r['median_ttft_ms'])} | {_ms(r['p90_ttft_ms'])} | {_ms(r['p99_ttft_ms'])} | "
            f"{_ratio(r['p99_ttft_ms'], floor_ms)} | {_ms(r['median_tpot_ms'])} | "
            f"{_ms(r['p99_tpot_ms'])} | {_ms(r['p99_e2el_ms'])} | "
            f"{r['request_throughput']:.2f} | {r['request_goodput']:.2f} | "
            f"{'-' if wb is None else f'{wb:.2f}'} | "
            + (f"{pred['hit_rate']:.1%} / {pred['ttft']['p99']:.3f} |" if pred else "- |")
        )
    skipped = [t for t in report["targets"] if t["status"] != "ok"]
    if skipped:
        lines += ["", "Not measured:"]
        lines += [f"- {t['name']}: {t['status']}: {t['reason']}" for t in skipped]
    return "\n".join(lines) + "\n"


def gateways_describe(report: dict[str, Any]) -> str:
    """How kvgate ran, for every report: one process, or N replicas on one Redis, and the
    model the offline prediction used for them."""
    n = report.get("gateways", 1)
    pred = report.get("prediction") or {}
    model = f"; prediction: {pred['label']}" if pred.get("label") else ""
    if n <= 1:
        return f"1 gateway process{model}"
    cluster = (
        "[cluster] enabled"
        if report.get("cluster", True)
        else "[cluster] off (each replica learns and counts only its own dispatches)"
    )
    return (
        f"{n} gateway processes (replicas) on one Redis: [quota] backend redis, {cluster}, a "
        f"fresh key prefix per target; requests spread over them at random{model}"
    )


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


# (header, wide only, cell from a target's report entry): the default set fits 100 columns with
# a 23-character router name (`kvgate:kv_aware_precise`); compare.md and `--wide` have them all.
CompareCell = Callable[[dict[str, Any], float], str]
COMPARE_COLUMNS: tuple[tuple[str, bool, CompareCell], ...] = (
    ("router", False, lambda t, b: t["name"]),
    (
        "ok/\nfailed",
        False,
        lambda t, b: (
            f"{t['result']['completed']}/{t['result']['failed'] + t['result']['not_sent']}"
        ),
    ),
    ("hit\nrate", False, lambda t, b: _pct(t["result"]["hit_rate"])),
    (
        "/bound",
        False,
        lambda t, b: (
            "-"
            if t["result"]["hit_rate"] is None or not b
            else f"{t['result']['hit_rate'] / b:.2f}"
        ),
    ),
    ("TTFT\np50", False, lambda t, b: _ms(t["result"]["median_ttft_ms"])),
    ("TTFT\np90", True, lambda t, b: _ms(t["result"]["p90_ttft_ms"])),
    ("TTFT\np99", False, lambda t, b: _ms(t["result"]["p99_ttft_ms"])),
    ("TPOT\np50", True, lambda t, b: _ms(t["result"]["median_tpot_ms"])),
    ("TPOT\np99", False, lambda t, b: _ms(t["result"]["p99_tpot_ms"])),
    ("E2E\np99", False, lambda t, b: _ms(t["result"]["p99_e2el_ms"])),
    ("req/s", False, lambda t, b: f"{t['result']['request_throughput']:.2f}"),
    ("good-\nput/s", True, lambda t, b: f"{t['result']['request_goodput']:.2f}"),
    (
        "load",
        True,
        lambda t, b: (
            "-" if t["result"]["worker_balance"] is None else f"{t['result']['worker_balance']:.2f}"
        ),
    ),
    (
        "predicted\nhit / p99",
        False,
        lambda t, b: (
            f"{t['predicted']['hit_rate']:.1%} / {t['predicted']['ttft']['p99']:.3f}"
            if t.get("predicted")
            else "-"
        ),
    ),
)


def console_table(report: dict[str, Any], wide: bool = False) -> Table:
    """The terminal's view of compare.md: the targets that ran, in seconds; the default columns
    fit a 100-column terminal (compare.md keeps every column, for the record)."""
    tr = report["trace"]
    bound = tr["bound"]["token_hit_rate"]
    cols = [c for c in COMPARE_COLUMNS if wide or not c[1]]
    n = report.get("gateways", 1)
    off = "" if report.get("cluster", True) else ", [cluster] off"
    t = Table(
        title="bench.compare (seconds; hit rate from the workers' usage.cached_tokens)"
        + (f"; kvgate = {n} gateway replicas on one Redis{off}" if n > 1 else ""),
        caption=f"{tr['describe']} | {report['fleet_describe']} | infinite-cache bound "
        f"{bound:.1%}, pooled LRU {tr['pooled_bound']['token_hit_rate']:.1%} | TTFT floor "
        f"{floor_describe(tr)} | goodput SLO "
        f"{report['slo_describe']} | seed {report['seed']}",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    for i, (header, _, _) in enumerate(cols):
        add_number_column(t, header, left=i == 0)
    for target in report["targets"]:
        if target["status"] == "ok":
            t.add_row(*(cell(target, bound) for _, _, cell in cols))
    return t


def plots(report: dict[str, Any], out: Path) -> list[Path]:
    """TTFT CDF per router, hit rate vs the bounds, per-worker load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [t for t in report["targets"] if t["status"] == "ok"]
    tr = report["trace"]
    n = report.get("gateways", 1)
    off = "" if report.get("cluster", True) else ", [cluster] off"
    gw = f"kvgate: {n} gateways on one Redis{off} | " if n > 1 else ""
    sub = textwrap.fill(
        f"{gw}{tr['describe']} | {report['fleet_describe']} | seed {report['seed']}", 130
    )
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5))
    for t in ok:
        v = sorted(x for x in t["result"]["ttfts_s"] if x is not None)
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=t["name"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    if ok:
        ax.legend(fontsize=8)
    ax.set_title(sub, fontsize=7)
    paths.append(out / "ttft_cdf.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    names = [t["name"] for t in ok]
    hits = [t["result"]["hit_rate"] or 0.0 for t in ok]
    ax.bar(names, hits, color="tab:blue")
    ax.axhline(tr["bound"]["token_hit_rate"], color="red", ls="--", label="infinite-cache bound")
    ax.axhline(tr["pooled_bound"]["token_hit_rate"], color="gray", ls=":", label="pooled LRU")
    ax.set_ylabel("prefix hit rate (cached / prompt tokens)")
    ax.set_ylim(0, 1)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8)
    ax.set_title(sub, fontsize=7)
    paths.append(out / "hit_rate.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5))
    n = len(ok)
    width = 0.8 / max(n, 1)
    for k, t in enumerate(ok):
        reqs = t["result"]["worker_requests"]
        ax.bar([i + k * width for i in range(len(reqs))], reqs, width, label=t["name"])
    ax.set_xlabel("worker")
    ax.set_ylabel("requests served")
    if ok:
        ax.legend(fontsize=7)
    ax.set_title(sub, fontsize=7)
    paths.append(out / "worker_load.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ==================================================================================================
# CLI
# ==================================================================================================


# `--load`'s default, and the objective its capacity is searched against: near saturation for
# round-robin, so the routers' differences show, without a queue that only grows. The TTFT bound
# is relative to the trace's own unloaded TTFT (long-context prompts take seconds to prefill on
# an idle fleet: a fixed 2 s would find no rate at all on them).
DEFAULT_LOAD = 0.9
CAPACITY_TTFT_P95_S = 2.0
CAPACITY_TTFT_FACTOR = 2.0
UNLOADED_STRETCH = 1024.0  # the trace's clock x this: arrivals far apart, no queue


def prepare(args: argparse.Namespace) -> Trace:
    """The sample, with its output capped; its clock is set by `pace`."""
    trace = load_trace(args.trace, args.format)
    if not trace.requests:
        raise TraceError(f"{args.trace}: the trace has no request")
    if args.limit is not None:
        trace = head(trace, args.limit)
    if args.sample is not None:
        try:
            trace = sample(trace, args.sample, args.seed, by=args.sample_by, keep_times=False)
        except ValueError as e:  # its range, for a caller that built `args` itself
            raise TraceError(f"--sample: {e}") from e
    if args.max_output:
        trace = cap_output(trace, args.max_output)
    return trace


def pace(
    trace: Trace, args: argparse.Namespace, fleet: SimFleet, log: Callable[[str], None]
) -> tuple[Trace, dict[str, Any]]:
    """Set the sample's clock: `--rate`, `--time-scale`, or `--load` x round-robin's capacity
    on this fleet (the default): a rate guessed for one trace overloads or idles the fleet on
    another, and a comparison only means something near saturation."""
    if args.rate is not None:
        scale = rate_time_scale(trace, args.rate)
        info: dict[str, Any] = {"by": "rate", "rate": args.rate}
    elif args.time_scale is not None and args.load is None:
        scale = args.time_scale
        info = {"by": "time_scale"}
    else:
        from bench.capacity import Objective, capacity_of

        load = DEFAULT_LOAD if args.load is None else args.load
        rr = PolicySpec.parse("round_robin")
        unloaded = simulate_policy(
            scale_time(trace, UNLOADED_STRETCH), rr, fleet.spec(), seed=args.seed
        )["ttft"]["p95"]
        limit = max(CAPACITY_TTFT_P95_S, CAPACITY_TTFT_FACTOR * (unloaded or 0.0))
        log(
            f"pacing: searching round_robin's capacity on this fleet offline (--load {load:g}; "
            f"TTFT p95 <= {limit:.3g} s, its unloaded p95 {unloaded or 0.0:.3g} s)"
        )
        cap = capacity_of(
            trace, fleet.spec(), rr, [Objective("ttft", "p95", limit)], seed=args.seed, log=log
        )
        if cap is None:
            raise TraceError(
                "round_robin keeps no rate within the TTFT objective on this fleet (its "
                "requests may be too long for it): set --rate or --time-scale"
            )
        rate = load * cap.request_rate
        scale = rate_time_scale(trace, rate)
        info = {
            "by": "load",
            "load": load,
            "capacity_req_s": round(cap.request_rate, 4),
            "capacity_at_least": cap.at_least,
            "objective_ttft_p95_s": round(limit, 4),
            "rate": round(rate, 4),
        }
        log(
            f"pacing: round_robin sustains {'at least ' if cap.at_least else ''}"
            f"{cap.request_rate:.3g} req/s; replaying at {rate:.3g} req/s ({load:g}x)"
        )
    info["time_scale"] = round(scale, 6)
    try:
        return scale_time(trace, scale), info
    except ValueError as e:  # a scale that overflows the arrivals (--time-scale 1e308)
        raise TraceError(str(e)) from e


def predict(
    trace: Trace,
    fleet: SimFleet,
    specs: list[PolicySpec],
    slo: SLO,
    seed: int,
    replicas: int = 1,
    share: ShareModel | None = None,
) -> dict[str, dict[str, Any]]:
    """The offline simulator's numbers for the same sample and fleet (virtual clock), with as
    many gateway replicas as ran, sharing what `share` says."""
    out = {}
    for s in specs:
        r = simulate_policy(
            trace, s, fleet.spec(), seed=seed, slo=slo, replicas=replicas, share=share
        )
        out[s.label] = {
            "hit_rate": r["hit_rate"],
            "ttft": r["ttft"],
            "tpot": r["tpot"],
            "share": r["share"],
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate bench compare", description=__doc__.split("\n")[0])
    g = p.add_argument_group("trace")
    g.add_argument("--trace", default=str(DEFAULT_TRACE))
    g.add_argument("--format", default=None)
    # Typed (bench.argtypes): `--sample 0` was no sampling at all, `--sample inf` a traceback.
    g.add_argument("--limit", type=count, default=None, help="first N requests, before sampling")
    g.add_argument("--sample", type=positive, default=0.05, help="fraction (<=1) or count (>1)")
    g.add_argument("--sample-by", default="auto", choices=SAMPLE_BY)
    g.add_argument("--time-scale", type=positive, default=None, help="x trace times")
    g.add_argument(
        "--rate",
        type=positive,
        default=None,
        help="replay the (sampled) trace at this mean req/s instead of --time-scale, keeping "
        "its arrival pattern",
    )
    g.add_argument(
        "--load",
        type=positive,
        default=None,
        help=f"replay at this fraction of round-robin's capacity on this fleet (an offline search: "
        f"every request done, TTFT p95 <= max({CAPACITY_TTFT_P95_S:g} s, "
        f"{CAPACITY_TTFT_FACTOR:g}x its unloaded p95)); the default ({DEFAULT_LOAD:g}) when "
        f"neither --rate nor --time-scale is given",
    )
    g.add_argument(
        "--max-output", type=nonnegative_int, default=256, help="cap output tokens (0 = no cap)"
    )
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("fleet")
    d = SimFleet()
    g.add_argument("--workers", type=count, default=d.workers)
    g.add_argument("--num-blocks", type=count, default=d.num_blocks)
    g.add_argument("--block-size", type=count, default=d.block_size)
    g.add_argument("--profile", default=d.profile, choices=sorted(PROFILES))
    g.add_argument("--gpu-slowdown", type=positive, default=d.gpu_slowdown, help="sim --time-scale")
    g = p.add_argument_group("targets")
    g.add_argument(
        "--policies",
        default="round_robin,least_loaded,prefix,kv_aware",
        help="kvgate policies (simulate's names and variants; kv_aware_precise = over the "
        "workers' KV events)",
    )
    g.add_argument(
        "--gateways",
        type=int,
        default=1,
        metavar="N",
        help="run each kvgate target as N replicas sharing one Redis ([cluster]), the replay "
        "spreading requests over them at random (default: %(default)s)",
    )
    g.add_argument(
        "--no-cluster",
        action="store_true",
        help="with --gateways > 1: leave [cluster] off, so each replica learns and counts only "
        "its own dispatches (the figure sharing is measured against)",
    )
    g.add_argument(
        "--predict-share",
        default=None,
        metavar="PARTS",
        help="with --gateways > 1: what the offline prediction's replicas share (simulate "
        "--share: all, none or some of load,index,sessions; default: all, none with --no-cluster)",
    )
    g.add_argument(
        "--predict-share-delay-s",
        type=float,
        default=DEFAULT_DELAY_S,
        metavar="S",
        help="with --gateways > 1: how late the prediction's replicas learn (default: %(default)s)",
    )
    g.add_argument("--peers", default=",".join(PEERS), help="comma-separated, or none")
    g.add_argument("--no-direct", action="store_true", help="skip the direct-to-one-worker run")
    g = p.add_argument_group("replay and output")
    g.add_argument(
        "--endpoint",
        choices=["completions", "text", "chat"],
        default="text",
        help="text (default): completions with text prompts, which every peer accepts "
        "(the SGLang router and SMG reject token-id prompts with 422)",
    )
    g.add_argument("--max-concurrency", type=int, default=256)
    g.add_argument("--drain-timeout", type=float, default=30.0)
    g.add_argument(
        "--goodput", nargs="*", type=goodput, default=None, help="ttft:MS tpot:MS e2el:MS"
    )
    g.add_argument("--budget", type=float, default=840.0, help="skip targets past N s in all")
    g.add_argument("--no-predict", action="store_true")
    g.add_argument("--out", type=Path, default=out_path("compare"), help="%(default)s")
    g.add_argument("--wide", action="store_true", help="print every column (compare.md has all)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.gateways < 1:
        p.error("--gateways must be >= 1")
    if sum(x is not None for x in (args.rate, args.time_scale, args.load)) > 1:
        p.error("give one of --rate, --time-scale and --load")
    if args.predict_share is None:
        args.predict_share = "none" if args.no_cluster else "all"
    try:
        share = ShareModel.parse(args.predict_share, args.predict_share_delay_s)
    except ValueError as e:
        p.error(f"--predict-share: {e}")
    try:  # before anything runs: an unknown name would fail in every target and prediction
        specs = [PolicySpec.parse(s).check() for s in split_policies(args.policies)]
    except ValueError as e:
        p.error(f"--policies: {e}")
    t0 = time.monotonic()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    out: Path = args.out
    logs = out / "logs"
    try:
        trace = prepare(args)
    except TraceError as e:
        exit_on_trace_error(p.prog, e)
    out.mkdir(parents=True, exist_ok=True)
    fleet = SimFleet(
        workers=args.workers,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        profile=args.profile,
        gpu_slowdown=args.gpu_slowdown,
        max_model_len=max(262144, max(r.input_length + r.output_length for r in trace.requests)),
    )
    try:
        trace, pacing = pace(trace, args, fleet, lambda s: console.print(s, markup=False))
    except TraceError as e:
        exit_on_trace_error(p.prog, e)
    slo = parse_goodput(args.goodput)
    peer_names = [] if args.peers.strip() in ("", "none") else split_policies(args.peers)
    cluster = not args.no_cluster
    targets = [
        Target(f"kvgate:{s.label}", "kvgate", spec=s, gateways=args.gateways, cluster=cluster)
        for s in specs
    ]
    for name in peer_names:
        if name not in PEERS:
            targets.append(Target(name, "peer", status="skipped", reason="unknown peer"))
        else:
            targets.append(Target(name, "peer", peer=PEERS[name]))
    if not args.no_direct:
        targets.append(Target("direct:w0", "direct"))
    console.print(
        f"compare: {trace.describe()} | {fleet.describe()} | {len(targets)} targets"
        + (
            f" | kvgate x{args.gateways} replicas on one Redis"
            + ("" if cluster else ", [cluster] off")
            if args.gateways > 1
            else ""
        ),
        markup=False,
    )

    venvs: dict[str, Path | None] = {}
    wanted = [t for t in targets if t.kind == "peer" and t.peer is not None]
    if wanted:
        console.print(f"peers: checking/installing {', '.join(t.name for t in wanted)} ...")
        with ThreadPoolExecutor(len(wanted)) as pool:
            found = list(pool.map(lambda t: ensure_peer(t.peer), wanted))
        for t, (venv, why) in zip(wanted, found, strict=True):
            venvs[t.name] = venv
            if venv is None:
                t.status, t.reason = "skipped", why
    opts = ReplayOptions(
        url="",
        model=MODEL,
        endpoint=args.endpoint,
        max_concurrency=args.max_concurrency,
        drain_timeout_s=args.drain_timeout,
        request_timeout_s=600.0,
        spread_seed=args.seed,
    )
    span = trace.duration_s
    with contextlib.ExitStack() as stack:
        redis_url = None
        if args.gateways > 1 and any(t.kind == "kvgate" for t in targets):
            try:
                redis_url = stack.enter_context(RedisServer()).url
                console.print(f"redis-server for the {args.gateways} gateways: {redis_url}")
            except RedisServerError as e:  # no binary: the kvgate targets cannot run
                for t in targets:
                    if t.kind == "kvgate":
                        t.status, t.reason = "failed", f"{args.gateways} gateways: {e}"
        for t in targets:
            if t.status != "pending":
                continue
            elapsed = time.monotonic() - t0
            if elapsed + span + args.drain_timeout + 15 > args.budget:
                t.status = "skipped"
                t.reason = f"time budget ({args.budget:.0f} s) would be exceeded"
                continue
            console.print(f"[{elapsed:5.0f} s] {t.name}", markup=False)
            run_target(t, trace, fleet, opts, slo, logs, console, venvs.get(t.name), redis_url)
            if t.status == "ok":
                r = t.result
                per = r.get("per_url") or {}
                spread = (
                    " | requests per gateway " + "/".join(str(c["requests"]) for c in per.values())
                    if len(per) > 1
                    else ""
                )
                console.print(
                    f"    ok {r['completed']}, failed {r['failed']}, hit {r['hit_rate'] or 0:.1%}"
                    f", TTFT p50 {_ms(r['median_ttft_ms'])} p99 {_ms(r['p99_ttft_ms'])} s{spread}",
                    markup=False,
                )
            else:
                console.print(f"    {t.status}: {t.reason}", markup=False)

    replicas = args.gateways
    predicted = (
        {}
        if args.no_predict
        else predict(trace, fleet, specs, slo, args.seed, replicas=replicas, share=share)
    )
    # The bounds over what the fleet serves: a refused request's prompt is neither in a
    # policy's hit rate nor in any cache (FleetSpec.servable).
    served = fleet.spec().servable(trace.requests)
    bound = cache_bound(served)
    pooled = cache_bound(served, fleet.workers * fleet.num_blocks * fleet.block_size)
    floor = dist(fleet.spec().ttft_floor(trace.requests))
    report = {
        "targets": [
            {
                "name": t.name,
                "kind": t.kind,
                "status": t.status,
                "reason": t.reason,
                "result": t.result,
                "predicted": predicted.get(t.spec.label) if t.spec else None,
            }
            for t in targets
        ],
        "trace": {
            **trace.meta(),
            "describe": trace.describe(),
            "pacing": pacing,
            "bound": bound.to_json(),
            "pooled_bound": pooled.to_json(),
            "ttft_floor": floor,
        },
        "fleet": {
            "workers": fleet.workers,
            "num_blocks": fleet.num_blocks,
            "block_size": fleet.block_size,
            "profile": fleet.profile,
            "gpu_slowdown": fleet.gpu_slowdown,
        },
        "fleet_describe": fleet.describe(),
        "gateways": args.gateways,
        "cluster": args.gateways > 1 and cluster,
        "prediction": None
        if args.no_predict
        else {"replicas": replicas, **share.to_json(replicas)},
        "replay": {
            "endpoint": args.endpoint,
            "max_concurrency": args.max_concurrency,
            "spread": "uniform at random over the gateways, seeded by --seed"
            if args.gateways > 1
            else None,
        },
        "slo": slo.to_json(),
        "slo_describe": slo.describe(),
        "seed": args.seed,
        "machine": machine(),
        "wall_s": time.monotonic() - t0,
        "ttft_dist_s": {
            t.name: dist([x for x in t.result.get("ttfts_s", []) if x is not None])
            for t in targets
            if t.status == "ok"
        },
    }
    (out / "compare.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    md = markdown(report)
    (out / "compare.md").write_text(md, encoding="utf-8")
    pngs = plots(report, out)
    print_table(console, console_table(report, args.wide))
    for t in targets:
        if t.status != "ok":
            console.print(f"not measured: {t.name}: {t.status}: {t.reason}", markup=False)
    console.print(
        f"wrote {shown(out / 'compare.md')}, compare.json, {', '.join(p.name for p in pngs)} "
        f"in {report['wall_s']:.0f} s",
        markup=False,
    )
    return 0 if all(t.status == "ok" for t in targets if t.kind != "peer") else 1


if __name__ == "__main__":
    sys.exit(main())
