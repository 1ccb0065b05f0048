"""What the gateway adds: TTFT through kvgate minus direct, and its relay capacity on one core.

    .venv/bin/kvgate bench overhead [--requests 2000] [--concurrency 1,16,100] \\
        [--clients aiohttp,httpx]                # results: bench/out/overhead.json

Topology (all on 127.0.0.1): one simulated worker with the `instant` timing profile (so the
worker's own time is ~0 and what remains is HTTP + relay), the gateway as a separate process
pinned to one core, and an aiohttp load generator in this process. Each concurrency level runs
direct to the worker first, then through the gateway for each upstream client, on the same
requests. Added latency is the difference of the percentiles, which is what a user sees.
Capacity: long streams at high concurrency; SSE events/s and requests/s the one-core gateway relays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.paths import out_path, shown

MODEL = "sim-llama"
PROMPT = ("The quick brown fox jumps over the lazy dog while the cache warms up. " * 60)[:4000]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(cores: set[int]):  # type: ignore[no-untyped-def]
    def f() -> None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)

    return f


def _wait(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready")


@contextlib.contextmanager
def _proc(cmd: list[str], cores: set[int]):  # type: ignore[no-untyped-def]
    p = subprocess.Popen(
        cmd,
        preexec_fn=_pin(cores),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


@contextlib.contextmanager
def gateway(worker_url: str, client: str, core: int, extra: str = "", policy: str = "least_loaded"):  # type: ignore[no-untyped-def]
    port = _free_port()
    cfg = (
        extra
        + f"""
