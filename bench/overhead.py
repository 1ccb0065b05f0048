"""What the gateway adds, in two modes: kvgate minus direct on one worker (classic), and kvgate
against the peer routers and one worker direct on a closed-loop concurrency ladder (`--ladder`).

    .venv/bin/kvgate bench overhead [--requests 2000] [--concurrency 1,16,100] \\
        [--clients aiohttp,httpx]                # results: bench/out/overhead.json
    .venv/bin/kvgate bench overhead --ladder     # kvgate + direct, ~2 min on 2 cores
    .venv/bin/kvgate bench overhead --peers smg,sglang-router,vllm-router   # + the peers
    .venv/bin/kvgate bench overhead --processes 1,4   # kvgate as 1 and as 4 processes
    .venv/bin/kvgate bench overhead --flame bench/out/kvgate.svg   # + py-spy's flame graph at c=64

Classic (the default): one simulated worker with the `instant` timing profile (so the worker's
own time is ~0 and what remains is HTTP + relay), the gateway as a separate process pinned to one
core, and an aiohttp load generator in this process. Each concurrency level runs direct to the
worker first, then through the gateway for each upstream client, on the same requests. Added
latency is the difference of the percentiles, which is what a user sees. Capacity: long streams
at high concurrency; SSE events/s and requests/s the one-core gateway relays. Quotas: the same
load with no tenants, a tenant on the memory store and on Redis.

Ladder (`--ladder`, implied by `--peers`): the question is "how much routing can one core do, and
how does kvgate compare with the other routers doing it". One fleet of N simulated workers
(`kvgate sim --profile instant`, one process each, pinned), then each target in turn against it:
kvgate with its DEFAULT config (kv_aware, request log on; `kvgate serve --config <generated>`),
each peer from `--peers` (installed into `.build/peers/` by `bench.peers`, the same install and
flags as `bench.compare`; one that cannot be installed or started is reported as skipped, with
the reason), and one worker direct (the floor: no router at all). Every router is pinned to the
same single core. For each level of in-flight requests (1, 16, 64, 256, 1024) the load generator
processes (aiohttp, each with its share of the concurrency) open their connections (one
unmeasured request per user), then run a closed loop for `--warmup` then `--seconds`: every
request is a streaming chat with a unique ~4,000-character prompt (no shared prefix anywhere)
and `max_tokens` 16. Reported per target and level: req/s (completions
inside the window), TTFB (to the first SSE event) and e2e p50/p90/p99 of every request in flight
during the window (nearest rank, bench.metrics), errors by kind, the router's CPU use (its
core's busy share: near 100% means the router is the limit, well below means something else is),
and for kvgate how long requests waited outside its own TTFT (`outside_ttft`, from its request
log).

The core layout comes from `os.cpu_count()` (`core_layout`): the router on the last core; on 2
cores the fleet and one load generator share core 0, and the table says the fleet may be the
bottleneck there; from 3 cores the fleet gets min(6, half the spare cores) cores and up to 8 load
generators take the rest (16 cores: 1 router, 6 workers, 8 load generators).
`--processes 1,4` measures kvgate as one process and as `kvgate serve --processes 4` ("kvgate
x4", with a throwaway local Redis for the quotas and [cluster] that several processes need),
pinned to the last 4 cores, which the layout then keeps off the fleet and the load generators
(16 cores: routers 12-15, workers 0-5, load generators 6-11); the one-process target stays on the
last core alone. Its router CPU is the sum over its processes (up to N x 100%). Writes
`bench/out/overhead_peers.json` and `overhead_peers.png` (req/s and TTFB p99 per level); the
table fits 100 columns, `--wide` adds the p90s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.cpu_cap import CpuCap, CpuCapError
from bench.flame import FlameRecorder
from bench.metrics import dist, nearest_rank
from bench.paths import out_path, shown
from bench.peers import HOST, Proc, free_ports, start, wait_for, warm
from bench.sse_client import StreamResult, stream

MODEL = "sim-llama"
CLASSIC_LEVELS = "1,16,100"
PROMPT = ("The quick brown fox jumps over the lazy dog while the cache warms up. " * 60)[:4000]


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
    port = free_ports(1)
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
        return nearest_rank(sorted(xs), q)


CLIENT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError,)  # a timeout raises


async def drive(
    url: str,
    n: int,
    concurrency: int,
    max_tokens: int,
    progress: Progress | None = None,
    key: str | None = None,
) -> RunStats:
    """`n` streamed chats, `concurrency` at a time (bench.sse_client, byte mode): TTFT = first
    body bytes, SSE events counted. A status other than 200, a client error, an error event in
    the stream (vLLM's `data: {"error": ...}`, which still ends with [DONE]) or a stream that does
    not end with `data: [DONE]` is an error, with no TTFT or e2e sample (a timeout raises). The
    warm-up's errors are not counted either."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "stream": True,
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
    chat = url + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one() -> None:
            async with sem:
                res = StreamResult()
                try:
                    await stream(
                        session, chat, body, headers, parse=False, result=res, catch=CLIENT_ERRORS
                    )
                finally:
                    st.events += res.events  # a failed stream's events were relayed too
                    if progress is not None and task is not None:
                        progress.advance(task)
                if res.error is not None or res.stream_error or not res.done:
                    st.errors += 1
                    return
                if res.ttfb is not None:
                    st.ttft.append(res.ttfb)
                if res.e2e is not None:
                    st.e2e.append(res.e2e)

        # Warm the pools so connection setup is not measured.
        await asyncio.gather(*(one() for _ in range(min(concurrency, 20))))
        st.ttft.clear(), st.e2e.clear()
        st.events = st.errors = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        st.wall = time.perf_counter() - t0
    if progress is not None and task is not None:
        progress.remove_task(task)
    return st


BENCH_KEY = "kvg-bench"


def _quota_run(mode: str, worker: str, core: int, n: int, prog: Progress) -> dict[str, object]:
    """Same load with no tenants, a tenant on the memory store, and on a real Redis."""
    from bench.redis_server import RedisServer

    extra = ""
    redis: RedisServer | None = None
    if mode != "off":
        digest = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
        extra = (
            f'[tenants.bench]\nkeys_sha256 = ["{digest}"]\nrpm = 10000000\ntpm = 10000000000\n'
            "max_concurrent = 100000\n"
        )
        if mode == "redis":
            redis = RedisServer(free_ports(1))
            redis.start()
            extra += f'[quota]\nbackend = "redis"\nredis_url = "{redis.url}"\n'
    try:
        with gateway(worker, "aiohttp", core, extra) as gw:
            v = asyncio.run(drive(gw, n, 32, 16, prog, key=BENCH_KEY if extra else None))
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


def classic(args: argparse.Namespace, con: Console) -> int:
    """Added latency vs direct, relay capacity and quota modes on one simulated worker."""
    levels = [int(c) for c in (args.concurrency or CLASSIC_LEVELS).split(",")]
    clients = args.clients.split(",")
    policy = args.policy or "least_loaded"
    ncpu = os.cpu_count() or 1
    gw_core, other = ncpu - 1, set(range(max(1, ncpu - 1)))
    port = free_ports(1)
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
            d = asyncio.run(drive(worker, args.requests, c, args.max_tokens, prog))
            row = {
                "concurrency": c,
                "direct_p50_ms": d.pct(d.ttft, 50) * 1e3,
                "direct_p99_ms": d.pct(d.ttft, 99) * 1e3,
                "direct_rps": len(d.e2e) / d.wall,
            }
            for client in clients:
                with gateway(worker, client, gw_core, policy=policy) as gw:
                    v = asyncio.run(drive(gw, args.requests, c, args.max_tokens, prog))
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
                v = asyncio.run(drive(gw, n, 64, 256, prog))
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
    out = args.json or out_path("overhead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    con.print(f"wrote {shown(out)}", markup=False)
    return 0


# ==================================================================================================
# The closed-loop ladder: kvgate, the peer routers and one worker direct, on one fleet
# ==================================================================================================

LADDER_LEVELS = "1,16,64,256,1024"
MAX_LOADGENS = 8  # enough to saturate any router on one core; more only thins each one's share
SIM_NUM_BLOCKS = 131072  # 1024 unique ~650-token prompts in flight on one worker fit, no eviction


@dataclass(frozen=True, slots=True)
class CoreLayout:
    """Which cores run what: the router alone on one core, the rest for the fleet and the load.

    `fleet` has one core set per simulated worker process, `loadgens` one per load generator
    process. `shared` is true when the fleet and the load generators share cores (2 cores or
    fewer): the router is still alone on its core, but what the rest can push may be the limit.
    """

    cores: int
    router: int
    fleet: tuple[frozenset[int], ...]
    loadgens: tuple[frozenset[int], ...]
    shared: bool
    # The cores a gateway of several processes (`--processes N`) is pinned to: the last N, `router`
    # among them; one-process routers stay on `router` alone.
    routers: tuple[int, ...] = ()

    @property
    def others(self) -> frozenset[int]:
        """Every core but the router's (this process runs there too)."""
        return frozenset().union(*self.fleet, *self.loadgens)

    def router_cores(self, n: int) -> list[int]:
        """The cores of a router of `n` processes: `router` for one, the last `n` for more."""
        return [self.router] if n <= 1 else list((self.routers or (self.router,))[-n:])

    def describe(self) -> str:
        fleet = sorted(self.others if self.shared else frozenset().union(*self.fleet))
        gens = sorted(frozenset().union(*self.loadgens))
        text = (
            f"{self.cores} cores: router pinned to core {self.router}; "
            f"{len(self.fleet)} sim worker process(es) on core(s) {_cores(fleet)}; "
            f"{len(self.loadgens)} load generator process(es) on core(s) {_cores(gens)}"
        )
        if self.shared:
            text += (
                ". The fleet and the load generator share a core: the fleet, not the router, may "
                "be the bottleneck (a router CPU well below 100% says so)"
            )
        if len(self.routers) > 1:
            text += f"; kvgate xN (N processes) on the last N of cores {_cores(list(self.routers))}"
            if set(self.routers) & self.others:
                text += ", shared with the fleet and the load generators"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "cores": self.cores,
            "router": self.router,
            "fleet": [sorted(c) for c in self.fleet],
            "loadgens": [sorted(c) for c in self.loadgens],
            "shared": self.shared,
            "routers": list(self.routers),
        }


def _cores(cores: list[int]) -> str:
    if len(cores) > 2 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def core_layout(
    ncpu: int, workers: int | None = None, max_loadgens: int = MAX_LOADGENS, router_cores: int = 1
) -> CoreLayout:
    """The layout for a host with `ncpu` cores.

    The router gets the last core to itself (like the classic mode and bench.spike). On 2 cores
    the fleet and one load generator share core 0. From 3 cores on, the others are split between
    the fleet (one worker process per core, `workers` defaulting to min(6, half the spare cores))
    and up to `max_loadgens` load generators; cores left over stay idle for the OS and this
    process. 16 cores gives the issue's layout: router 1, fleet 6, load generators 8.

    `router_cores` > 1 (`--processes`): the last that many cores are the routers' (`routers`),
    the rest are split as above, and a router of one process stays on the last core alone, so its
    figures are measured as without the option. Where that leaves no core (2 cores, 2 processes),
    the fleet and the load generators keep core 0 and share it with the router's processes.
    """
    ncpu = max(1, ncpu)
    router = ncpu - 1
    k = max(1, min(router_cores, ncpu))
    routers = tuple(range(ncpu - k, ncpu))
    spare = list(range(ncpu - k if ncpu - k >= 1 else ncpu - 1))
    if len(spare) <= 1:  # 1 or 2 cores: everything but the router on the one core left (or it)
        core = frozenset(spare or [router])
        n = workers or 1
        return CoreLayout(ncpu, router, (core,) * n, (core,), shared=True, routers=routers)
    n = workers or min(6, len(spare) // 2)
    fleet_cores = spare[: min(n, len(spare) - 1)]  # at least one core left for the load
    fleet = tuple(frozenset([fleet_cores[i % len(fleet_cores)]]) for i in range(n))
    rest = spare[len(fleet_cores) :]
    gens = tuple(frozenset([c]) for c in rest[:max_loadgens])
    return CoreLayout(ncpu, router, fleet, gens, shared=False, routers=routers)


def split(concurrency: int, parts: int) -> list[int]:
    """Each load generator's share of the in-flight requests (no empty shares)."""
    base, extra = divmod(concurrency, parts)
    shares = [base + (i < extra) for i in range(parts)]
    return [s for s in shares if s > 0]


# -- the load generator (a process per core set; closed loop) ---------------------------------


@dataclass(frozen=True, slots=True)
class Shot:
    """One level for one load generator: `concurrency` users, each sending its next request as
    soon as the last one ends, for `warmup_s` then `seconds`; requests that end before the
    window opens (warm-up) are not measured."""

    url: str
    concurrency: int
    warmup_s: float
    seconds: float
    tag: str  # unique per target, level and load generator: makes every prompt unique
    seed: int  # same seed for every target: the same request bodies apart from the tag
    max_tokens: int = 16
    prompt_chars: int = 4000
    timeout_s: float = 60.0
    drain_s: float = 30.0
    connect_s: float = 60.0  # longest the connect phase may take


@dataclass
class Samples:
    """What a level measured (merged over load generators): latencies of the requests in flight
    during the window, completions inside it (throughput), errors by kind."""

    ttfb: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    # (kvgate's request id, TTFB, wall-clock send time) of the measured requests that carried
    # one: matched with the gateway's request log, they show how long a request waited outside
    # the gateway's own TTFT, and on which side of it.
    gateway_ids: list[tuple[str, float, float]] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def merge(self, other: Samples) -> Samples:
        self.ttfb += other.ttfb
        self.e2e += other.e2e
        self.completed += other.completed
        self.errors += other.errors
        self.gateway_ids += other.gateway_ids
        for k, v in other.error_kinds.items():
            self.error_kinds[k] = self.error_kinds.get(k, 0) + v
        return self


class Prompts:
    """Unique ~`chars`-character prompts: an id first (so no two requests share a prefix, at
    any router's or worker's granularity), then a slice of random common words at a random
    offset. Cheap (a slice, not 4,000 random draws) so the load generator stays light."""

    def __init__(self, tag: str, seed: int, chars: int) -> None:
        from workers.sim.tokenizer import VOCAB

        self.rng = random.Random(seed)
        self.tag, self.chars, self.n = tag, chars, 0
        text = ""
        while len(text) < 2 * chars:
            text += "".join(self.rng.choices(VOCAB, k=1000))
        self.text = text

    def next(self) -> str:
        self.n += 1
        head = f"{self.tag}-{self.n}:"
        off = self.rng.randrange(self.chars)
        return head + self.text[off : off + max(0, self.chars - len(head))]


async def closed_loop(shot: Shot, go: Callable[[], Awaitable[float]] | None = None) -> Samples:
    """Run one level: `shot.concurrency` users in a closed loop against `shot.url`.

    First every user opens its connection with one unmeasured request (starts spread over up to
    1 s: a thousand connects at once overflow the Rust routers' listen backlog of 128), and all
    wait for the last: a busy server accepts new connections slowly (a simulated worker under
    1,024 streams left 700 in its accept queue for the whole level), so connections opened under
    load would run the level far below its concurrency. Then `go` (the parent, once every load
    generator is connected) says when the loop starts, the same instant for all of them.

    TTFB is from sending the request to the first body chunk (the first SSE event); e2e to the
    end of the stream, which must end with `[DONE]` and carry no error event (kind
    "stream_error"). Measured: every request that ends after the window opens, whenever it was
    sent, and those still running when it closes are awaited (up to `drain_s`). Counting only
    requests sent inside the window would hide a request that a router holds from the warm-up to
    the end."""
    out = Samples()
    prompts = Prompts(shot.tag, shot.seed, shot.prompt_chars)
    headers = {"content-type": "application/json"}
    url = shot.url + "/v1/chat/completions"
    t_measure = t_end = math.inf

    def body() -> bytes:
        return json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompts.next()}],
                "max_tokens": shot.max_tokens,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()

    async def one(
        session: aiohttp.ClientSession,
    ) -> tuple[float, float, str, str | None, float]:
        """(TTFB, e2e, error kind or "", kvgate's request id, wall-clock send time) of one
        request (bench.sse_client, byte mode)."""
        res = await stream(session, url, body(), headers, parse=False, catch=LADDER_ERRORS)
        sent_wall = time.time() - (time.perf_counter() - res.sent_at)
        rid = res.headers.get(GATEWAY_ID_HEADER) if res.headers is not None else None
        e2e = res.e2e if res.e2e is not None else time.perf_counter() - res.sent_at
        if isinstance(res.exc, TimeoutError):
            kind = "timeout"
        elif res.exc is not None:
            kind = type(res.exc).__name__
        elif res.status != 200:
            kind = res.error or ""
        elif res.stream_error:  # vLLM's in-stream error: `data: {"error": ...}`, then [DONE]
            kind = "stream_error"
        elif b"[DONE]" not in res.tail:
            kind = "stream ended without [DONE]"
        else:
            kind = ""
        return res.ttfb or 0.0, e2e, kind, rid, sent_wall

    async def connect(session: aiohttp.ClientSession, delay: float) -> None:
        await asyncio.sleep(delay)
        await one(session)

    async def user(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < t_end:
            ttfb, e2e, kind, rid, sent_wall = await one(session)
            t1 = time.monotonic()
            if t1 >= t_measure:
                if kind:
                    out.error(kind)
                else:
                    out.ttfb.append(ttfb)
                    out.e2e.append(e2e)
                    if rid is not None:
                        out.gateway_ids.append((rid, ttfb, sent_wall))
            if not kind and t_measure <= t1 < t_end:
                out.completed += 1
            if kind:
                await asyncio.sleep(0.01)  # a router that fails fast must not spin this loop

    timeout = aiohttp.ClientTimeout(total=shot.timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        ramp = min(1.0, shot.warmup_s / 2) / shot.concurrency
        warm = [asyncio.create_task(connect(session, i * ramp)) for i in range(shot.concurrency)]
        _, late = await asyncio.wait(warm, timeout=shot.connect_s)
        for t in late:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        start_at = await go() if go is not None else time.monotonic()
        t_measure = start_at + shot.warmup_s
        t_end = t_measure + shot.seconds
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        tasks = [asyncio.create_task(user(session)) for _ in range(shot.concurrency)]
        _, pending = await asyncio.wait(
            tasks, timeout=max(0.0, t_end - time.monotonic()) + shot.drain_s
        )
        for t in pending:
            t.cancel()
            out.error("unfinished after the drain")
        await asyncio.gather(*pending, return_exceptions=True)
    return out


LADDER_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, aiohttp.ClientError)
GATEWAY_ID_HEADER = "x-kvgate-request-id"


def _head_at(rec: dict[str, Any]) -> float | None:
    """When a logged request's head was complete (wall clock): its line's time minus its e2e."""
    try:
        ts = datetime.fromisoformat(str(rec["ts"]).replace("Z", "+00:00")).timestamp()
        return ts - float(rec["e2e_ms"]) / 1e3
    except (KeyError, ValueError, TypeError):
        return None


def outside_ttft(
    ids: list[tuple[str, float, float]], log_lines: list[bytes]
) -> dict[str, Any] | None:
    """How long requests waited outside kvgate's own TTFT: the client's TTFB minus the TTFT the
    gateway logged for the same request id (its clock starts at the complete request head), in
    ms, over the requests found in the JSON request log (`log_lines`). What it counts: the
    connection's accept and the head's read before kvgate's timer, the first event's way back
    to the client, and the load generator's own delays. None when no request matched (another
    router, or the log off).

    Where the time went, each as p50/p99/max (issue: "where time goes between accept and the
    first byte"): `before_head`, from the client's send to the complete head (the log line's
    time, taken as the request is finished, minus its e2e; the clocks are this host's, the log's
    to the millisecond), i.e. waiting in the socket for a busy loop; `in_gateway`, from the head
    to the worker (the log's `sent_ms`: body, checks, keying, quota, admission queue, a
    connection); `worker`, from there to the first event written to the client (the worker's
    own TTFT and the relay); `after_first_write`, the rest, the event's way back."""
    recs: dict[str, tuple[float, float | None, float | None]] = {}
    for line in log_lines:
        if b'"ttft_ms"' not in line or not line.startswith(b"{"):
            continue
        with contextlib.suppress(ValueError, TypeError):
            rec = json.loads(line)
            if rec.get("ttft_ms") is None or not rec.get("request_id"):
                continue
            recs[rec["request_id"]] = (rec["ttft_ms"], rec.get("sent_ms"), _head_at(rec))
    gaps, before, after, inside, worker = [], [], [], [], []
    for rid, ttfb, sent_wall in ids:
        r = recs.get(rid)
        if r is None:
            continue
        ttft, sent, head = r
        gaps.append(ttfb * 1e3 - ttft)
        if head is not None:
            before.append((head - sent_wall) * 1e3)
            after.append(gaps[-1] - before[-1])
        if sent is not None:
            inside.append(sent)
            worker.append(ttft - sent)
    if not gaps:
        return None

    def qs(xs: list[float]) -> dict[str, float]:
        d = dist(xs)
        return {q: round(d[q], 3) for q in ("p50", "p99", "max")}

    out: dict[str, Any] = {"matched": len(gaps), **qs(gaps)}
    for name, xs in (
        ("before_head", before),
        ("in_gateway", inside),
        ("worker", worker),
        ("after_first_write", after),
    ):
        if xs:
            out[name] = qs(xs)
    return out


CONNECTED = "connected"


def _loadgen_main(conn: Connection, cores: list[int]) -> None:
    """A load generator process: pinned, then one closed-loop level per `Shot` it receives.

    Per level: the shot arrives, the users connect, `CONNECTED` goes back, the start instant
    (time.monotonic, the same clock in every process) comes in, the samples go back."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, set(cores))

    async def go() -> float:
        conn.send(CONNECTED)
        start_at: float = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        return start_at

    while (shot := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(closed_loop(shot, go)))
        except Exception as e:  # reported by the parent, which goes on with the next target
            conn.send(f"load generator failed: {type(e).__name__}: {e}")


class LoadGens:
    """The load generator processes, started once (spawned: this process has threads) and fed
    one `Shot` per level each, all starting on the same instant."""

    def __init__(self, layout: CoreLayout) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[tuple[BaseProcess, Connection]] = []
        for cores in layout.loadgens:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_loadgen_main, args=(child, sorted(cores)), daemon=True)
            p.start()
            child.close()
            self.procs.append((p, parent))

    def run(self, shot: Shot, watch: LevelWatch | None = None) -> tuple[Samples, list[str]]:
        """Split `shot` over the generators, connect them all, start them on the same instant,
        wait for all; (merged samples, failures)."""
        shares = split(shot.concurrency, len(self.procs))
        used = self.procs[: len(shares)]
        for i, ((_, conn), c) in enumerate(zip(used, shares, strict=True)):
            conn.send(replace(shot, concurrency=c, tag=f"{shot.tag}g{i}", seed=shot.seed + i))
        failures: list[str] = []
        connected = []
        for p, conn in used:
            got = self._recv(p, conn, watch)
            if got == CONNECTED:
                connected.append((p, conn))
            else:
                failures.append(str(got))
        start_at = time.monotonic() + 0.1
        if watch is not None:
            watch.start(start_at)
        for _, conn in connected:
            conn.send(start_at)
        merged = Samples()
        for p, conn in connected:
            got = self._recv(p, conn, watch)
            if isinstance(got, Samples):
                merged.merge(got)
            else:
                failures.append(str(got))
        if watch is not None:
            watch.tick(time.monotonic())  # the last sample: results come right after the window
        return merged, failures

    @staticmethod
    def _recv(p: BaseProcess, conn: Connection, watch: LevelWatch | None) -> object:
        try:
            while not conn.poll(0.2):
                if watch is not None:
                    watch.tick(time.monotonic())
                if not p.is_alive():
                    raise EOFError
            return conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"load generator exited ({p.exitcode})") from None

    def close(self) -> None:
        for _, conn in self.procs:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p, _ in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


# -- summaries ---------------------------------------------------------------------------------


def summarize(s: Samples, concurrency: int, seconds: float) -> dict[str, Any]:
    """One level's row: req/s from completions inside the window, percentiles (bench.metrics'
    nearest rank) of the requests in flight during it, in milliseconds."""

    def ms(values: list[float]) -> dict[str, float | None]:
        d = dist(values)
        keys = ("p50", "p90", "p99", "max")
        return {q: None if (v := d[q]) is None else v * 1e3 for q in keys}

    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "completed": s.completed,
        "rps": s.completed / seconds if seconds > 0 else 0.0,
        "measured": len(s.e2e),
        "errors": s.errors,
        "error_kinds": dict(sorted(s.error_kinds.items())),
        "ttfb_ms": ms(s.ttfb),
        "e2e_ms": ms(s.e2e),
    }


def _session_usage(sid: int) -> tuple[float, int | None, int | None]:
    """(CPU seconds, read syscalls, write syscalls), user + system over all threads, of every
    process in session `sid`: the router and anything it started (`sglang_router.launch_router`
    and friends). The syscall counts come from /proc/<pid>/io (reads and writes of any kind,
    sockets included) and are None where a process's are not readable. NaN CPU without procfs
    (macOS: the columns show "-")."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    reads: int | None = 0
    writes: int | None = 0
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return math.nan, None, None
    for d in entries:
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(f[3]) != sid:  # fields after the name: state ppid pgrp session ...
                continue
            total += int(f[11]) + int(f[12])
            try:
                io = dict(line.split(": ") for line in (d / "io").read_text().splitlines())
                if reads is not None and writes is not None:
                    reads += int(io["syscr"])
                    writes += int(io["syscw"])
            except (OSError, ValueError, KeyError):
                reads = writes = None
    return total / tick, reads, writes


