"""How many simulated vLLM workers one CPU core sustains.

    .venv/bin/kvgate bench sim_capacity [--levels 1,8,16,32,48,64,96,128] [--streams-per-worker 8]

Why: fleet-scale tests and routing benches run 8-32 simulated workers on one small machine. That
is only meaningful while the simulator keeps its modelled timing; once the event loop is saturated,
every worker's inter-token latency (ITL) stretches and the benchmark measures Python, not routing.

Method: for each fleet size N, `kvgate sim --workers N` (one process) is started pinned to one core
with `os.sched_setaffinity`; a load generator in another process (pinned to the remaining cores)
keeps `streams-per-worker` streaming chat requests in flight per worker (closed loop: a finished
request is immediately replaced), each with a ~1,500-character prompt (a shared system prompt plus
a unique question) and `max_tokens` output tokens. The generator speaks raw HTTP/1.1 over
keep-alive connections and only looks for SSE events (`bench.sse_client.stream_http1`, whose
docstring defines the timings), so it stays far cheaper than the server.

Reported per level: completed requests/s and streamed tokens/s (all on the sim's one core), TTFT
and time-per-output-token (TPOT, the mean ITL of a request) percentiles, and the CPU share used by
the sim and by the generator. The per-worker load is identical at every level, so the modelled ITL
is too: the 1-worker level is the reference, and a level "keeps up" while its median TPOT stays
within `--tolerance` (20%) of it. The run stops at the first level that does not keep up and
prints the largest N that did. Each run is bounded (about 10 s per level, < 2 min in all).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.metrics import nearest_rank
from bench.peers import free_ports
from bench.sse_client import stream_http1

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_SYSTEM_PROMPT = (
    "You are a careful assistant for an operations team. Answer with short, precise sentences, "
    "cite the runbook section you rely on, and never invent metrics you were not given. "
) * 5


@dataclass(slots=True)
class LevelResult:
    workers: int
    streams: int
    window_s: float
    requests: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    sim_cpu: float = 0.0
    client_cpu: float = 0.0
    max_tokens: int = 0

    @property
    def req_s(self) -> float:
        return self.requests / self.window_s

    @property
    def tok_s(self) -> float:
        return self.requests * self.max_tokens / self.window_s

    def pct(self, values: list[float], q: float) -> float:
        """q in 0..1, nearest rank (bench.metrics: the one percentile definition)."""
        return nearest_rank(sorted(values), q * 100)


# ----------------------------------------------------------------------------------------------
# Load generator (runs in its own process)
# ----------------------------------------------------------------------------------------------


def _request_bytes(port: int, i: int, max_tokens: int) -> bytes:
    body = orjson.dumps(
        {
            "model": "sim-llama",
            "messages": [
                {"role": "system", "content": _SYSTEM_PROMPT},
                {"role": "user", "content": f"Question {i}: what should I check first on {port}?"},
            ],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _stream_loop(
    port: int,
    seed: int,
    max_tokens: int,
    measure_from: float,
    stop_at: float,
    out: dict[str, Any],
) -> None:
    """One closed-loop client: a keep-alive connection, one streaming request after another."""
    i = seed
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        while time.perf_counter() < stop_at:
            i += 1
            res = await stream_http1(reader, writer, _request_bytes(port, i, max_tokens))
            if res.error is not None or res.ttft is None or res.e2e is None:
                out["errors"] += 1
                return
            last = res.sent_at + res.e2e
            if measure_from <= last <= stop_at:
                out["requests"] += 1
                out["ttft"].append(res.ttft)
                if max_tokens > 1:
                    out["tpot"].append((res.e2e - res.ttft) / (max_tokens - 1))
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _drive(
    ports: list[int], streams: int, max_tokens: int, warmup_s: float, window_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": 0, "errors": 0, "ttft": [], "tpot": []}
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop_at = measure_from + window_s
    tasks = [
        _stream_loop(port, 1_000_000 * k + 1000 * j, max_tokens, measure_from, stop_at, out)
        for k, port in enumerate(ports)
        for j in range(streams)
    ]
    for res in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(res, BaseException):
            out["errors"] += 1
            out.setdefault("first_error", repr(res))
    return out


def _client_main(
    conn: Connection,
    ports: list[int],
    streams: int,
    max_tokens: int,
    warmup_s: float,
    window_s: float,
    cores: list[int],
) -> None:
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, cores)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    cpu0 = time.process_time()
    result = run(_drive(ports, streams, max_tokens, warmup_s, window_s))
    result["cpu_s"] = time.process_time() - cpu0
    conn.send(result)
    conn.close()


# ----------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / _CLK_TCK


def _wait_up(proc: subprocess.Popen[bytes], ports: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(ports)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(f"simulator exited early with {proc.returncode}")
        try:
            with socket.create_connection((HOST, pending[0]), timeout=0.5):
                pending.pop(0)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("simulator did not start in time") from None
            time.sleep(0.05)


def run_level(
    n: int,
    args: argparse.Namespace,
    sim_core: int,
    client_cores: list[int],
) -> LevelResult:
    base = free_ports(n)
    ports = list(range(base, base + n))
    cmd = [
        sys.executable,
        "-m",
        "workers.sim.cli",
        "--workers",
        str(n),
        "--port",
        str(base),
        "--profile",
        args.profile,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.sched_setaffinity(0, {sim_core}),
    )
    try:
        _wait_up(proc, ports)
        parent, child = mp.get_context("spawn").Pipe(duplex=False)
        client = mp.get_context("spawn").Process(
            target=_client_main,
            args=(
                child,
                ports,
                args.streams_per_worker,
                args.max_tokens,
                args.warmup,
                args.window,
                client_cores,
            ),
        )
        client.start()
        time.sleep(args.warmup)
        cpu0, t0 = _proc_cpu_s(proc.pid), time.monotonic()
        data = parent.recv()
        cpu1, t1 = _proc_cpu_s(proc.pid), time.monotonic()
        client.join(timeout=10)
        res = LevelResult(
            workers=n,
            streams=n * args.streams_per_worker,
            window_s=args.window,
            requests=data["requests"],
            errors=data["errors"],
            ttft=data["ttft"],
            tpot=data["tpot"],
            sim_cpu=(cpu1 - cpu0) / max(t1 - t0, 1e-9),
            client_cpu=data["cpu_s"] / (args.warmup + args.window),
            max_tokens=args.max_tokens,
        )
        if "first_error" in data:
            print(f"{n} workers: {data['errors']} client errors, first: {data['first_error']}")
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _keeps_up(r: LevelResult, ref: float, tolerance: float) -> bool:
    return r.errors == 0 and r.requests > 0 and r.pct(r.tpot, 0.5) <= ref * (1 + tolerance)


def _table(results: list[LevelResult], ref: float | None, tolerance: float, profile: str) -> Table:
    t = Table(title=f"Simulated workers on one core (profile={profile})")
    for col in (
        "workers",
        "streams",
        "req/s",
        "tokens/s",
        "tok/s/worker",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "TPOT p90 ms",
        "TPOT vs 1 worker",
        "sim CPU",
        "client CPU",
        "errors",
        "keeps up",
    ):
        t.add_column(col, justify="right")
    for r in results:
        p50 = r.pct(r.tpot, 0.5)
        ratio = p50 / ref if ref else float("nan")
        ok = ref is not None and _keeps_up(r, ref, tolerance)
        t.add_row(
            str(r.workers),
            str(r.streams),
            f"{r.req_s:,.1f}",
            f"{r.tok_s:,.0f}",
            f"{r.tok_s / r.workers:,.0f}",
            f"{r.pct(r.ttft, 0.5) * 1000:.1f}",
            f"{p50 * 1000:.2f}",
            f"{r.pct(r.tpot, 0.9) * 1000:.2f}",
            f"{ratio:.2f}x",
            f"{r.sim_cpu:.0%}",
            f"{r.client_cpu:.0%}",
            str(r.errors),
            "yes" if ok else "[red]no[/red]",
        )
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench sim_capacity", description=__doc__)
    p.add_argument(
        "--levels",
        default="1,8,16,32,48,64,96,128",
        help="fleet sizes to try, ascending (default: %(default)s)",
    )
    p.add_argument("--streams-per-worker", type=int, default=8, help="concurrent streams/worker")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--profile", default="default", help="timing profile of the simulated workers")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring a level")
    p.add_argument("--window", type=float, default=5.0, help="seconds measured per level")
    p.add_argument("--tolerance", type=float, default=0.2, help="allowed TPOT growth vs 1 worker")
    p.add_argument("--budget", type=float, default=110.0, help="stop starting levels after this")
    args = p.parse_args(argv)
    levels = sorted({int(x) for x in args.levels.split(",") if x.strip()})

    cores = sorted(os.sched_getaffinity(0))
    sim_core = cores[0]
    client_cores = cores[1:] or cores
    console = Console(width=None if sys.stdout.isatty() else 150)
    if len(cores) < 2:
        console.print("[yellow]one core only: the load generator shares the sim's core[/yellow]")
    console.print(
        f"sim pinned to core {sim_core}; load generator on cores {client_cores}; "
        f"{args.streams_per_worker} streams/worker x {args.max_tokens} tokens, closed loop"
    )

    results: list[LevelResult] = []
    ref: float | None = None
    started = time.monotonic()
    sustained = 0
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} levels"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=len(levels))
        for n in levels:
            if time.monotonic() - started > args.budget:
                console.print(f"[yellow]time budget reached before {n} workers[/yellow]")
                break
            progress.update(task, description=f"{n} workers")
            r = run_level(n, args, sim_core, client_cores)
            if ref is not None and not _keeps_up(r, ref, args.tolerance):
                # The machine may be shared: confirm a miss once before calling it saturation.
                progress.update(task, description=f"{n} workers (confirming)")
                r = run_level(n, args, sim_core, client_cores)
            results.append(r)
            progress.advance(task)
            if ref is None:
                ref = r.pct(r.tpot, 0.5)
            if _keeps_up(r, ref, args.tolerance):
                sustained = n
            else:
                break

    console.print(_table(results, ref, args.tolerance, args.profile))
    best = max((r for r in results if r.workers == sustained), key=lambda r: r.tok_s, default=None)
    if best is not None:
        console.print(
            f"One core sustains [bold]{sustained}[/bold] workers at this load: "
            f"{best.req_s:,.1f} requests/s, {best.tok_s:,.0f} streamed tokens/s "
            f"(TPOT within {args.tolerance:.0%} of the 1-worker reference, "
            f"{(ref or 0.0) * 1000:.2f} ms)."
        )
    last = results[-1] if results else None
    if last is not None and last.client_cpu > 0.9:
        console.print("[yellow]the load generator was near 100% CPU: figures are a lower bound")
    if last is not None and last.workers != sustained and last.sim_cpu < 0.85:
        console.print(
            "[yellow]the sim missed its timing below 85% CPU of its core: another process was "
            "probably competing for that core; rerun on a quiet machine for a firm figure"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
