"""Instructions per request: what a router's CPU does per short stream, counted rather than timed.

    .venv/bin/kvgate bench instructions                     # kvgate, default config
    .venv/bin/kvgate bench instructions --peers smg         # + a peer router, same requests

Why counted. On a shared 2-core machine a router's CPU time per request moves by 15-20% from one
run to the next (the same commit measured 25% slower one day than the day before), so a change
worth 5% cannot be seen end to end. Valgrind's callgrind counts the instructions the router's
process executes, every thread of it, while a fixed number of requests pass through: for the same
code and the same requests the count repeats to within ~0.3% whatever else the machine is doing.

What it is not: time. A cache miss costs no more than a hit, a PGO-built interpreter shows only
its fewer instructions, and under valgrind the router runs ~50x slower, so work done per second
(timers, the request log's writer thread, the config watcher) weighs more per request than it
would. `bench overhead`'s CPU ms per request on a quiet machine stays the figure of record; this
is the instrument for deciding between two versions of the code (run it before and after), and
for a like-for-like look at how much work a peer does on the same requests. On 2026-11-25 it gave
kvgate 1.19x smg's instructions per request at commit 5a4b95c, where `bench overhead` had
measured 1.25-1.39x smg's CPU time the day before.

Setup: one simulated worker (`kvgate sim --profile instant`, started as `bench overhead` starts
it) on the first core, the router on the last one under `valgrind --tool=callgrind
--instr-atstart=no`, warmed with `--warmup` requests;
then counting is switched on (`callgrind_control -i on`) for `--requests` requests at
`--concurrency` in flight (a closed loop; unique ~4,000-character prompts, `max_tokens` 16, as
`bench overhead` sends), switched off, and the count dumped. kvgate runs its default config (the
request log on, kv_aware), its config file in a directory of its own: a config beside a log the
router writes would wake the config watcher on every write, which no deployment does. Writes
`bench/out/instructions.json` and `instructions.png`, and keeps each dump beside them for
`callgrind_annotate` (the top functions by own instructions are in the table and the JSON).
Needs valgrind (`apt-get install valgrind`); peers install as in `bench compare`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.metrics import machine
from bench.overhead import MODEL, CoreLayout, Prompts, kvgate_default_toml, start_sim_fleet
from bench.paths import out_path, shown
from bench.peers import (
    HOST,
    PEERS,
    Proc,
    ensure_peer,
    free_ports,
    peer_command,
    start,
    wait_for,
    warm,
)

_TOTAL = re.compile(r"^totals:\s+(\d+)", re.M)
_ANNOTATED = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*?)\s*$")


def callgrind_total(text: str) -> int:
    """A callgrind dump's instruction count: its ``totals:`` line, at the end (a dump made with
    ``callgrind_control -d`` also carries a ``summary: 0`` line near the top)."""
    found = _TOTAL.findall(text)
    if not found:
        raise ValueError("no totals line: not a whole callgrind dump")
    return int(found[-1])


def top_functions(annotated: str, n: int) -> list[tuple[str, int]]:
    """The first ``n`` (function, own instructions) rows of ``callgrind_annotate``'s output, with
    the build paths that make them unreadable cut to the file's name."""
    rows: list[tuple[str, int]] = []
    started = False
    for line in annotated.splitlines():
        if not started:
            started = "file:function" in line
            continue
        m = _ANNOTATED.match(line)
        if m is None:
            continue
        where = m.group(2).split(" [", 1)[0]
        file, _, fn = where.partition(":")  # paths hold no colon; Rust names do
        name = fn if file == "???" or not fn else f"{Path(file).name}:{fn}"
        rows.append((name, int(m.group(1).replace(",", ""))))
        if len(rows) >= n:
            break
    return rows