class LevelWatch:
    """What this process does while the load generators run a level: moves the progress bar
    and samples the router's CPU seconds when the window opens and when it closes (the load
    generators report only at the end, so the samples are taken here, while waiting)."""

    def __init__(self, pid: int, warmup_s: float, seconds: float, prog: Progress, label: str):
        self.pid, self.warmup_s, self.seconds = pid, warmup_s, seconds
        self.prog, self.label = prog, label
        self.task = prog.add_task(f"{label} (connecting)", total=warmup_s + seconds)
        self.begin = self.end = math.inf
        self.at: list[tuple[float, float, int | None, int | None]] = []

    def start(self, start_at: float) -> None:
        """The load generators are connected and start at `start_at`."""
        self.begin = start_at + self.warmup_s
        self.end = self.begin + self.seconds
        self.prog.update(self.task, description=self.label)

    def tick(self, now: float) -> None:
        if self.begin < math.inf:
            done = max(0.0, min(self.end, now) - self.begin + self.warmup_s)
            self.prog.update(self.task, completed=done)
        if (not self.at and now >= self.begin) or (len(self.at) == 1 and now >= self.end):
            self.at.append((now, *_session_usage(self.pid)))

    def share(self) -> float | None:
        """Busy share of one core over the window (1.0 = the router used its whole core)."""
        if len(self.at) < 2 or self.at[1][0] <= self.at[0][0] or math.isnan(self.at[0][1]):
            return None
        return (self.at[1][1] - self.at[0][1]) / (self.at[1][0] - self.at[0][0])

    def syscalls_per_s(self) -> tuple[float, float] | None:
        """(read, write) syscalls per second over the window, where /proc says."""
        if len(self.at) < 2 or self.at[1][0] <= self.at[0][0]:
            return None
        (t0, _, r0, w0), (t1, _, r1, w1) = self.at
        if r0 is None or w0 is None or r1 is None or w1 is None:
            return None
        return (r1 - r0) / (t1 - t0), (w1 - w0) / (t1 - t0)


