"""Soak: constant open-loop load at 80% of the simulated fleet's capacity for 10 minutes, watching
the gateway's memory, latency drift and leftovers. A bench run, not CI.

    .venv/bin/kvgate bench soak                                # 600 s after set-up
    .venv/bin/kvgate bench soak --duration 60 --out /tmp/soak  # a quick validation
    mkdir -p bench/out; nohup .venv/bin/kvgate bench soak --no-progress >bench/out/soak.log 2>&1 &

Why: slow leaks (a reservation, a lease, a per-request dict entry, a socket) do not show in a
30-second benchmark or a unit test; they show as RSS that keeps growing and as in-flight gauges
that do not return to zero once the load stops. So the gateway runs as the product runs it
(`python -m gateway.cli serve --config <generated toml>`, its own process pinned to the last core,
so VmRSS is the gateway's alone), with several tenants of different priorities sending Poisson
traffic at `--load` x the measured capacity, and the report gives:

* requests served, errors by kind and HTTP status;
* gateway RSS (and open file descriptors) before the load, once warm (`--warmup-s`), at the end,
  and the growth in % (sampled every `--sample-s`);
* TTFT p50/p99 per minute (per `--bucket-s`), to see drift;
* the quiescence check: after the last response, /metrics must show kvgate_tenant_in_flight and
  kvgate_worker_in_flight at 0 for every tenant and worker.

Fleet, request shape and capacity measurement are bench/spike.py's (same flags). Outputs:
`soak.json`, `soak_records.jsonl`, `soak.png` (RSS and TTFT p99 over time), `gateway.log`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.metrics import dist, machine
from bench.paths import out_path
from bench.spike import (
    Client,
    CpuMeter,
    FleetSpec,
    GatewaySpec,
    Outcome,
    Phases,
    Shot,
    TenantSpec,
    add_fleet_args,
    chat_body,
    closed_run,
    core_plan,
    fleet_from_args,
    free_ports,
    gateway_process,
    gateway_toml,
    open_loop,
    pinned,
    rss_bytes,
    scrape,
    sim_fleet,
    summarize,
    warm_up,
)

DEFAULT_TENANTS = "interactive:0.9:0.3,standard:0.5:0.4,batch:0.2:0.3"
QUIESCENCE = ("kvgate_tenant_in_flight", "kvgate_worker_in_flight")
DEFAULT_OUT = out_path("soak")  # git-ignored, like every bench output


@dataclass(slots=True)
class SoakOptions:
    fleet: FleetSpec = field(default_factory=FleetSpec)
    # The gateway's own defaults: a soak is about staying healthy, not about priorities.
    gateway: GatewaySpec = field(default_factory=lambda: GatewaySpec(priority_reserve=0.1))
    tenants: tuple[tuple[TenantSpec, float], ...] = ()  # (tenant, share of the load)
    prompt_tokens: int = 256
    max_tokens: int = 128
    capacity: float = 0.0  # requests/s; 0 = measure
    capacity_s: float = 8.0
    load: float = 0.8
    duration_s: float = 600.0
    warmup_s: float = 30.0
    bucket_s: float = 0.0  # 0 = a minute, or a sixth of a short run
    sample_s: float = 2.0
    client_timeout_s: float = 30.0
    max_in_flight: int = 2000
    seed: int = 1
    pin: bool = True
    quiesce_timeout_s: float = 15.0
    out: Path | None = DEFAULT_OUT
    show_progress: bool = True

    def bucket(self) -> float:
        if self.bucket_s > 0:
            return self.bucket_s
        return 60.0 if self.duration_s >= 360 else max(10.0, self.duration_s / 6)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out) if self.out is not None else None
        d["tenants"] = [{**asdict(t), "share": s} for t, s in self.tenants]
        d["bucket_s"] = self.bucket()
        return d


def parse_tenants(text: str) -> tuple[tuple[TenantSpec, float], ...]:
    """`name:priority:share,...` -> tenants with their share of the load (normalized)."""
    out = []
    for part in text.split(","):
        name, prio, share = part.split(":")
        out.append((TenantSpec(name, float(prio)), float(share)))
    total = sum(s for _, s in out)
    if not out or total <= 0:
        raise ValueError("--tenants needs at least one tenant with a positive share")
    return tuple((t, s / total) for t, s in out)


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def soak_shots(opts: SoakOptions, rate: float) -> Iterator[Shot]:
    """Poisson arrivals at `rate`, each request's tenant drawn by share; lazy, so ten minutes of
    prompts are never held at once."""
    rng = random.Random(f"{opts.seed}:soak")
    names = [t.name for t, _ in opts.tenants]
    shares = [s for _, s in opts.tenants]
    t = rng.expovariate(rate)
    while t < opts.duration_s:
        tenant = rng.choices(names, weights=shares)[0]
        yield Shot(t, tenant, chat_body(rng, opts.prompt_tokens, opts.max_tokens))
        t += rng.expovariate(rate)


async def _sampler(
    pid: int,
    period: float,
    samples: list[dict[str, Any]],
    counts: Counter[str],
    t0: float,
    stop: asyncio.Event,
    tick: Any,
) -> None:
    while not stop.is_set():
        rss = rss_bytes(pid)
        s = {
            "t": round(time.monotonic() - t0, 2),
            "rss_bytes": rss,
            "fds": fd_count(pid),
            "sent": counts["sent"],
            "ok": counts["ok"],
            "failed": counts["failed"],
        }
        samples.append(s)
        tick(s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period)


async def _soak(
    client: Client,
    opts: SoakOptions,
    rate: float,
    pid: int,
    samples: list[dict[str, Any]],
    tick: Any,
) -> list[Outcome]:
    counts: Counter[str] = Counter()
    stop = asyncio.Event()
    t0 = time.monotonic()

    def done(o: Outcome) -> None:
        counts["ok" if o.ok else "failed"] += 1

    def shots() -> Iterator[Shot]:
        for s in soak_shots(opts, rate):
            counts["sent"] += 1
            yield s

    sampler = asyncio.create_task(_sampler(pid, opts.sample_s, samples, counts, t0, stop, tick))
    try:
        async with client:
            return await open_loop(client, shots(), max_in_flight=opts.max_in_flight, on_done=done)
    finally:
        stop.set()
        await sampler


async def quiescence(url: str, timeout: float) -> dict[str, Any]:
    """The in-flight gauges from /metrics until all are 0 (or `timeout`)."""
    t0 = time.monotonic()
    while True:
        g = await scrape(url, QUIESCENCE)
        held = {k: v for k, v in g.items() if v}
        if not held or time.monotonic() - t0 > timeout:
            return {
                "quiescent": not held,
                "held": held,
                "gauges": g,
                "settle_s": round(time.monotonic() - t0, 3),
            }
        await asyncio.sleep(0.2)


def buckets(outs: Sequence[Outcome], width: float, samples: Sequence[dict[str, Any]]) -> list[Any]:
    """Per-interval figures by send time, with the RSS sampled at the interval's end."""
    n = max(1, math.ceil(max((o.t_sched for o in outs), default=0.0) / width + 1e-9))
    rows = []
    for b in range(n):
        lo, hi = b * width, (b + 1) * width
        rs = [o for o in outs if lo <= o.t_sched < hi]
        ok = [o for o in rs if o.ok]
        d = dist([o.ttft for o in ok if o.ttft is not None])
        rss = [s["rss_bytes"] for s in samples if s["t"] <= hi and s["rss_bytes"]]
        rows.append(
            {
                "from_s": lo,
                "to_s": hi,
                "sent": len(rs),
                "ok": len(ok),
                "failed": len(rs) - len(ok),
                "ttft_p50_s": d["p50"],
                "ttft_p99_s": d["p99"],
                "rss_bytes": rss[-1] if rss else None,
            }
        )
    return rows


