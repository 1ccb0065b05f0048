"""What a quota check costs: admission + settlement per request, and cycles/s on one core.

    .venv/bin/kvgate bench quota_speed [--requests 5000] [--concurrency 64] [--seconds 3]
                                       [--redis-url redis://...]

Every request goes through the full path the gateway uses: tenant RPM + TPM, a per-model RPM +
TPM, a concurrency lease, then a settle that refunds part of the reservation and frees the lease.
Limits are high enough that every request is admitted (the common case). Latency is measured
one request at a time (no queueing: the price of one check); throughput with `--concurrency`
requests in flight from this process pinned to one core: admit+settle cycles/s is the ceiling
one gateway core could sustain if it did nothing but quotas. Without `--redis-url` a throwaway
redis-server is started on 127.0.0.1 (on another core when there is one), so Redis figures
include a real loopback round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from bench.metrics import nearest_rank
from bench.redis_server import RedisServer
from gateway.quota import ModelLimits, QuotaStore, Reservation, TenantLimits
from gateway.quota_memory import MemoryQuotaStore
from gateway.quota_redis import RedisQuotaStore

MODEL = "sim-llama"
LIMITS = TenantLimits(
    rpm=10_000_000,
    tpm=10_000_000_000,
    per_model={MODEL: ModelLimits(rpm=10_000_000, tpm=10_000_000_000)},
    max_concurrent=100_000,
)
TENANTS = [f"tenant-{i}" for i in range(32)]


@dataclass
class Result:
    backend: str
    admit_p50_us: float
    admit_p99_us: float
    cycle_p50_us: float
    cycle_p99_us: float
    cycles_per_s: float


@contextlib.contextmanager
def one_core() -> Iterator[None]:
    """Pin this process to one core (the "one gateway core") for the throughput run only:
    pinned latency runs would mostly measure other tenants of a shared machine."""
    before = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, before)


def pct(xs: list[float], q: float) -> float:
    """q in 0..1, nearest rank (bench.metrics: the one percentile definition)."""
    return nearest_rank(sorted(xs), q * 100)


async def one_cycle(store: QuotaStore, i: int) -> float:
    """admit + settle one request; returns the admission's share in seconds."""
    tenant = TENANTS[i % len(TENANTS)]
    rid = f"req-{os.getpid()}-{i}"
    t0 = time.perf_counter()
    adm = await store.admit(Reservation(tenant, rid, MODEL, 1200, LIMITS))
    t1 = time.perf_counter()
    if not adm.allowed:
        raise RuntimeError(f"bench limits too low: {adm}")
    await store.settle(tenant, rid, 700, limits=LIMITS)
    return t1 - t0


async def latency(store: QuotaStore, n: int, offset: int) -> tuple[list[float], list[float]]:
    admits, cycles = [], []
    for i in range(n):
        t0 = time.perf_counter()
        admits.append(await one_cycle(store, offset + i))
        cycles.append(time.perf_counter() - t0)
    return admits, cycles


async def throughput(store: QuotaStore, concurrency: int, seconds: float, offset: int) -> float:
    done = 0
    counter = iter(range(offset, offset + 10**9))
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await one_cycle(store, next(counter))
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def measure(
    name: str, make: Callable[[], Awaitable[QuotaStore]], args: argparse.Namespace
) -> Result:
    store = await make()
    try:
        await latency(store, min(500, args.requests), 0)  # warm the pool and script cache
        admits, cycles = await latency(store, args.requests, 10**6)
        with one_core():
            rate = await throughput(store, args.concurrency, args.seconds, 10**8)
    finally:
        await store.close()
    us = 1e6
    return Result(
        name,
        statistics.median(admits) * us,
        pct(admits, 0.99) * us,
        statistics.median(cycles) * us,
        pct(cycles, 0.99) * us,
        rate,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvgate bench quota_speed",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=5000, help="sequential cycles for latency")
    ap.add_argument("--concurrency", type=int, default=64, help="in flight for throughput")
    ap.add_argument("--seconds", type=float, default=3.0, help="throughput run length")
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    args = ap.parse_args(argv)
    console = Console()

    cores = sorted(os.sched_getaffinity(0))
    server: RedisServer | None = None
    url = args.redis_url
    if url is None:
        server = RedisServer().start()
        url = server.url
        if len(cores) > 1 and server.proc is not None:
            with contextlib.suppress(OSError):  # keep Redis off the measured core
                os.sched_setaffinity(server.proc.pid, {cores[-1]})

    async def mem() -> QuotaStore:
        return MemoryQuotaStore()

    async def red() -> QuotaStore:
        return RedisQuotaStore(url, socket_timeout_s=5.0, op_timeout_s=10.0)

    try:
        results = [
            asyncio.run(measure("memory", mem, args)),
            asyncio.run(measure("redis", red, args)),
        ]
    finally:
        if server is not None:
            server.close()

    table = Table(
        title=f"quota admit + settle ({args.requests} sequential; {args.concurrency} in flight "
        f"for {args.seconds:g}s on one core)"
    )
    for col in ("backend", "admit p50", "admit p99", "admit+settle p50", "admit+settle p99"):
        table.add_column(col, justify="right")
    table.add_column("cycles/s (1 core)", justify="right")
    for r in results:
        table.add_row(
            r.backend,
            f"{r.admit_p50_us:.1f} us",
            f"{r.admit_p99_us:.1f} us",
            f"{r.cycle_p50_us:.1f} us",
            f"{r.cycle_p99_us:.1f} us",
            f"{r.cycles_per_s:,.0f}",
        )
    console.print(table)
    console.print(
        f"[dim]{platform.python_implementation()} {platform.python_version()}, "
        f"{len(cores)} cores visible, load avg {os.getloadavg()[0]:.1f}, "
        f"redis {'external' if args.redis_url else 'local'}; "
        "a cycle = tenant RPM+TPM + model RPM+TPM + lease, then a settle with a refund[/dim]"
    )


if __name__ == "__main__":
    main()