# -- targets -----------------------------------------------------------------------------------


@dataclass
class LadderTarget:
    name: str
    kind: str  # kvgate | peer | direct
    version: str | None = None
    status: str = "pending"  # ok | skipped | failed
    reason: str = ""
    levels: list[dict[str, Any]] = field(default_factory=list)
    processes: int = 1  # kvgate: `kvgate serve --processes`
    flame: dict[str, Any] | None = None  # `--flame`: what py-spy recorded (bench.flame)

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "kind": self.kind,
            "version": self.version,
            "status": self.status,
            "reason": self.reason,
            "levels": self.levels,
            "processes": self.processes,
        }
        if self.flame is not None:
            out["flame"] = self.flame
        return out


def parse_processes(text: str | None) -> list[int]:
    """`--processes 1,4` -> [1, 4]: a kvgate target per value, in order, duplicates dropped."""
    out: list[int] = []
    for part in (text or "1").split(","):
        n = int(part)
        if n < 1:
            raise ValueError(f"--processes: {n} is not a process count")
        if n not in out:
            out.append(n)
    return out


def _kvgate_version() -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version("kvgate")
    return None


def kvgate_default_toml(
    port: int,
    urls: list[str],
    policy: str | None = None,
    processes: int = 1,
    redis_url: str | None = None,
) -> str:
    """kvgate as shipped: every setting at its default (kv_aware routing, the JSON request log on
    stdout, no tenants), only the port and the workers given. `processes` > 1: what several
    processes need on top, quotas in Redis (`redis_url`; no tenants, so no quota call is made)
    and [cluster] on, with a key prefix of this run's own."""
    lines = ["[server]", f'host = "{HOST}"', f"port = {port}"]
    if processes > 1:
        if not redis_url:
            raise ValueError("processes > 1 needs a redis_url")
        lines += [f"processes = {processes}", "[quota]", 'backend = "redis"']
        lines += [f'redis_url = "{redis_url}"', "[cluster]", "enabled = true"]
        lines += [f'key_prefix = "kvgate:{{overhead-{port}}}:"']
    if policy:
        lines += ["[routing]", f'policy = "{policy}"']
    for i, u in enumerate(urls):
        lines += ["[[workers]]", f'name = "w{i}"', f'url = "{u}"']
    return "\n".join(lines) + "\n"