[server]
port = {port}
[logging]
level = "warning"
requests = false
[probes]
interval_s = 1.0
[routing]
policy = "{policy}"
[upstream]
client = "{client}"
[[workers]]
name = "w0"
url = "{worker_url}"
"""
    )
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", f.name]
    with _proc(cmd, {core}):
        url = f"http://127.0.0.1:{port}"
        _wait(url + "/ready")
        yield url
    os.unlink(f.name)


@dataclass
class RunStats:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    events: int = 0
    errors: int = 0
    wall: float = 0.0

    def pct(self, xs: list[float], q: float) -> float:
        if not xs:
            return float("nan")
        s = sorted(xs)
        return s[min(len(s) - 1, int(q / 100 * len(s)))]


async def drive(
    url: str,
    n: int,
    concurrency: int,
    max_tokens: int,
    stream: bool,
    progress: Progress | None = None,
    key: str | None = None,
) -> RunStats:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "stream": stream,
            "ignore_eos": True,
        }
    ).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    st = RunStats()
    sem = asyncio.Semaphore(concurrency)
    task = progress.add_task(f"{url} c={concurrency}", total=n) if progress else None
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    async with session.post(
                        url + "/v1/chat/completions", data=body, headers=headers
                    ) as r:
                        if r.status != 200:
                            st.errors += 1
                            await r.read()
                            return
                        if stream:
                            first = True
                            async for chunk in r.content.iter_any():
                                if first:
                                    st.ttft.append(time.perf_counter() - t0)
                                    first = False
                                st.events += chunk.count(b"\n\n")
                        else:
                            await r.read()
                            st.ttft.append(time.perf_counter() - t0)
                    st.e2e.append(time.perf_counter() - t0)
                except aiohttp.ClientError:
                    st.errors += 1
                finally:
                    if progress is not None and task is not None:
                        progress.advance(task)

        # Warm the pools so connection setup is not measured.
        await asyncio.gather(*(one() for _ in range(min(concurrency, 20))))
        st.ttft.clear(), st.e2e.clear()
        st.events = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        st.wall = time.perf_counter() - t0
    if progress is not None and task is not None:
        progress.remove_task(task)
    return st


BENCH_KEY = "kvg-bench"


def _quota_run(mode: str, worker: str, core: int, n: int, prog: Progress) -> dict[str, object]:
    """Same load with no tenants, a tenant on the memory store, and on a real Redis."""
    from gateway.redis_server import RedisServer

    extra = ""
    redis: RedisServer | None = None
    if mode != "off":
        digest = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
        extra = (
            f'[tenants.bench]\nkeys_sha256 = ["{digest}"]\nrpm = 10000000\ntpm = 10000000000\n'
            "max_concurrent = 100000\n"
        )
        if mode == "redis":
            redis = RedisServer(_free_port())
            redis.start()
            extra += f'[quota]\nbackend = "redis"\nredis_url = "{redis.url}"\n'
    try:
        with gateway(worker, "aiohttp", core, extra) as gw:
            v = asyncio.run(drive(gw, n, 32, 16, True, prog, key=BENCH_KEY if extra else None))
    finally:
        if redis is not None:
            redis.close()
    return {
        "mode": mode,
        "rps": len(v.e2e) / v.wall,
        "p50_ms": v.pct(v.ttft, 50) * 1e3,
        "p99_ms": v.pct(v.ttft, 99) * 1e3,
        "errors": v.errors,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=2000, help="requests per measured run")
    ap.add_argument("--concurrency", default="1,16,100", help="in-flight streams, comma-separated")
    ap.add_argument(
        "--clients", default="aiohttp,httpx", help="gateway upstream clients to compare"
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per latency request")
    ap.add_argument(
        "--capacity-seconds", type=float, default=8.0, help="approximate capacity run length"
    )
    ap.add_argument(
        "--json", type=Path, default=out_path("overhead.json"), help="results: %(default)s"
    )
    ap.add_argument(
        "--quota-modes",
        default="off,memory,redis",
        help="quota backends for the requests/s comparison (off = no tenants)",
    )
    ap.add_argument("--policy", default="least_loaded", help="routing policy of the gateway")
    args = ap.parse_args(argv)
    con = Console()
    levels = [int(c) for c in args.concurrency.split(",")]
    clients = args.clients.split(",")
    ncpu = os.cpu_count() or 1
    gw_core, other = ncpu - 1, set(range(max(1, ncpu - 1)))
    port = _free_port()
    results: dict[str, object] = {
        "machine": f"{platform.machine()} {ncpu} cpu, Python {platform.python_version()}",
        "setup": f"sim worker (instant profile) + load generator on cores {sorted(other)}, "
        f"gateway pinned to core {gw_core}; prompt {len(PROMPT)} chars, "
        f"max_tokens {args.max_tokens}",
        "latency": [],
        "capacity": [],
        "quota": [],
    }
    sim_cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "sim",
        "--port",
        str(port),
        "--workers",
        "1",
        "--profile",
        "instant",
        "--model",
        MODEL,
        "--max-num-seqs",
        "1024",
    ]
    with _proc(sim_cmd, other), Progress(console=con, transient=True) as prog:
        worker = f"http://127.0.0.1:{port}"
        _wait(worker + "/health")
        for c in levels:
            d = asyncio.run(drive(worker, args.requests, c, args.max_tokens, True, prog))
            row = {
                "concurrency": c,
                "direct_p50_ms": d.pct(d.ttft, 50) * 1e3,
                "direct_p99_ms": d.pct(d.ttft, 99) * 1e3,
                "direct_rps": len(d.e2e) / d.wall,
            }
            for client in clients:
                with gateway(worker, client, gw_core, policy=args.policy) as gw:
                    v = asyncio.run(drive(gw, args.requests, c, args.max_tokens, True, prog))
                row[client] = {
                    "p50_ms": v.pct(v.ttft, 50) * 1e3,
                    "p99_ms": v.pct(v.ttft, 99) * 1e3,
                    "added_p50_ms": (v.pct(v.ttft, 50) - d.pct(d.ttft, 50)) * 1e3,
                    "added_p99_ms": (v.pct(v.ttft, 99) - d.pct(d.ttft, 99)) * 1e3,
                    "rps": len(v.e2e) / v.wall,
                    "errors": v.errors,
                }
            results["latency"].append(row)  # type: ignore[union-attr]
        # Capacity: long streams, many in flight; the gateway's one core is the limit.
        for client in clients:
            with gateway(worker, client, gw_core) as gw:
                n = max(200, int(args.capacity_seconds * 150))
                v = asyncio.run(drive(gw, n, 64, 256, True, prog))
            results["capacity"].append(  # type: ignore[union-attr]
                {
                    "client": client,
                    "events_per_s": v.events / v.wall,
                    "requests_per_s": len(v.e2e) / v.wall,
                    "errors": v.errors,
                }
            )

    quota_modes = [m for m in args.quota_modes.split(",") if m]
    if quota_modes:
        with _proc(sim_cmd, other), Progress(console=con, transient=True) as prog:
            worker = f"http://127.0.0.1:{port}"
            _wait(worker + "/health")
            for mode in quota_modes:
                results["quota"].append(  # type: ignore[union-attr]
                    _quota_run(mode, worker, gw_core, args.requests, prog)
                )

    t = Table(title="kvgate added TTFT (streaming chat, through gateway minus direct)")
    t.add_column("in flight", justify="right")
    t.add_column("direct p50/p99 ms", justify="right")
    for client in clients:
        t.add_column(f"{client}: added p50/p99 ms", justify="right")
        t.add_column(f"{client} req/s", justify="right")
    for row in results["latency"]:  # type: ignore[union-attr]
        cells = [
            str(row["concurrency"]),
            f"{row['direct_p50_ms']:.2f} / {row['direct_p99_ms']:.2f}",
        ]
        for client in clients:
            r = row[client]
            cells += [f"{r['added_p50_ms']:+.2f} / {r['added_p99_ms']:+.2f}", f"{r['rps']:.0f}"]
        t.add_row(*cells)
    con.print(t)
    t2 = Table(title="Relay capacity, gateway on one core (64 streams x 256 tokens)")
    for col in ("client", "SSE events/s", "requests/s", "errors"):
        t2.add_column(col, justify="right")
    for r in results["capacity"]:  # type: ignore[union-attr]
        t2.add_row(
            r["client"], f"{r['events_per_s']:.0f}", f"{r['requests_per_s']:.1f}", str(r["errors"])
        )
    con.print(t2)
    if results["quota"]:
        t3 = Table(title="Quotas on one gateway core (32 streams x 16 tokens, one tenant)")
        for col in ("quota backend", "requests/s", "TTFT p50 ms", "TTFT p99 ms", "errors"):
            t3.add_column(col, justify="right")
        for r in results["quota"]:  # type: ignore[union-attr]
            t3.add_row(
                r["mode"],
                f"{r['rps']:.0f}",
                f"{r['p50_ms']:.2f}",
                f"{r['p99_ms']:.2f}",
                str(r["errors"]),
            )
        con.print(t3)
    con.print(f"[dim]{results['machine']}; {results['setup']}[/dim]")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        con.print(f"wrote {shown(args.json)}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