async def drive(
    url: str, concurrency: int, n: int, prompts: Prompts, tick: Callable[[], None]
) -> int:
    """``n`` streaming chat requests, ``concurrency`` at a time (closed loop); returns how many
    failed (not a 200 ending in ``[DONE]``)."""
    sent = errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def user() -> None:
            nonlocal sent, errors
            while sent < n:
                sent += 1
                body = {
                    "model": MODEL,
                    "stream": True,
                    "max_tokens": 16,
                    "messages": [{"role": "user", "content": prompts.next()}],
                }
                tail = b""
                try:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        async for chunk in r.content.iter_any():
                            tail = (tail + chunk)[-32:]
                        ok = r.status == 200 and b"[DONE]" in tail
                except (TimeoutError, aiohttp.ClientError):
                    ok = False
                errors += not ok
                tick()

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return errors


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def measure(
    name: str,
    argv: list[str],
    url: str,
    args: argparse.Namespace,
    out_dir: Path,
    prog: Progress,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start ``argv`` under callgrind on the router core, warm it, count ``args.requests``."""
    dump = out_dir / f"{name}.callgrind"
    for old in out_dir.glob(f"{name}.callgrind*"):
        old.unlink()
    vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dump}.%p"]
    task = prog.add_task(f"{name}: starting under valgrind", total=args.warmup + args.requests)
    proc: Proc = start(name, [*vg, *argv], out_dir / "logs", env, cores=[args.router_core])
    try:
        wait_for(lambda: warm(url), proc, args.ready_timeout, name)
        prompts = Prompts(name, args.seed, 4000)
        prog.update(task, description=f"{name}: warm-up")
        asyncio.run(drive(url, args.concurrency, args.warmup, prompts, lambda: prog.advance(task)))
        prog.update(task, description=f"{name}: counting")
        _control(proc.popen.pid, "-i", "on")
        errors = asyncio.run(
            drive(url, args.concurrency, args.requests, prompts, lambda: prog.advance(task))
        )
        _control(proc.popen.pid, "-i", "off")
        _control(proc.popen.pid, "-d")
    finally:
        proc.stop()
    dumps = sorted(out_dir.glob(f"{name}.callgrind.{proc.popen.pid}.*"))
    if not dumps:
        raise RuntimeError(f"{name}: callgrind wrote no dump: {proc.tail()}")
    path = dumps[0]
    total = callgrind_total(path.read_text(errors="replace"))
    top: list[tuple[str, int]] = []
    if args.top and shutil.which("callgrind_annotate"):
        text = subprocess.run(
            ["callgrind_annotate", str(path)], capture_output=True, text=True, check=False
        ).stdout
        top = top_functions(text, args.top)
    prog.update(task, description=f"{name}: done")
    return {
        "name": name,
        "status": "ok",
        "requests": args.requests,
        "errors": errors,
        "instructions": total,
        "per_request": round(total / args.requests),
        "dump": str(path),
        "top": [{"function": f, "per_request": round(ir / args.requests)} for f, ir in top],
    }


def _kvgate(
    sim: str, args: argparse.Namespace, out_dir: Path
) -> tuple[list[str], str, dict[str, str] | None]:
    port = free_ports(1)
    cfg_dir = out_dir / "kvgate-config"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    cfg = cfg_dir / "kvgate.toml"
    cfg.write_text(kvgate_default_toml(port, [sim], args.policy), encoding="utf-8")
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)]
    return argv, f"http://{HOST}:{port}", None


def _peer(name: str, sim: str, venv: Path) -> tuple[list[str], str, dict[str, str] | None]:
    argv, url, env = peer_command(PEERS[name], venv, [sim])
    with open(argv[0], "rb") as f:  # a console script: valgrind runs its interpreter
        if f.read(2) == b"#!":
            argv = [str(venv / "bin" / "python"), *argv]
    return argv, url, env


def table(report: dict[str, Any]) -> Table:
    t = Table(title="instructions per request (callgrind; every thread of the router)")
    for col in ("target", "requests", "errors", "instructions / request", "x kvgate"):
        t.add_column(col, justify="left" if col == "target" else "right")
    base = next((r["per_request"] for r in report["targets"] if r["name"] == "kvgate"), None)
    for r in report["targets"]:
        if r["status"] != "ok":
            t.add_row(r["name"], "-", "-", r["status"], "")
            continue
        ratio = f"{r['per_request'] / base:.2f}" if base else "-"
        t.add_row(r["name"], f"{r['requests']:,}", str(r["errors"]), f"{r['per_request']:,}", ratio)
    return t


def top_table(r: dict[str, Any]) -> Table:
    t = Table(title=f"{r['name']}: top functions by own instructions, per request")
    t.add_column("function", overflow="fold")
    t.add_column("instructions", justify="right")
    t.add_column("share", justify="right")
    for x in r["top"]:
        t.add_row(
            x["function"], f"{x['per_request']:,}", f"{x['per_request'] / r['per_request']:.1%}"
        )
    return t


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["targets"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.5 * max(1, len(ok))))
    ax.barh([r["name"] for r in ok], [r["per_request"] / 1e6 for r in ok])
    for i, r in enumerate(ok):
        ax.text(r["per_request"] / 1e6, i, f" {r['per_request'] / 1e6:.3f}M", va="center")
    ax.set_xlabel("million instructions per request (callgrind)")
    ax.invert_yaxis()
    s = report["setup"]
    ax.set_title(
        textwrap.fill(
            f"{s['requests']} streaming requests at {s['concurrency']} in flight, unique "
            "~4,000-char prompts, max_tokens 16, one simulated worker",
            90,
        ),
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvgate bench instructions",
        description="Instructions per request a router executes (valgrind callgrind): a count "
        "that repeats to ~0.3%, for before/after comparisons on a noisy machine.",
    )
    p.add_argument("--peers", default="", help="peer routers too, comma-separated: smg,...")
    p.add_argument("--no-kvgate", action="store_true", help="measure only the peers")
    p.add_argument("--policy", default=None, help="kvgate's routing policy (default: its own)")
    p.add_argument("--requests", type=int, default=600, help="requests counted (default 600)")
    p.add_argument("--warmup", type=int, default=100, help="requests before counting")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--top", type=int, default=8, help="top functions by own instructions")
    p.add_argument("--seed", type=int, default=1, help="prompt text seed")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to start")
    p.add_argument("--json", type=Path, default=out_path("instructions.json"))
    p.add_argument("--plot", type=Path, default=out_path("instructions.png"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    con = Console()
    missing = [t for t in ("valgrind", "callgrind_control") if shutil.which(t) is None]
    if missing:
        con.print(f"needs {', '.join(missing)}: apt-get install valgrind")
        return 2
    if args.requests <= 0 or args.concurrency <= 0:
        con.print("--requests and --concurrency must be positive")
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    args.router_core = cpus[-1]
    out_dir = args.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [] if args.no_kvgate else ["kvgate"]
    names += [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n != "kvgate" and n not in PEERS]
    if unknown:
        con.print(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
        return 2
    layout = CoreLayout(len(cpus), cpus[-1], (frozenset({cpus[0]}),), (), True)
    sims, urls = start_sim_fleet(layout, out_dir / "logs")
    sim_url = urls[0]
    results: list[dict[str, Any]] = []
    try:
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*cols, TimeElapsedColumn(), console=con) as prog:
            for name in names:
                if name == "kvgate":
                    cmd, url, env = _kvgate(sim_url, args, out_dir)
                else:
                    venv, why = ensure_peer(PEERS[name])
                    if venv is None:
                        results.append({"name": name, "status": f"not measured: {why}"})
                        continue
                    cmd, url, env = _peer(name, sim_url, venv)
                try:
                    results.append(measure(name, cmd, url, args, out_dir, prog, env))
                except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
                    results.append({"name": name, "status": f"failed: {e}"[:300]})
    finally:
        for p in sims:
            p.stop()
    report = {
        "tool": "instructions",
        "machine": machine(),
        "setup": {
            "requests": args.requests,
            "warmup": args.warmup,
            "concurrency": args.concurrency,
            "prompt_chars": 4000,
            "max_tokens": 16,
            "policy": args.policy,
        },
        "targets": results,
    }
    args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    con.print(table(report))
    for r in results:
        if r["status"] == "ok" and r["top"]:
            con.print(top_table(r))
    png = plot(report, args.plot)
    con.print(f"wrote {shown(args.json)}, {shown(png)}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