def flame_level(levels: list[int], wanted: int | None) -> int:
    """The level `--flame` profiles: `--flame-at`, else 64 in flight when run, else the top."""
    if wanted is not None:
        return wanted
    return 64 if 64 in levels else max(levels)


def kvgate_target_name(processes: int) -> str:
    return "kvgate" if processes <= 1 else f"kvgate x{processes}"


def _all_processes_ready(url: str, processes: int, workers: int) -> bool:
    """Every process of the gateway listens and sees every worker healthy (one scrape)."""
    from prometheus_client.parser import text_string_to_metric_families

    serving = up = 0.0
    text = httpx.get(url + "/metrics", timeout=2.0).text
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "kvgate_processes" and smp.labels.get("state") == "serving":
                serving = smp.value
            elif smp.name == "kvgate_worker_up":
                up += smp.value
    return serving == processes and up == processes * workers


def start_kvgate(
    urls: list[str],
    logs: Path,
    cores: int | list[int],
    policy: str | None = None,
    processes: int = 1,
    redis_url: str | None = None,
    cap: CpuCap | None = None,
) -> tuple[Proc, str]:
    """`kvgate serve` with the default config (`processes` of it), pinned to `cores`; ready once
    it (every process of it) sees every worker healthy and has routed one completion."""
    port = free_ports(1)
    # Its own directory, as in a deployment: the config watcher watches the config's directory,
    # and the router's stdout log written beside it woke the watcher hundreds of times a second
    # (~5% of the router's core in py-spy samples), a cost no deployment pays.
    cfg = logs / "config" / "kvgate" / f"kvgate-p{processes}.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(kvgate_default_toml(port, urls, policy, processes, redis_url), encoding="utf-8")
    proc = start(
        kvgate_target_name(processes).replace(" ", "-"),
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)],
        logs,
        cores=[cores] if isinstance(cores, int) else cores,
        cap=cap,
    )
    url = f"http://{HOST}:{port}"

    def ready() -> bool:
        if processes > 1:
            return _all_processes_ready(url, processes, len(urls))
        r = httpx.get(url + "/ready", timeout=1.0)
        return r.status_code == 200 and r.json().get("healthy_workers") == len(urls)

    try:
        wait_for(ready, proc, 60, "kvgate")
        wait_for(lambda: warm(url), proc, 30, "kvgate warm-up")
    except BaseException:
        proc.stop()
        raise
    return proc, url