def run_soak(opts: SoakOptions, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    gw_cores, other = core_plan(opts.pin)
    tenants = [t for t, _ in opts.tenants]
    top = max(tenants, key=lambda t: t.priority)
    out = opts.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "bench": "soak",
        "config": opts.to_json(),
        "machine": machine(),
        "topology": {
            "gateway": "python -m gateway.cli serve --config <generated>",
            "gateway_cores": sorted(gw_cores) if gw_cores else "unpinned",
            "sims_and_load_generator_cores": sorted(other) if other else "unpinned",
        },
    }
    body_rng = random.Random(f"{opts.seed}:capacity")
    samples: list[dict[str, Any]] = []
    with (
        pinned(other),
        sim_fleet(opts.fleet, other, out / "sim.log" if out else None) as sims,
        Phases(console, opts.show_progress) as ph,
    ):
        port = free_ports(1)
        toml = gateway_toml(opts.fleet, sims.urls, port, tenants, opts.gateway)
        log = out / "gateway.log" if out else None
        with gateway_process(toml, port, gw_cores, log, inspect=False) as gw:
            pid = gw.proc.pid
            res["gateway_pid"] = pid
            rss_idle, fds_idle = rss_bytes(pid), fd_count(pid)
            client = Client(gw.url, tenants, ttft_timeout=opts.client_timeout_s)
            ph.run(warm_up(client, tenants, opts.seed, opts.prompt_tokens))
            if opts.capacity > 0:
                cap: dict[str, Any] = {"requests_per_s": opts.capacity, "measured": False}
            else:
                tid, cdone = ph.task("capacity (closed loop)", None)
                cap = ph.run(
                    closed_run(
                        client,
                        top.name,
                        lambda k, i: chat_body(body_rng, opts.prompt_tokens, opts.max_tokens),
                        opts.fleet.slots,
                        opts.capacity_s,
                        cdone,
                    )
                )
                cap["measured"] = True
                ph.finish(tid)
            cap["slots"] = opts.fleet.slots
            res["capacity"] = cap
            rate = opts.load * cap["requests_per_s"]
            res["rate_per_s"] = rate
            time.sleep(2.0)  # the capacity run's streams finish; RSS "start" is a quiet gateway
            rss_start, fds_start = rss_bytes(pid), fd_count(pid)
            tid, _ = ph.task(f"soak {opts.load:.0%} of capacity", opts.duration_s)

            def tick(s: dict[str, Any]) -> None:
                rss = s["rss_bytes"] or 0
                ph.progress.update(
                    tid,
                    completed=min(s["t"], opts.duration_s),
                    note=f"sent={s['sent']} ok={s['ok']} failed={s['failed']} "
                    f"rss={rss / 2**20:.1f} MiB fds={s['fds']}",
                )

            meter = CpuMeter({"gateway": pid, "sims": sims.proc.pid, "load_generator": os.getpid()})
            meter.start()
            t0 = time.monotonic()
            outs = ph.run(_soak(client, opts, rate, pid, samples, tick))
            wall = time.monotonic() - t0
            cpu = meter.stop()
            ph.finish(tid)
            q = ph.run(quiescence(gw.url, opts.quiesce_timeout_s))
            rss_end, fds_end = rss_bytes(pid), fd_count(pid)
            adm = ph.run(scrape(gw.url, ("kvgate_admission_outcomes", "kvgate_rejected")))
            alive = gw.proc.popen.poll() is None
    warm = [s["rss_bytes"] for s in samples if s["t"] >= opts.warmup_s and s["rss_bytes"]]
    rss_warm = warm[0] if warm else rss_start

    def growth(a: int | None, b: int | None) -> float | None:
        return None if not a or b is None else (b - a) / a * 100.0

    summary = summarize(outs, opts.duration_s)
    statuses: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for o in outs:
        if not o.ok:
            statuses[str(o.status)] += 1
            kinds[o.error or "?"] += 1
    ok = [o for o in outs if o.ok]
    res.update(
        {
            "wall_s": round(wall, 3),
            "cpu_cores": cpu,
            "offered": len(outs),
            "served": len(ok),
            "failed": len(outs) - len(ok),
            "errors_by_status": dict(statuses),
            "errors_by_kind": dict(kinds),
            "error_codes": dict(Counter(o.code for o in outs if o.code)),
            "ttft_s": dist([o.ttft for o in ok if o.ttft is not None]),
            "e2e_s": dist([o.e2e for o in ok if o.e2e is not None]),
            "tenants": summary,
            "rss": {
                "idle_bytes": rss_idle,
                "start_bytes": rss_start,
                "warm_bytes": rss_warm,
                "end_bytes": rss_end,
                "growth_from_start_pct": growth(rss_start, rss_end),
                "growth_from_warm_pct": growth(rss_warm, rss_end),
            },
            "fds": {"idle": fds_idle, "start": fds_start, "end": fds_end},
            "buckets": buckets(outs, opts.bucket(), samples),
            "samples": samples,
            "quiescence": q,
            "gateway_alive_at_end": alive,
            "admission_and_rejections": {k: v for k, v in adm.items() if v},
        }
    )
    if out is not None:
        (out / "soak.json").write_text(json.dumps(res, indent=2))
        with open(out / "soak_records.jsonl", "wb") as f:
            for o in outs:
                f.write(orjson.dumps(asdict(o)) + b"\n")
        with contextlib.suppress(ImportError):
            plot(res, out / "soak.png")
        res["outputs"] = [str(out / n) for n in ("soak.json", "soak_records.jsonl", "soak.png")]
    return res


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def tables(res: dict[str, Any]) -> list[Table]:
    cfg = res["config"]
    t = Table(
        title=f"Soak: {cfg['load']:.0%} of {res['capacity']['requests_per_s']:.1f} req/s "
        f"({res['rate_per_s']:.1f} req/s) for {cfg['duration_s']:g} s"
    )
    t.add_column("figure")
    t.add_column("value", justify="right")
    r = res["rss"]
    rows = [
        ("requests offered / served / failed", f"{res['offered']} / {res['served']} / "
         f"{res['failed']}"),
        ("errors by status", str(res["errors_by_status"] or "none")),
        ("errors by kind", str(res["errors_by_kind"] or "none")),
        ("TTFT p50 / p99 ms", f"{_ms(res['ttft_s']['p50'])} / {_ms(res['ttft_s']['p99'])}"),
        ("gateway RSS idle / start / warm / end MiB",
         f"{_mib(r['idle_bytes'])} / {_mib(r['start_bytes'])} / {_mib(r['warm_bytes'])} / "
         f"{_mib(r['end_bytes'])}"),
        ("RSS growth from start / from warm", f"{_pct(r['growth_from_start_pct'])} / "
         f"{_pct(r['growth_from_warm_pct'])}"),
        ("gateway fds idle / start / end",
         f"{res['fds']['idle']} / {res['fds']['start']} / {res['fds']['end']}"),
        ("CPU (cores)", ", ".join(f"{k} {v:.2f}" for k, v in res["cpu_cores"].items())),
        ("quiescent after the load",
         f"{res['quiescence']['quiescent']} ({res['quiescence']['settle_s']} s; held: "
         f"{res['quiescence']['held'] or 'nothing'})"),
    ]  # fmt: skip
    for k, v in rows:
        t.add_row(k, v)
    pt = Table(title="Per tenant")
    for c in ("tenant", "priority", "offered", "ok", "failed", "TTFT p50 ms", "p90 ms", "p99 ms"):
        pt.add_column(c, justify="right" if c != "tenant" else "left")
    prio = {t["name"]: t["priority"] for t in cfg["tenants"]}
    for name, s in res["tenants"].items():
        d = s["ttft_s"]
        pt.add_row(
            name,
            f"{prio.get(name, 0):g}",
            str(s["offered"]),
            str(s["ok"]),
            str(s["offered"] - s["ok"]),
            _ms(d["p50"]),
            _ms(d["p90"]),
            _ms(d["p99"]),
        )
    b = Table(title=f"Per {cfg['bucket_s']:g} s (by send time)")
    for c in ("from s", "sent", "ok", "failed", "TTFT p50 ms", "TTFT p99 ms", "RSS MiB"):
        b.add_column(c, justify="right")
    for row in res["buckets"]:
        b.add_row(
            f"{row['from_s']:g}",
            str(row["sent"]),
            str(row["ok"]),
            str(row["failed"]),
            _ms(row["ttft_p50_s"]),
            _ms(row["ttft_p99_s"]),
            _mib(row["rss_bytes"]),
        )
    return [t, pt, b]


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    s = [x for x in res["samples"] if x["rss_bytes"]]
    ax.plot([x["t"] for x in s], [x["rss_bytes"] / 2**20 for x in s], color="tab:blue")
    ax.set_ylabel("gateway RSS (MiB)")
    ax.axvline(res["config"]["warmup_s"], color="grey", linewidth=0.6, linestyle=":")
    ax.grid(alpha=0.3)
    ax.set_title(
        f"RSS growth {_pct(res['rss']['growth_from_start_pct'])} from start, "
        f"{_pct(res['rss']['growth_from_warm_pct'])} from warm"
    )
    rows = [r for r in res["buckets"] if r["ttft_p99_s"] is not None]
    mids = [(r["from_s"] + r["to_s"]) / 2 for r in rows]
    bx.plot(mids, [r["ttft_p99_s"] * 1000 for r in rows], marker="o", label="TTFT p99")
    bx.plot(mids, [r["ttft_p50_s"] * 1000 for r in rows], marker=".", label="TTFT p50")
    bx.set_ylabel("TTFT (ms)")
    bx.set_xlabel("seconds into the soak")
    bx.legend()
    bx.grid(alpha=0.3)
    cfg = res["config"]
    fig.suptitle(
        f"kvgate soak: {cfg['load']:.0%} of capacity ({res['rate_per_s']:.1f} req/s), "
        f"{cfg['fleet']['workers']} sim workers, {cfg['duration_s']:g} s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvgate bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_fleet_args(ap)
    g = ap.add_argument_group("soak")
    g.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    g.add_argument("--load", type=float, default=0.8, help="offered rate / capacity")
    g.add_argument(
        "--tenants", default=DEFAULT_TENANTS, help="name:priority:share,... (shares normalized)"
    )
    g.add_argument("--warmup-s", type=float, default=30.0, help="RSS reference point")
    g.add_argument("--bucket-s", type=float, default=0.0, help="report interval; 0 = a minute")
    g.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling period")
    g.add_argument("--client-timeout", type=float, default=30.0, help="first-token timeout")
    g.add_argument("--max-in-flight", type=int, default=2000)
    a = ap.add_argument_group("gateway [admission]")
    a.add_argument("--priority-reserve", type=float, default=0.1)
    a.add_argument("--deadline-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="%(default)s")
    args = ap.parse_args(argv)
    try:
        tenants = parse_tenants(args.tenants)
    except ValueError as e:
        ap.error(str(e))
    opts = SoakOptions(
        fleet=fleet_from_args(args),
        gateway=GatewaySpec(
            priority_reserve=args.priority_reserve, deadline_s=args.deadline_s, policy=args.policy
        ),
        tenants=tenants,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        capacity=args.capacity,
        capacity_s=args.capacity_s,
        load=args.load,
        duration_s=args.duration,
        warmup_s=args.warmup_s,
        bucket_s=args.bucket_s,
        sample_s=args.sample_s,
        client_timeout_s=args.client_timeout,
        max_in_flight=args.max_in_flight,
        seed=args.seed,
        pin=args.pin,
        out=args.out,
        show_progress=args.progress,
    )
    con = Console(width=None if sys.stdout.isatty() else 150)
    res = run_soak(opts, con)
    for t in tables(res):
        con.print(t)
    con.print(
        f"[dim]{res['machine']['cores']} cores ({res['machine']['cpu']}), gateway pid "
        f"{res['gateway_pid']} on {res['topology']['gateway_cores']}; outputs: "
        f"{', '.join(res.get('outputs', []))}[/dim]"
    )
    return 0 if res["quiescence"]["quiescent"] and res["gateway_alive_at_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