def _healthy(url: str) -> bool:
    return httpx.get(url + "/health", timeout=1.0).status_code == 200


def start_sim_fleet(layout: CoreLayout, logs: Path) -> tuple[list[Proc], list[str]]:
    """One `kvgate sim` process per worker (instant profile), each pinned to its core(s)."""
    base = free_ports(len(layout.fleet))
    procs, urls = [], []
    try:
        for i, cores in enumerate(layout.fleet):
            argv = [
                *(sys.executable, "-m", "gateway.cli", "sim", "--host", HOST),
                *("--port", str(base + i), "--workers", "1", "--profile", "instant"),
                *("--model", MODEL, "--max-num-seqs", "1024"),
                *("--num-blocks", str(SIM_NUM_BLOCKS)),
            ]
            procs.append(start(f"sim-{i}", argv, logs, cores=cores))
            urls.append(f"http://{HOST}:{base + i}")
        for p, u in zip(procs, urls, strict=True):
            wait_for(partial(_healthy, u), p, 60, p.name)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs, urls


def run_ladder_target(
    t: LadderTarget,
    url: str,
    pid: int,
    gens: LoadGens,
    levels: list[int],
    args: argparse.Namespace,
    index: int,
    prog: Progress,
    con: Console,
    log: Path | None = None,
) -> None:
    """Every level against one started target; per level a line, and the router's CPU use.
    ``log``: kvgate's output, whose request lines give each level's wait outside its TTFT."""
    flame_at = flame_level(levels, args.flame_at)
    log_at = 0  # bytes of the log read by the levels before
    for c in levels:
        watch = LevelWatch(pid, args.warmup, args.seconds, prog, f"{t.name} c={c}")
        shot = Shot(
            url=url,
            concurrency=c,
            warmup_s=args.warmup,
            seconds=args.seconds,
            tag=f"t{index}c{c}",
            seed=c,
            max_tokens=args.max_tokens,
            prompt_chars=args.prompt_chars,
        )
        flame = None
        if args.flame is not None and t.kind == "kvgate" and t.processes == 1 and c == flame_at:
            flame = FlameRecorder(pid, args.flame, args.warmup, args.seconds)
        samples, failures = gens.run(shot, watch)
        if flame is not None:
            t.flame = {"level": c, **flame.finish()}
        prog.remove_task(watch.task)
        row = summarize(samples, c, args.seconds)
        row["router_cpu"] = watch.share()
        if row["rps"] and row["router_cpu"] is not None:
            row["router_cpu_ms_per_request"] = round(row["router_cpu"] / row["rps"] * 1000, 4)
        io = watch.syscalls_per_s()
        if row["rps"] and io is not None:
            # Syscalls, not writes counted by strace (which slows the router enough to batch).
            row["router_reads_per_request"] = round(io[0] / row["rps"], 2)
            row["router_writes_per_request"] = round(io[1] / row["rps"], 2)
        if failures:
            row["loadgen_failures"] = failures
        if log is not None and samples.gateway_ids:
            with contextlib.suppress(OSError):
                text = _log_since(log, log_at)
                log_at += len(text)
                row["outside_ttft_ms"] = outside_ttft(samples.gateway_ids, text.splitlines())
        t.levels.append(row)
        con.print(
            f"  {t.name:<14} c={c:<5} {row['rps']:8.1f} req/s  TTFB p50/p99 "
            f"{_ms(row['ttfb_ms']['p50'])}/{_ms(row['ttfb_ms']['p99'])} ms  "
            f"errors {row['errors']}  router CPU {_pct(row['router_cpu'])}"
            + (f"  outside TTFT max {_outside(row)} ms" if row.get("outside_ttft_ms") else "")
            + _split(row),
            markup=False,
            highlight=False,
        )


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 100 else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


# -- report ------------------------------------------------------------------------------------


def print_flame(con: Console, name: str, flame: dict[str, Any]) -> None:
    """Where the router's time went in the profiled level (py-spy's samples), or why nothing."""
    from bench.simulate import print_table

    if "error" in flame:
        con.print(f"flame graph of {name}: not recorded: {flame['error']}", markup=False)
        return
    t = Table(
        title=f"{name} at c={flame['level']}: top frames by own samples ({flame['samples']})",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    t.add_column("self", justify="right")
    t.add_column("incl.", justify="right")
    t.add_column("frame", overflow="fold")
    for row in flame["top"]:
        t.add_row(f"{row['self']:.1%}", f"{row['inclusive']:.1%}", row["frame"])
    print_table(con, t)
    con.print(f"flame graph: {shown(Path(flame['svg']))}", markup=False, highlight=False)


LevelCell = Callable[[dict[str, Any]], str]
# (header, wide only, cell): the default set fits 100 columns; --wide adds the p90s.
LADDER_COLUMNS: tuple[tuple[str, bool, LevelCell], ...] = (
    ("in\nflight", False, lambda r: str(r["concurrency"])),
    ("req/s", False, lambda r: f"{r['rps']:.1f}"),
    ("TTFB\np50 ms", False, lambda r: _ms(r["ttfb_ms"]["p50"])),
    ("TTFB\np90 ms", True, lambda r: _ms(r["ttfb_ms"]["p90"])),
    ("TTFB\np99 ms", False, lambda r: _ms(r["ttfb_ms"]["p99"])),
    ("e2e\np50 ms", False, lambda r: _ms(r["e2e_ms"]["p50"])),
    ("e2e\np90 ms", True, lambda r: _ms(r["e2e_ms"]["p90"])),
    ("e2e\np99 ms", False, lambda r: _ms(r["e2e_ms"]["p99"])),
    ("errors", False, lambda r: str(r["errors"])),
    ("router\nCPU", False, lambda r: _pct(r.get("router_cpu"))),
    ("CPU ms\n/req", False, lambda r: _cpu_ms(r)),
    ("reads+writes\n/req", True, lambda r: _io(r)),
    ("outside\nTTFT max", True, lambda r: _outside(r)),
)


def _log_since(log: Path, at: int, quiet_s: float = 0.1, limit_s: float = 3.0) -> bytes:
    """The whole lines written to ``log`` past byte ``at``, once it stopped growing for
    ``quiet_s`` (the request log's writer flushes every 50 ms; a busy host delays it)."""
    size, deadline = -1, time.monotonic() + limit_s
    while time.monotonic() < deadline:
        now = log.stat().st_size
        if now == size:
            break
        size = now
        time.sleep(quiet_s)
    with log.open("rb") as f:
        f.seek(at)
        text = f.read()
    return text[: text.rfind(b"\n") + 1]  # a line still being written is the next level's


def _outside(row: dict[str, Any]) -> str:
    """The longest a request waited outside kvgate's own TTFT (ms; `outside_ttft`)."""
    o = row.get("outside_ttft_ms")
    return "-" if not o else _ms(o["max"])


def _split(row: dict[str, Any]) -> str:
    """Where kvgate's TTFB went at p99 (`outside_ttft`'s split), for the per-level line."""
    o = row.get("outside_ttft_ms") or {}
    parts = [
        f"{label} {_ms(o[k]['p99'])}"
        for k, label in (
            ("before_head", "socket"),
            ("in_gateway", "gateway"),
            ("worker", "worker"),
            ("after_first_write", "back"),
        )
        if k in o
    ]
    return f"  p99 ms: {', '.join(parts)}" if parts else ""


def _io(row: dict[str, Any]) -> str:
    r, w = row.get("router_reads_per_request"), row.get("router_writes_per_request")
    return "-" if r is None or w is None else f"{r:.1f}+{w:.1f}"


def _cpu_ms(row: dict[str, Any]) -> str:
    """The router's CPU time per completed request: what one core of routing costs, whether or
    not the router is the bottleneck (on 2 cores the fleet is, and req/s says little)."""
    cpu, rps = row.get("router_cpu"), row.get("rps")
    return f"{cpu / rps * 1000:.3f}" if cpu is not None and rps else "-"


def _cap_caption(share: float | None) -> str:
    if share is None:
        return ""
    return (
        f". Every router held to {share:g} of its core (--router-cpu, a cgroup quota): one at "
        f"~{share:.0%} CPU is the bottleneck, and its req/s / {share:g} is what a whole core of "
        "it carries"
    )


def ladder_table(report: dict[str, Any], wide: bool = False) -> Table:
    """Every target x level; the caption says how the cores were laid out, and on a small host
    that the fleet, not the router, may be what limits the numbers."""
    from bench.simulate import add_number_column

    cols = [c for c in LADDER_COLUMNS if wide or not c[1]]
    s = report["setup"]
    many = max(report["setup"].get("processes") or [1]) > 1
    t = Table(
        title="bench.overhead --ladder: closed loop, streaming chat, router on one core"
        + (" (kvgate xN: on N)" if many else ""),
        caption=f"{report['layout_describe']}. Each level {s['seconds']:g} s after "
        f"{s['warmup_s']:g} s warm-up; unique ~{s['prompt_chars']}-char prompts, max_tokens "
        f"{s['max_tokens']}; TTFB = first SSE event; router CPU = its core's busy share "
        "(direct: the worker's), CPU ms/req = that per completed request"
        + _cap_caption(s.get("router_cpu")),
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    add_number_column(t, "target", left=True)
    for header, _, _ in cols:
        add_number_column(t, header)
    for target in report["targets"]:
        if target["status"] != "ok":
            continue
        label = target["name"] + (f" {target['version']}" if target.get("version") else "")
        for i, row in enumerate(target["levels"]):
            t.add_row(label if i == 0 else "", *(cell(row) for _, _, cell in cols))
        t.add_section()
    return t


def summary_table(report: dict[str, Any]) -> Table:
    """The headline: per target, req/s and TTFB p99 at each level, one line each."""
    from bench.simulate import add_number_column

    levels = report["setup"]["levels"]
    t = Table(
        title="req/s / TTFB p99 ms per in-flight level",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    add_number_column(t, "target", left=True)
    for c in levels:
        add_number_column(t, f"c={c}")
    for target in report["targets"]:
        if target["status"] != "ok":
            continue
        by = {r["concurrency"]: r for r in target["levels"]}
        t.add_row(
            target["name"],
            *(
                f"{by[c]['rps']:.0f} / {_ms(by[c]['ttfb_ms']['p99'])}" if c in by else "-"
                for c in levels
            ),
        )
    return t


def ladder_plot(report: dict[str, Any], path: Path) -> Path:
    """req/s and TTFB p99 against in-flight requests, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for target in report["targets"]:
        if target["status"] != "ok" or not target["levels"]:
            continue
        cs = [r["concurrency"] for r in target["levels"]]
        a.plot(cs, [r["rps"] for r in target["levels"]], marker="o", label=target["name"])
        p99 = [r["ttfb_ms"]["p99"] for r in target["levels"]]
        b.plot(
            cs, [float("nan") if v is None else v for v in p99], marker="o", label=target["name"]
        )
    a.set_ylabel("requests/s")
    b.set_ylabel("TTFB p99 (ms)")
    b.set_yscale("log")
    levels = report["setup"]["levels"]
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("requests in flight (closed loop)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    m = report["machine"]
    s = report["setup"]
    title = (
        f"{m['cpu']}; {report['layout_describe']}; {s['seconds']:g} s per level, unique "
        f"~{s['prompt_chars']}-char prompts, max_tokens {s['max_tokens']}"
    )
    fig.suptitle(textwrap.fill(title, 150), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the ladder run ----------------------------------------------------------------------------


def ladder(args: argparse.Namespace, con: Console) -> int:
    """kvgate (default config), each peer and one worker direct, every level, one fleet."""
    from bench.metrics import machine
    from bench.peers import PEERS, ensure_peer, installed_version, start_peer
    from bench.simulate import print_table, split_policies

    t0 = time.monotonic()
    levels = [int(c) for c in (args.concurrency or LADDER_LEVELS).split(",")]
    procs = parse_processes(args.processes)
    layout = core_layout(os.cpu_count() or 1, args.workers, router_cores=max(procs))
    peer_names = [] if args.peers.strip() in ("", "none") else split_policies(args.peers)
    targets = [
        LadderTarget(kvgate_target_name(n), "kvgate", _kvgate_version(), processes=n) for n in procs
    ]
    for name in peer_names:
        if name in PEERS:
            targets.append(LadderTarget(name, "peer"))
        else:
            targets.append(LadderTarget(name, "peer", status="skipped", reason="unknown peer"))
    if not args.no_direct:
        targets.append(LadderTarget("direct", "direct"))
    con.print(f"overhead --ladder: {layout.describe()}", markup=False, highlight=False)

    venvs: dict[str, Path] = {}
    wanted = [t for t in targets if t.kind == "peer" and t.status == "pending"]
    if wanted:
        con.print(f"peers: checking/installing {', '.join(t.name for t in wanted)} ...")
        with ThreadPoolExecutor(len(wanted)) as pool:
            found = list(pool.map(lambda t: ensure_peer(PEERS[t.name]), wanted))
        for t, (venv, why) in zip(wanted, found, strict=True):
            if venv is None:
                t.status, t.reason = "skipped", why
            else:
                venvs[t.name] = venv
                t.version = installed_version(PEERS[t.name], venv)

    logs = Path(tempfile.mkdtemp(prefix="kvgate-overhead-"))
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, layout.others)  # this process stays off the router's core
    fleet: list[Proc] = []
    gens: LoadGens | None = None
    redis: Any = None
    caps: dict[int, CpuCap] = {}  # processes -> its cgroup (kvgate xN gets N x the share)

    def cap_for(processes: int) -> CpuCap | None:
        return caps.get(processes)

    try:
        for n in {1, *procs} if args.router_cpu is not None else ():
            caps[n] = CpuCap.create(args.router_cpu * n, f"kvgate-bench-{os.getpid()}-{n}")
        if max(procs) > 1:  # several processes share quotas and worker load through Redis
            from bench.redis_server import RedisServer

            redis = RedisServer().start()
        fleet, urls = start_sim_fleet(layout, logs)
        gens = LoadGens(layout)
        with Progress(console=con, transient=True) as prog:
            for i, t in enumerate(targets):
                if t.status != "pending":
                    continue
                con.print(f"[{time.monotonic() - t0:4.0f} s] {t.name}", markup=False)
                proc: Proc | None = None
                try:
                    if t.kind == "kvgate":
                        proc, url = start_kvgate(
                            urls,
                            logs,
                            layout.router_cores(t.processes),
                            args.policy,
                            t.processes,
                            redis.url if redis is not None else None,
                            cap_for(t.processes),
                        )
                        pid = proc.popen.pid
                    elif t.kind == "peer":
                        proc, url = start_peer(
                            PEERS[t.name],
                            venvs[t.name],
                            urls,
                            logs,
                            cores=[layout.router],
                            cap=cap_for(1),
                        )
                        pid = proc.popen.pid
                    else:
                        url, pid = urls[0], fleet[0].popen.pid
                    log = proc.log if t.kind == "kvgate" and proc is not None else None
                    run_ladder_target(t, url, pid, gens, levels, args, i, prog, con, log)
                    t.status = "ok"
                except Exception as e:  # a target that cannot run is reported, the rest run
                    t.status, t.reason = "failed", str(e)[:600]
                    con.print(f"  {t.name}: failed: {t.reason}", markup=False)
                finally:
                    if proc is not None:
                        proc.stop()
    except CpuCapError as e:
        con.print(f"overhead: --router-cpu: {e}", markup=False, highlight=False)
        return 2
    finally:
        if gens is not None:
            gens.close()
        for p in fleet:
            p.stop()
        if redis is not None:
            redis.close()
        for cap in caps.values():
            cap.remove()
        if before is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, before)
        shutil.rmtree(logs, ignore_errors=True)

    report: dict[str, Any] = {
        "mode": "ladder",
        "machine": machine(),
        "layout": layout.to_json(),
        "layout_describe": layout.describe(),
        "setup": {
            "levels": levels,
            "seconds": args.seconds,
            "warmup_s": args.warmup,
            "prompt_chars": args.prompt_chars,
            "max_tokens": args.max_tokens,
            "workers": len(layout.fleet),
            "sim": "kvgate sim --workers 1 --profile instant --max-num-seqs 1024 "
            f"--num-blocks {SIM_NUM_BLOCKS}, one process per worker",
            "kvgate": "default config" + (f", policy {args.policy}" if args.policy else ""),
            "processes": procs,
            "router_cpu": args.router_cpu,
            "kvgate_processes": "kvgate xN: server.processes = N, [quota] backend redis (no "
            "tenants: no quota calls), [cluster] on; router CPU = its processes' sum",
            "peers": {
                n: " ".join(PEERS[n].argv(Path("VENV"), 0, 0, ["WORKER_URLS"]))
                for n in peer_names
                if n in PEERS
            },
        },
        "targets": [t.to_json() for t in targets],
        "wall_s": time.monotonic() - t0,
    }
    json_path = args.json or out_path("overhead_peers.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    png = ladder_plot(report, args.png or out_path("overhead_peers.png"))
    print_table(con, ladder_table(report, args.wide))
    print_table(con, summary_table(report))
    for t in targets:
        if t.status != "ok":
            con.print(f"not measured: {t.name}: {t.status}: {t.reason}", markup=False)
        if t.flame is not None:
            print_flame(con, t.name, t.flame)
    con.print(
        f"wrote {shown(json_path)}, {shown(png)} in {report['wall_s']:.0f} s",
        markup=False,
        highlight=False,
    )
    return 0 if all(t.status == "ok" for t in targets if t.kind != "peer") else 1


# ==================================================================================================
# CLI
# ==================================================================================================


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvgate bench overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--concurrency",
        default=None,
        help=f"in-flight streams, comma-separated (default: {CLASSIC_LEVELS}; "
        f"with --ladder {LADDER_LEVELS})",
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per latency request")
    ap.add_argument(
        "--policy",
        default=None,
        help="routing policy of the gateway (default: least_loaded; with --ladder the "
        "gateway's own default, kv_aware)",
    )
    ap.add_argument(
        "--json",
        type=Path,
        default=None,
        help="results (default: bench/out/overhead.json; with --ladder overhead_peers.json)",
    )
    g = ap.add_argument_group("classic mode: added latency, relay capacity, quotas")
    g.add_argument("--requests", type=int, default=2000, help="requests per measured run")
    g.add_argument("--clients", default="aiohttp,httpx", help="gateway upstream clients to compare")
    g.add_argument(
        "--capacity-seconds", type=float, default=8.0, help="approximate capacity run length"
    )
    g.add_argument(
        "--quota-modes",
        default="off,memory,redis",
        help="quota backends for the requests/s comparison (off = no tenants)",
    )
    g = ap.add_argument_group("ladder mode: kvgate vs peer routers vs one worker, closed loop")
    g.add_argument(
        "--ladder", action="store_true", help="run the closed-loop ladder (implied by --peers)"
    )
    g.add_argument(
        "--peers",
        default="none",
        help="peer routers to add, comma-separated: smg,sglang-router,vllm-router "
        "(installed into .build/peers/ on first use; default none: works offline)",
    )
    g.add_argument(
        "--seconds",
        type=float,
        default=8.0,
        help="measured seconds per level (default: %(default)s)",
    )
    g.add_argument(
        "--warmup", type=float, default=2.0, help="warm-up seconds per level (default: %(default)s)"
    )
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="simulated worker processes (default: min(6, half the spare cores); 1 on 2 cores)",
    )
    g.add_argument("--prompt-chars", type=int, default=4000, help="characters per prompt")
    g.add_argument("--no-direct", action="store_true", help="skip the one-worker-direct row")
    g.add_argument(
        "--png", type=Path, default=None, help="plot (default: bench/out/overhead_peers.png)"
    )
    g.add_argument("--wide", action="store_true", help="every column (p90s too)")
    g.add_argument(
        "--flame",
        type=Path,
        default=None,
        metavar="SVG",
        help="record kvgate's flame graph with py-spy over one level's measured window (its "
        "collapsed stacks beside it as .txt, its top frames in the JSON and a table)",
    )
    g.add_argument(
        "--flame-at",
        type=int,
        default=None,
        metavar="C",
        help="the level --flame records (default: 64 in flight, else the highest level)",
    )
    g.add_argument(
        "--processes",
        default=None,
        help="kvgate targets by process count, comma-separated, e.g. 1,4: `kvgate x4` runs "
        "`serve --processes 4` pinned to the last 4 cores (with a local Redis, as several "
        "processes need); implies --ladder (default: 1)",
    )
    g.add_argument(
        "--router-cpu",
        type=float,
        default=None,
        metavar="F",
        help="hold every router (kvgate and each peer; not the direct worker) to F of one core "
        "with a cgroup CPU quota (10 ms period), so that the router, not the fleet, is the "
        "bottleneck on a small host: req/s / F is then what one core of it carries (a kvgate "
        "xN target gets N x F); needs root and the cgroup cpu controller; implies --ladder",
    )
    args = ap.parse_args(argv)
    con = Console() if sys.stdout.isatty() else Console(width=100)
    if args.processes is not None:
        try:
            parse_processes(args.processes)
        except ValueError as e:
            ap.error(str(e))
    if args.flame_at is not None and args.flame is None:
        ap.error("--flame-at needs --flame")
    if args.flame is not None or args.router_cpu is not None:
        args.ladder = True
    if args.ladder or args.peers.strip() not in ("", "none") or args.processes is not None:
        return ladder(args, con)
    return classic(args, con)


if __name__ == "__main__":
    sys.exit(main())
