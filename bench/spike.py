"""Overload acceptance run: a spike to 5x the simulated fleet's capacity, with and
without admission control, on 127.0.0.1.

    .venv/bin/kvgate bench spike                          # 2.5 min on 2 cores
    .venv/bin/kvgate bench spike --runs on --spike-s 10   # admission on only, shorter
    .venv/bin/kvgate bench spike --capacity 20 --priority-reserve 0.2 --out /tmp/spike

Why this shape. Overload is where a gateway either keeps its promises or becomes a FIFO in front
of a FIFO, so the run pins down the three things the issue asks for on one fleet and one seed:

1. *Capacity*: a closed loop keeps every worker slot busy (workers x max_num_seqs streams);
   throughput = slots / mean E2E. Measured, not computed, because step time grows with the batch.
2. *Baseline*: the high-priority tenant alone, at the rate it keeps during the spike (the same
   arrival times), gives its unloaded TTFT. The ratio reported is spike p99 / this p99.
3. *Spike*: the high tenant at `--high-share` of capacity plus a low-priority flood bringing the
   offered total to `--overload` x capacity, open loop (a slow server never slows the senders),
   once per `--runs` entry: `on` (the gateway's [admission] queue) and `off` (enabled = false:
   everything goes to the workers' own FIFO queues). Identical seeds, so identical schedules.

Every request is recorded (tenant, status, TTFT, E2E, error code, Retry-After, the
`x-kvgate-admission` reason). After each run the gateway must hold nothing: no quota leases or
open reservations, kvgate_tenant_in_flight and kvgate_worker_in_flight at 0, an empty queue. That
is read from inside the gateway process through a bench-only `/_bench/state` route wrapped around
the app (`--serve-gateway`), because a leaked reservation is invisible from outside.

Why `--priority-reserve 0.3` (now the gateway's default too). The reserve is the share of slots
that requests below `reserve_min_priority` may not take. Low-priority requests admitted together
finish together, so the fleet sees windows of up to a service time (~1.4 s here) in which no slot
frees: at the onset of the spike, and later whenever such a batch is running. Every high-priority
arrival in such a window needs a reserved slot, ~0.2 x slots on average at 20% of capacity (6.4
of 32), more in a Poisson burst. With 0.1 (3 slots) the next arrival waits for a low-priority
request to finish and the high tier's p99 TTFT went from 38 ms to 466 ms (12x; p90 stayed at
1.4x); with 0.3 it stayed at 1.2x. Rule of thumb: reserve >= the latency-sensitive tiers' share of
capacity plus burst headroom. The reserve is headroom, not a quota: lower tiers never take the last
`reserve` free slots, whatever the high tiers run, which costs some throughput during overload
(17.7 vs 20.1 req/s served with 0.3 vs 0.1). Withholding only the part the high tiers leave unused
was tried and measured: high-priority p99 went back to 10x, because a busy high tier then finds no
free slot.

Topology (like bench/overhead.py): the simulated workers (`python -m gateway.cli sim`, one
process) and this load generator share the other cores; the gateway runs in its own process pinned
to the last core, so the generator cannot starve it. Clients give up on a first token after
`--client-timeout` (a real client does too; without it the admission-off run would leave
thousands of sockets waiting minutes for the workers' queues to drain). Outputs: a table per run,
`spike.json` (figures + config), `spike_records.jsonl` (every request), `spike.png` (TTFT CDFs
and outcomes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from bench.metrics import dist, machine
from bench.paths import out_path
from bench.peers import free_ports
from bench.sse_client import StreamResult, stream

MODEL = "sim-llama"
CHAT_PATH = "/v1/chat/completions"
STATE_PATH = "/_bench/state"
ADMISSION_HEADER = "x-kvgate-admission"
REFUSALS = (429, 503)
DEFAULT_OUT = out_path("spike")  # git-ignored, like every bench output


# -- tenants, fleet, gateway config ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    priority: float
    queue_weight: float = 1.0

    @property
    def key(self) -> str:
        return f"kvg-bench-{self.name}"


@dataclass(slots=True)
class FleetSpec:
    """The simulated fleet and what the gateway is told about it."""

    workers: int = 4
    profile: str = "default"
    time_scale: float = 1.0
    max_num_seqs: int = 8
    num_blocks: int = 2048

    @property
    def slots(self) -> int:
        return self.workers * self.max_num_seqs


@dataclass(slots=True)
class GatewaySpec:
    """The [admission] and routing knobs a bench run varies; everything else is fixed below."""

    admission: bool = True
    priority_reserve: float = 0.3
    reserve_min_priority: float = 0.7
    deadline_s: float = 10.0
    max_queued: int = 1024
    policy: str = "kv_aware"


def gateway_toml(
    fleet: FleetSpec,
    urls: Sequence[str],
    port: int,
    tenants: Sequence[TenantSpec],
    gw: GatewaySpec,
) -> str:
    """A gateway config for the bench: quotas too generous to interfere (but present, so every
    request takes a lease and a reservation that must come back), workers capped at their
    max_num_seqs so the admission queue, not the workers' FIFOs, decides who waits."""
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "[logging]",
        'level = "warning"',
        'format = "text"',
        "requests = false",
        "[probes]",
        "interval_s = 0.5",
        "unhealthy_after = 1000",  # overload must not look like failure
        "[routing]",
        f'policy = "{gw.policy}"',
        "[upstream]",
        # The admission-off run holds every queued request open upstream: do not let the
        # gateway's own connection pool be what fails first.
        "max_connections = 8192",
        "[admission]",
        f"enabled = {str(gw.admission).lower()}",
        f"priority_reserve = {gw.priority_reserve}",
        f"reserve_min_priority = {gw.reserve_min_priority}",
        f"default_deadline_s = {gw.deadline_s}",
        f"max_deadline_s = {max(gw.deadline_s, 30.0)}",
        f"max_queued = {gw.max_queued}",
        "[quota]",
        'backend = "memory"',
    ]
    for t in tenants:
        digest = hashlib.sha256(t.key.encode()).hexdigest()
        lines += [
            f"[tenants.{t.name}]",
            f'keys_sha256 = ["{digest}"]',
            f"priority = {t.priority}",
            f"queue_weight = {t.queue_weight}",
            "rpm = 10000000",
            "tpm = 10000000000",
            "max_concurrent = 1000000",
        ]
    for i, u in enumerate(urls):
        lines += [
            "[[workers]]",
            f'name = "sim-{i + 1}"',
            f'url = "{u}"',
            f"max_concurrency = {fleet.max_num_seqs}",
        ]
    return "\n".join(lines) + "\n"


# -- processes ------------------------------------------------------------------------------------
def core_plan(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(gateway cores, everything else): the gateway gets the last core to itself."""
    if not pin or not hasattr(os, "sched_setaffinity"):
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return {cores[-1]}, set(cores[:-1])


@contextlib.contextmanager
def pinned(cores: set[int] | None) -> Iterator[None]:
    """Pin this process (the load generator) for the block, then restore its affinity."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _preexec(cores: set[int] | None) -> Callable[[], None] | None:
    if cores is None:
        return None

    def f() -> None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)

    return f


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path | None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def tail(self, n: int = 2000) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-n:]


@contextlib.contextmanager
def process(cmd: list[str], cores: set[int] | None, log: Path | None) -> Iterator[Proc]:
    """A child in its own session (killed with its group), stderr to `log` (a pipe nobody reads
    would block a chatty child)."""
    err = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        p = subprocess.Popen(
            cmd,
            preexec_fn=_preexec(cores),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    finally:
        if log is not None:
            err.close()  # type: ignore[union-attr]
    proc = Proc(p, log)
    try:
        yield proc
    finally:
        proc.stop()


def wait_ready(urls: Sequence[str], proc: Proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"child exited with {proc.popen.returncode}: {proc.tail()}")
        for u in list(pending):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(u, timeout=0.5).status_code == 200:
                    pending.discard(u)
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout:.0f}s: {sorted(pending)}: {proc.tail()}")
        time.sleep(0.05)


@dataclass
class SimProc:
    urls: list[str]
    proc: Proc


@contextlib.contextmanager
def sim_fleet(fleet: FleetSpec, cores: set[int] | None, log: Path | None) -> Iterator[SimProc]:
    port = free_ports(fleet.workers)
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port)]
    cmd += ["--workers", str(fleet.workers), "--profile", fleet.profile, "--model", MODEL]
    cmd += ["--time-scale", str(fleet.time_scale), "--max-num-seqs", str(fleet.max_num_seqs)]
    cmd += ["--num-blocks", str(fleet.num_blocks)]
    urls = [f"http://127.0.0.1:{port + i}" for i in range(fleet.workers)]
    with process(cmd, cores, log) as p:
        wait_ready([u + "/health" for u in urls], p)
        yield SimProc(urls, p)


@dataclass
class GatewayProc:
    url: str
    proc: Proc
    config: Path


@contextlib.contextmanager
def gateway_process(
    toml: str, port: int, cores: set[int] | None, log: Path | None, *, inspect: bool = True
) -> Iterator[GatewayProc]:
    """The gateway in its own process: `python -m bench.spike --serve-gateway` (the real app with
    the bench's state route) or plain `python -m gateway.cli serve`."""
    with tempfile.NamedTemporaryFile(
        "w", suffix=".toml", prefix="kvgate-bench-", delete=False
    ) as f:
        f.write(toml)
    cfg = Path(f.name)
    if inspect:
        cmd = [sys.executable, "-m", "bench.spike", "--serve-gateway", str(cfg)]
    else:
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)]
    url = f"http://127.0.0.1:{port}"
    try:
        with process(cmd, cores, log) as p:
            wait_ready([url + "/ready"], p)
            yield GatewayProc(url, p, cfg)
    finally:
        cfg.unlink(missing_ok=True)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux), for the per-phase CPU share a report states."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return math.nan


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process: what the gateway really holds (not the allocator's arena sizes)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class CpuMeter:
    """CPU share of named processes between `start()` and `stop()` (1.0 = one core)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._t0 = 0.0
        self._c0: dict[str, float] = {}

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._c0 = {k: self._cpu(k, p) for k, p in self.pids.items()}

    def stop(self) -> dict[str, float]:
        dt = max(time.monotonic() - self._t0, 1e-9)
        return {k: round((self._cpu(k, p) - self._c0[k]) / dt, 3) for k, p in self.pids.items()}

    @staticmethod
    def _cpu(name: str, pid: int) -> float:
        if pid == os.getpid():
            t = os.times()
            return t.user + t.system
        return cpu_seconds(pid)


# -- the gateway with a state route (runs in the gateway's process) --------------------------------
async def gateway_state(gw: Any) -> dict[str, Any]:
    """Everything the gateway still holds for requests: {} under "held" when quiescent.

    The same checks as the fault suite's leak check (tests/faults/conftest.py), minus the parts
    that need the in-process workers: per-worker in-flight counters, the tenants' concurrency
    leases and unsettled reservations in the memory store, the two in-flight gauges, and the
    admission queue.
    """
    from gateway.quota_memory import MemoryQuotaStore

    held: dict[str, Any] = {}
    workers = {w.name: w.in_flight for w in gw.registry.workers.values()}
    for w in gw.registry.workers.values():
        if w.in_flight or w.prefill_tokens:
            held[f"worker {w.name}"] = [w.in_flight, w.prefill_tokens]
    store = gw.quota.shared
    leases: dict[str, int] = {}
    for name in gw.settings.tenants:
        leases[name] = int((await store.usage(name))["in_flight"])
        if leases[name]:
            held[f"leases {name}"] = leases[name]
    open_res = 0
    settled = 0
    if isinstance(store, MemoryQuotaStore):
        now = time.time() * 1e6
        with store._lock:
            for r in store._records.values():
                if r.expires_us > now:
                    open_res += r.state == "open"
                    settled += r.state == "settled"
        if open_res:
            held["open reservations"] = open_res
    gauges: dict[str, float] = {}
    for fam in gw.metrics.registry.collect():
        if fam.name in ("kvgate_tenant_in_flight", "kvgate_worker_in_flight"):
            for s in fam.samples:
                key = f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}"
                gauges[key] = s.value
                if s.value:
                    held[key] = s.value
    queued = gw.admission.queued()
    if queued:
        held["admission queued"] = queued
    return {
        "held": held,
        "worker_in_flight": workers,
        "leases": leases,
        "open_reservations": open_res,
        "settled_reservations": settled,
        "in_flight_gauges": gauges,
        "admission_queued": queued,
    }


class _Inspected:
    """The gateway's ASGI app plus GET /_bench/state; one path compare per request."""

    def __init__(self, app: Any, gw: Any) -> None:
        self.app = app
        self.gw = gw

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == STATE_PATH:
            body = orjson.dumps(await gateway_state(self.gw))
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def serve_gateway(config: Path) -> int:
    """`kvgate serve`, with the state route: same app, same uvicorn settings, uvloop."""
    import uvicorn

    from gateway.asgi import create_app
    from gateway.cli import run_async
    from gateway.config import load_settings
    from gateway.logs import setup_logging

    settings = load_settings(config)
    setup_logging(settings.logging.level, settings.logging.format)
    app = create_app(settings, None)
    server = uvicorn.Server(
        uvicorn.Config(
            _Inspected(app, app.state.gateway),
            host=settings.server.host,
            port=settings.server.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
    )
    run_async(server.serve())
    return 0


# -- load generation ------------------------------------------------------------------------------
def prompt(rng: random.Random, tokens: int) -> str:
    """`tokens` common words (one simulated token each), random so no two requests share a
    cached prefix: the spike is about slots, not cache hits."""
    from workers.sim.tokenizer import VOCAB

    return "".join(rng.choices(VOCAB, k=tokens))


def chat_body(rng: random.Random, prompt_tokens: int, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt(rng, prompt_tokens)}],
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    )


def poisson(rate: float, duration: float, rng: random.Random) -> list[float]:
    out: list[float] = []
    if rate <= 0:
        return out
    t = rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(slots=True)
class Shot:
    t: float  # seconds after the phase starts
    tenant: str
    body: bytes


@dataclass(slots=True)
class Outcome:
    """One request's fate; times in seconds, `t_*` relative to its phase's start."""

    tenant: str
    t_sched: float
    t_sent: float | None = None
    status: int = 0  # 0: no HTTP response (timeout, connection error, not sent)
    ttft: float | None = None
    e2e: float | None = None
    error: str | None = None  # None when served; else http | timeout_ttft | ... | not_sent
    code: str | None = None  # error.code of an OpenAI-shaped error body
    retry_after: str | None = None
    admission: str | None = None  # x-kvgate-admission (the queue's refusal reason)
    openai_shaped: bool | None = None  # error bodies only
    worker: str | None = None  # x-kvgate-worker

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None


def _error_doc(raw: bytes) -> tuple[str | None, bool]:
    """(error.code, whether the body is the OpenAI error envelope)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, False
    if not (isinstance(doc, dict) and set(doc) == {"error"} and isinstance(doc["error"], dict)):
        return None, False
    err = doc["error"]
    shaped = (
        {"message", "type", "param", "code"} <= set(err)
        and isinstance(err["message"], str)
        and isinstance(err["type"], str)
    )
    code = err.get("code")
    return (None if code is None else str(code)), shaped


class Client:
    """Streaming chat requests with per-tenant keys, through bench.sse_client in byte mode:
    TTFT = first body bytes (the simulated worker, like vLLM, sends its role chunk together with
    the first token)."""

    def __init__(
        self,
        url: str,
        tenants: Sequence[TenantSpec],
        *,
        ttft_timeout: float,
        stream_timeout: float = 120.0,
    ) -> None:
        self.url = url.rstrip("/") + CHAT_PATH
        self.headers = {
            t.name: {"content-type": "application/json", "authorization": f"Bearer {t.key}"}
            for t in tenants
        }
        self.ttft_timeout = ttft_timeout
        self.stream_timeout = stream_timeout
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def send(self, tenant: str, body: bytes, out: Outcome, t0: float) -> None:
        """Fill `out`; never raises (except cancellation)."""
        assert self.session is not None
        res = StreamResult()
        try:
            await stream(
                self.session,
                self.url,
                body,
                self.headers[tenant],
                parse=False,
                result=res,
                ttft_timeout=self.ttft_timeout,
                stream_timeout=self.stream_timeout,
            )
        finally:
            _outcome(out, res, t0)


def _outcome(out: Outcome, res: StreamResult, t0: float) -> None:
    """`res` (bench.sse_client, byte mode: TTFT = first body bytes) into `out`, with the spike's
    error kinds: http, stream_error, empty_stream, truncated, timeout_ttft / timeout_stream (the
    client's own bounds) or the exception's type."""
    out.t_sent = res.sent_at - t0
    out.status = res.status
    out.worker = res.worker
    out.ttft = res.ttft
    if res.status not in (0, 200) and res.headers is not None:
        out.retry_after = res.headers.get("retry-after")
        out.admission = res.headers.get(ADMISSION_HEADER)
    out.e2e = res.e2e  # a refusal's: how fast it comes
    if res.stream_error:
        out.error = "stream_error"
    if res.status not in (0, 200) and res.e2e is not None:
        out.code, out.openai_shaped = _error_doc(res.body)
        out.error = "http"
    elif res.status == 200 and res.e2e is not None:
        if res.ttft is None:
            out.error = "empty_stream"
        elif out.error is None and not res.done:
            out.error = "truncated"
    if isinstance(res.exc, TimeoutError):
        out.error = "timeout_ttft" if res.ttft is None else "timeout_stream"
    elif res.exc is not None:
        out.error = type(res.exc).__name__


async def open_loop(
    client: Client,
    shots: Iterable[Shot],
    *,
    max_in_flight: int,
    on_done: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Send each shot at its time whatever the server does; past `max_in_flight` a shot is
    recorded as not sent (the generator's own bound, reported, never silently delayed).

    `shots` may be lazy (the soak's are): each is built just before it is due.
    """
    outs: list[Outcome] = []
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    in_flight = 0
    t0p = time.perf_counter()
    t0 = loop.time()

    async def run(s: Shot, o: Outcome) -> None:
        nonlocal in_flight
        try:
            await client.send(s.tenant, s.body, o, t0p)
        finally:
            in_flight -= 1
            if on_done is not None:
                on_done(o)

    for s in shots:
        o = Outcome(s.tenant, s.t)
        outs.append(o)
        delay = t0 + s.t - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if in_flight >= max_in_flight:
            o.error = "not_sent"
            if on_done is not None:
                on_done(o)
            continue
        in_flight += 1
        task = asyncio.create_task(run(s, o))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    return outs


async def closed_loop(
    client: Client,
    tenant: str,
    body: Callable[[int, int], bytes],
    concurrency: int,
    duration: float,
    warm_fraction: float = 0.3,
    on_done: Callable[[Outcome], None] | None = None,
) -> dict[str, Any]:
    """Every slot busy for `duration`: the fleet's sustained throughput, the capacity the spike
    is a multiple of.

    Little's law (throughput = concurrency / mean time per request, exact for a closed loop with
    no think time) over the requests started after the first `warm_fraction`: counting
    completions in a window instead quantizes badly, because requests started together finish
    together in batches of `concurrency`.
    """
    t0 = time.perf_counter()
    end = t0 + duration
    warm = duration * warm_fraction
    done: list[tuple[float, float, float]] = []  # (sent, e2e, ttft) of measured requests
    failed = 0

    async def lane(k: int) -> None:
        nonlocal failed
        i = 0
        while time.perf_counter() < end:
            o = Outcome(tenant, 0.0)
            await client.send(tenant, body(k, i), o, t0)
            i += 1
            if o.ok and o.e2e is not None and o.ttft is not None and o.t_sent is not None:
                if o.t_sent >= warm:
                    done.append((o.t_sent, o.e2e, o.ttft))
            else:
                failed += 1
            if on_done is not None:
                on_done(o)

    await asyncio.gather(*(lane(k) for k in range(concurrency)))
    e2e = [d[1] for d in done]
    rate = concurrency / (sum(e2e) / len(e2e)) if e2e else 0.0
    return {
        "requests_per_s": rate,
        "method": "closed loop, concurrency / mean E2E (Little's law)",
        "concurrency": concurrency,
        "duration_s": duration,
        "measured_requests": len(done),
        "failed": failed,
        "e2e_s": dist(e2e),
        "ttft_s": dist([d[2] for d in done]),
    }


async def fetch_state(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5.0) as c:
        return (await c.get(url + STATE_PATH)).json()


async def wait_quiescent(url: str, timeout: float) -> dict[str, Any]:
    """Poll the gateway's state until it holds nothing (or `timeout`); the last state, with the
    seconds it took after the last response."""
    t0 = time.monotonic()
    while True:
        st = await fetch_state(url)
        if not st["held"] or time.monotonic() - t0 > timeout:
            st["settle_s"] = round(time.monotonic() - t0, 3)
            return st
        await asyncio.sleep(0.1)


async def scrape(url: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """Flat `name{labels}` -> value of the gateway's /metrics lines starting with `prefixes`."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=5.0) as c:
        text = (await c.get(url + "/metrics")).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(prefixes) and not s.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# -- summaries ------------------------------------------------------------------------------------
def summarize(outs: Sequence[Outcome], duration: float) -> dict[str, Any]:
    """Per-tenant outcome counts and latency distributions (seconds) of the successes."""
    out: dict[str, Any] = {}
    for tenant in sorted({o.tenant for o in outs}):
        rs = [o for o in outs if o.tenant == tenant]
        ok = [o for o in rs if o.ok]
        refused = [o for o in rs if o.status in REFUSALS]
        statuses = Counter(o.status for o in rs if o.t_sent is not None)
        errors = Counter(o.error for o in rs if o.error and o.error != "http")
        other_http = sum(n for s, n in statuses.items() if s not in (0, 200, *REFUSALS))
        out[tenant] = {
            "offered": len(rs),
            "sent": sum(1 for o in rs if o.t_sent is not None),
            "ok": len(ok),
            "s429": statuses.get(429, 0),
            "s503": statuses.get(503, 0),
            "other_http": other_http,
            "timeouts": errors.get("timeout_ttft", 0) + errors.get("timeout_stream", 0),
            "not_sent": errors.get("not_sent", 0),
            "errors": dict(errors),
            "status_counts": {str(k): v for k, v in sorted(statuses.items())},
            "codes": dict(Counter(o.code for o in rs if o.code)),
            "admission_reasons": dict(Counter(o.admission for o in rs if o.admission)),
            "refused_without_retry_after": sum(1 for o in refused if not o.retry_after),
            "errors_not_openai_shaped": sum(
                1 for o in rs if o.error == "http" and o.openai_shaped is False
            ),
            "ok_ratio": len(ok) / len(rs) if rs else None,
            # Finished inside the window: what the fleet delivered while the load lasted.
            "served_per_s": sum(1 for o in ok if (o.t_sent or 0.0) + (o.e2e or 0.0) <= duration)
            / duration
            if duration > 0
            else None,
            "ttft_s": dist([o.ttft for o in ok if o.ttft is not None]),
            "e2e_s": dist([o.e2e for o in ok if o.e2e is not None]),
            "refusal_latency_s": dist([o.e2e for o in refused if o.e2e is not None]),
        }
    return out


# -- the run --------------------------------------------------------------------------------------
@dataclass(slots=True)
class SpikeOptions:
    fleet: FleetSpec = field(default_factory=FleetSpec)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    high: TenantSpec = TenantSpec("high", 0.9)
    low: TenantSpec = TenantSpec("low", 0.2)
    prompt_tokens: int = 256
    max_tokens: int = 128
    capacity: float = 0.0  # requests/s; 0 = measure
    capacity_s: float = 8.0
    high_share: float = 0.2  # high tenant's rate, fraction of capacity
    overload: float = 5.0  # offered total, multiple of capacity
    unloaded_s: float = 30.0
    spike_s: float = 30.0
    client_timeout_s: float = 15.0
    max_in_flight: int = 4000
    runs: tuple[str, ...] = ("on", "off")
    seed: int = 1
    pin: bool = True
    quiesce_timeout_s: float = 20.0
    out: Path | None = DEFAULT_OUT
    show_progress: bool = True

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out) if self.out is not None else None
        d["runs"] = list(self.runs)
        return d


RUN_NAMES = {"on": "admission on", "off": "admission off"}


def _shots(opts: SpikeOptions, tag: str, rates: dict[str, float], duration: float) -> list[Shot]:
    """Each tenant's Poisson arrivals from its own seeded stream (so the high tenant's times are
    the same in the baseline and both spikes); prompts differ per `tag`, so no run is served
    from the previous run's prefix cache."""
    shots: list[Shot] = []
    for tenant, rate in rates.items():
        times = poisson(rate, duration, random.Random(f"{opts.seed}:arrivals:{tenant}"))
        rng = random.Random(f"{opts.seed}:prompts:{tag}:{tenant}")
        shots += [
            Shot(t, tenant, chat_body(rng, opts.prompt_tokens, opts.max_tokens)) for t in times
        ]
    shots.sort(key=lambda s: s.t)
    return shots


class Phases:
    """Progress bars for the phases, and the event loop they run on."""

    def __init__(self, console: Console, show: bool) -> None:
        self.progress = Progress(
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[note]}"),
            console=console,
            disable=not show,
            transient=False,
        )
        self.runner = _runner()

    def __enter__(self) -> Phases:
        self.progress.__enter__()
        self.runner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runner.__exit__(*exc)
        self.progress.__exit__(*exc)

    def task(self, name: str, total: float | None) -> tuple[TaskID, Callable[[Outcome], None]]:
        tid = self.progress.add_task(name, total=total, note="")
        counts: Counter[str] = Counter()

        def done(o: Outcome) -> None:
            counts["ok" if o.ok else (str(o.status) if o.status else (o.error or "?"))] += 1
            note = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            self.progress.update(tid, advance=1, note=note)

        return tid, done

    def finish(self, tid: TaskID) -> None:
        """An open-ended task (no total) is done: stop its clock."""
        task = next(t for t in self.progress.tasks if t.id == tid)
        self.progress.update(tid, total=task.completed)

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.runner.run(coro)  # type: ignore[arg-type]


def _runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def run_spike(opts: SpikeOptions, console: Console | None = None) -> dict[str, Any]:
    """The whole acceptance run; returns the result document (also written under `opts.out`)."""
    console = console or Console()
    gw_cores, other = core_plan(opts.pin)
    tenants = (opts.high, opts.low)
    out = opts.out
    logs = out if out is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "bench": "spike",
        "config": opts.to_json(),
        "machine": machine(),
        "topology": {
            "gateway_cores": sorted(gw_cores) if gw_cores else "unpinned",
            "sims_and_load_generator_cores": sorted(other) if other else "unpinned",
        },
        "runs": {},
    }
    records: list[dict[str, Any]] = []

    def keep(phase: str, outs: Sequence[Outcome]) -> None:
        records.extend({"phase": phase, **asdict(o)} for o in outs)

    body_rng = random.Random(f"{opts.seed}:capacity")

    def cap_body(k: int, i: int) -> bytes:
        return chat_body(body_rng, opts.prompt_tokens, opts.max_tokens)

    with (
        pinned(other),
        sim_fleet(opts.fleet, other, logs / "sim.log" if logs else None) as sims,
        Phases(console, opts.show_progress) as ph,
    ):
        for i, run_name in enumerate(opts.runs):
            gspec = replace(opts.gateway, admission=run_name == "on")
            port = free_ports(1)
            toml = gateway_toml(opts.fleet, sims.urls, port, tenants, gspec)
            log = logs / f"gateway_{run_name}.log" if logs else None
            with gateway_process(toml, port, gw_cores, log) as gw:
                pids = {
                    "gateway": gw.proc.pid,
                    "sims": sims.proc.pid,
                    "load_generator": os.getpid(),
                }
                client = Client(gw.url, tenants, ttft_timeout=opts.client_timeout_s)
                if i == 0:
                    cap, unloaded = _baseline(ph, opts, client, pids, cap_body)
                    res["capacity"] = cap
                    res["unloaded"] = unloaded
                    keep("unloaded", unloaded.pop("_outcomes"))
                    capacity = cap["requests_per_s"]
                    rates = {
                        opts.high.name: opts.high_share * capacity,
                        opts.low.name: max(0.0, opts.overload - opts.high_share) * capacity,
                    }
                    res["rates_per_s"] = rates
                else:
                    ph.run(warm_up(client, tenants, opts.seed, opts.prompt_tokens))
                shots = _shots(opts, f"spike-{run_name}", rates, opts.spike_s)
                meter = CpuMeter(pids)
                _, done = ph.task(f"spike ({RUN_NAMES[run_name]})", len(shots))
                meter.start()
                t0 = time.monotonic()
                outs = ph.run(_with_client(client, shots, opts.max_in_flight, done))
                wall = time.monotonic() - t0
                cpu = meter.stop()
                state = ph.run(wait_quiescent(gw.url, opts.quiesce_timeout_s))
                adm = ph.run(scrape(gw.url, ("kvgate_admission_outcomes",)))
                keep(f"spike-{run_name}", outs)
                run = {
                    "gateway": asdict(gspec),
                    "wall_s": round(wall, 3),
                    "cpu_cores": cpu,
                    "tenants": summarize(outs, opts.spike_s),
                    "after": state,
                    "lost_reservations": _lost(state),
                    "admission_outcomes": {k: v for k, v in adm.items() if v},
                }
                _ratios(run, res["unloaded"], opts.high.name)
                res["runs"][run_name] = run
    if out is not None:
        (out / "spike.json").write_text(json.dumps(res, indent=2, default=_json_default))
        with open(out / "spike_records.jsonl", "wb") as f:
            for r in records:
                f.write(orjson.dumps(r) + b"\n")
        with contextlib.suppress(ImportError):
            plot(res, records, out / "spike.png", opts)
        res["outputs"] = [str(out / n) for n in ("spike.json", "spike_records.jsonl", "spike.png")]
    res["_records"] = records
    return res


def _json_default(o: object) -> object:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(type(o).__name__)


def _baseline(
    ph: Phases,
    opts: SpikeOptions,
    client: Client,
    pids: dict[str, int],
    cap_body: Callable[[int, int], bytes],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Capacity (measured unless given) and the high tenant's unloaded latency."""
    ph.run(warm_up(client, (opts.high, opts.low), opts.seed, opts.prompt_tokens))
    slots = opts.fleet.slots
    if opts.capacity > 0:
        cap: dict[str, Any] = {"requests_per_s": opts.capacity, "measured": False}
    else:
        tid, done = ph.task("capacity (closed loop)", None)
        meter = CpuMeter(pids)
        meter.start()
        cap = ph.run(closed_run(client, opts.high.name, cap_body, slots, opts.capacity_s, done))
        cap["cpu_cores"] = meter.stop()
        ph.finish(tid)
        cap["measured"] = True
    cap["slots"] = slots
    rate = opts.high_share * cap["requests_per_s"]
    shots = _shots(opts, "unloaded", {opts.high.name: rate}, opts.unloaded_s)
    _, done = ph.task("unloaded (high only)", len(shots))
    meter = CpuMeter(pids)
    meter.start()
    outs = ph.run(_with_client(client, shots, opts.max_in_flight, done))
    unloaded = {
        "rate_per_s": rate,
        "duration_s": opts.unloaded_s,
        "cpu_cores": meter.stop(),
        "tenants": summarize(outs, opts.unloaded_s),
        "_outcomes": outs,
    }
    return cap, unloaded


async def _with_client(
    client: Client, shots: Sequence[Shot], max_in_flight: int, done: Callable[[Outcome], None]
) -> list[Outcome]:
    async with client:
        return await open_loop(client, shots, max_in_flight=max_in_flight, on_done=done)


async def closed_run(
    client: Client,
    tenant: str,
    body: Callable[[int, int], bytes],
    concurrency: int,
    duration: float,
    done: Callable[[Outcome], None],
) -> dict[str, Any]:
    async with client:
        return await closed_loop(client, tenant, body, concurrency, duration, on_done=done)


async def warm_up(
    client: Client, tenants: Sequence[TenantSpec], seed: int, prompt_tokens: int
) -> None:
    """A few short requests per tenant: imports, pools and caches warm before anything counts."""
    rng = random.Random(f"{seed}:warm")
    async with client:
        for _ in range(2):
            outs = [Outcome(t.name, 0.0) for t in tenants for _ in range(4)]
            await asyncio.gather(
                *(client.send(o.tenant, chat_body(rng, prompt_tokens, 4), o, 0.0) for o in outs)
            )


def _lost(state: dict[str, Any]) -> int:
    """Reservations the gateway never gave back: open records, leases, tenant in-flight."""
    tenant_gauges = sum(
        v for k, v in state["in_flight_gauges"].items() if k.startswith("kvgate_tenant")
    )
    return int(state["open_reservations"] + sum(state["leases"].values()) + tenant_gauges)


def _ratios(run: dict[str, Any], unloaded: dict[str, Any], high: str) -> None:
    base = unloaded["tenants"].get(high, {}).get("ttft_s", {})
    spike = run["tenants"].get(high, {}).get("ttft_s", {})
    ratios = {}
    for q in ("p50", "p90", "p99"):
        b, s = base.get(q), spike.get(q)
        ratios[q] = s / b if b and s is not None else None
    run["high_ttft_ratio_vs_unloaded"] = ratios


# -- report ---------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def tables(res: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    cap = res["capacity"]
    un = res["unloaded"]
    rates = res["rates_per_s"]
    for name, run in res["runs"].items():
        t = Table(
            title=f"Spike to {res['config']['overload']:g}x capacity, {RUN_NAMES[name]} "
            f"({cap['requests_per_s']:.1f} req/s capacity; offered "
            + ", ".join(f"{k} {v:.1f}/s" for k, v in rates.items())
            + f" for {res['config']['spike_s']:g} s)"
        )
        cols = ["tenant", "offered", "ok", "429", "503", "other", "timeout", "not sent"]
        cols += ["TTFT p50 ms", "p90 ms", "p99 ms", "p99 / unloaded"]
        for c in cols:
            t.add_column(c, justify="right" if c != "tenant" else "left")
        base = un["tenants"].get(res["config"]["high"]["name"])
        if base:
            d = base["ttft_s"]
            t.add_row(
                "high, unloaded",
                str(base["offered"]),
                str(base["ok"]),
                str(base["s429"]),
                str(base["s503"]),
                str(base["other_http"]),
                str(base["timeouts"]),
                str(base["not_sent"]),
                _ms(d["p50"]),
                _ms(d["p90"]),
                _ms(d["p99"]),
                "1.00",
            )
        for tenant, s in run["tenants"].items():
            d = s["ttft_s"]
            ratio = ""
            if tenant == res["config"]["high"]["name"]:
                r = run["high_ttft_ratio_vs_unloaded"]["p99"]
                ratio = "-" if r is None else f"{r:.2f}"
            t.add_row(
                tenant,
                str(s["offered"]),
                str(s["ok"]),
                str(s["s429"]),
                str(s["s503"]),
                str(s["other_http"] + sum(
                    n for k, n in s["errors"].items()
                    if k not in ("timeout_ttft", "timeout_stream", "not_sent")
                )),
                str(s["timeouts"]),
                str(s["not_sent"]),
                _ms(d["p50"]),
                _ms(d["p90"]),
                _ms(d["p99"]),
                ratio,
            )  # fmt: skip
        lost = run["lost_reservations"]
        held = run["after"]["held"]
        t.caption = (
            f"lost reservations: {lost}; still held after {run['after']['settle_s']} s: "
            f"{held or 'nothing'}; CPU (cores): "
            + ", ".join(f"{k} {v:.2f}" for k, v in run["cpu_cores"].items())
        )
        out.append(t)
    return out


def plot(
    res: dict[str, Any], records: Sequence[dict[str, Any]], path: Path, opts: SpikeOptions
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    phases = ["unloaded", *(f"spike-{r}" for r in res["runs"])]
    styles = {"unloaded": ":", "spike-on": "-", "spike-off": "--"}
    colors = {opts.high.name: "tab:blue", opts.low.name: "tab:orange"}
    for phase in phases:
        for tenant in (opts.high.name, opts.low.name):
            xs = sorted(
                r["ttft"]
                for r in records
                if r["phase"] == phase and r["tenant"] == tenant and r["error"] is None
                and r["ttft"] is not None
            )  # fmt: skip
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            label = phase.replace("spike-", "admission ") + f": {tenant} (n={len(xs)})"
            ax.step(
                [x * 1000 for x in xs],
                ys,
                where="post",
                linestyle=styles.get(phase, "-"),
                color=colors[tenant],
                label=label,
            )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT of served requests (ms, log)")
    ax.set_ylabel("fraction of served requests")
    ax.axhline(0.99, color="grey", linewidth=0.5)
    ax.set_title("TTFT CDF per tenant and run")
    ax.legend(fontsize=8, loc="center")
    ax.grid(alpha=0.3)

    kinds = ["ok", "429", "503", "timeout", "other"]
    kcolors = ["tab:green", "tab:orange", "tab:red", "tab:purple", "tab:grey"]
    labels: list[str] = []
    rows: list[list[float]] = []
    for run_name, run in res["runs"].items():
        for tenant, s in run["tenants"].items():
            n = max(1, s["offered"])
            other = s["offered"] - s["ok"] - s["s429"] - s["s503"] - s["timeouts"]
            rows.append([s["ok"] / n, s["s429"] / n, s["s503"] / n, s["timeouts"] / n, other / n])
            labels.append(f"{run_name}: {tenant}")
    left = [0.0] * len(rows)
    for k, (kind, col) in enumerate(zip(kinds, kcolors, strict=True)):
        vals = [r[k] for r in rows]
        bx.barh(labels, vals, left=left, color=col, label=kind)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    bx.set_xlim(0, 1)
    bx.set_xlabel("share of offered requests")
    bx.set_title("outcomes during the spike")
    bx.legend(fontsize=8, loc="lower right")
    bx.invert_yaxis()
    fig.suptitle(
        f"kvgate spike: {opts.fleet.workers} sim workers ({opts.fleet.profile}, "
        f"max_num_seqs {opts.fleet.max_num_seqs}), {opts.overload:g}x capacity"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- CLI ------------------------------------------------------------------------------------------
def add_fleet_args(ap: argparse.ArgumentParser) -> None:
    """The fleet and request-shape flags spike and soak share."""
    g = ap.add_argument_group("fleet")
    g.add_argument("--workers", type=int, default=4, help="simulated workers")
    g.add_argument("--profile", default="default", help="sim timing profile (default|fast|instant)")
    g.add_argument("--time-scale", type=float, default=1.0, help="sim step-time multiplier")
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        help="per-worker batch size; also the gateway's max_concurrency for it",
    )
    g.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    g.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (tokens)")
    g.add_argument("--max-tokens", type=int, default=128, help="output tokens (ignore_eos)")
    g.add_argument("--policy", default="kv_aware", help="gateway routing policy")
    g.add_argument("--capacity", type=float, default=0.0, help="fleet req/s; 0 = measure it")
    g.add_argument("--capacity-s", type=float, default=8.0, help="closed-loop capacity run length")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin the gateway to a core"
    )
    g.add_argument("--no-progress", dest="progress", action="store_false")


def fleet_from_args(args: argparse.Namespace) -> FleetSpec:
    return FleetSpec(
        workers=args.workers,
        profile=args.profile,
        time_scale=args.time_scale,
        max_num_seqs=args.max_num_seqs,
        num_blocks=args.num_blocks,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvgate bench spike",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--serve-gateway", type=Path, default=None, help=argparse.SUPPRESS)
    add_fleet_args(ap)
    g = ap.add_argument_group("load")
    g.add_argument("--overload", type=float, default=5.0, help="offered total / capacity")
    g.add_argument("--high-share", type=float, default=0.2, help="high tenant rate / capacity")
    g.add_argument("--high-priority", type=float, default=0.9)
    g.add_argument("--low-priority", type=float, default=0.2)
    g.add_argument("--unloaded-s", type=float, default=30.0, help="baseline length (high only)")
    g.add_argument("--spike-s", type=float, default=30.0, help="spike length, per run")
    g.add_argument(
        "--client-timeout", type=float, default=15.0, help="clients give up on a first token"
    )
    g.add_argument("--max-in-flight", type=int, default=4000, help="load generator's bound")
    g.add_argument("--runs", default="on,off", help="admission on and/or off, in this order")
    a = ap.add_argument_group("gateway [admission]")
    a.add_argument(
        "--priority-reserve",
        type=float,
        default=0.3,
        help="share of slots kept free for priority >= --reserve-min-priority (the gateway's "
        "default is 0.1; see the module docstring for why the bench uses 0.3)",
    )
    a.add_argument("--reserve-min-priority", type=float, default=0.7)
    a.add_argument("--deadline-s", type=float, default=10.0, help="default_deadline_s")
    a.add_argument("--max-queued", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="%(default)s")
    args = ap.parse_args(argv)
    if args.serve_gateway is not None:
        return serve_gateway(args.serve_gateway)
    runs = tuple(r for r in args.runs.split(",") if r)
    if not runs or any(r not in RUN_NAMES for r in runs):
        ap.error("--runs takes on, off or on,off")
    opts = SpikeOptions(
        fleet=fleet_from_args(args),
        gateway=GatewaySpec(
            priority_reserve=args.priority_reserve,
            reserve_min_priority=args.reserve_min_priority,
            deadline_s=args.deadline_s,
            max_queued=args.max_queued,
            policy=args.policy,
        ),
        high=TenantSpec("high", args.high_priority),
        low=TenantSpec("low", args.low_priority),
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        capacity=args.capacity,
        capacity_s=args.capacity_s,
        high_share=args.high_share,
        overload=args.overload,
        unloaded_s=args.unloaded_s,
        spike_s=args.spike_s,
        client_timeout_s=args.client_timeout,
        max_in_flight=args.max_in_flight,
        runs=runs,
        seed=args.seed,
        pin=args.pin,
        out=args.out,
        show_progress=args.progress,
    )
    con = Console(width=None if sys.stdout.isatty() else 150)
    res = run_spike(opts, con)
    for t in tables(res):
        con.print(t)
    cap = res["capacity"]
    con.print(
        f"[dim]capacity {cap['requests_per_s']:.1f} req/s "
        f"({'measured' if cap['measured'] else 'given'}, {cap['slots']} slots); "
        f"{res['machine']['cores']} cores ({res['machine']['cpu']}), gateway on "
        f"{res['topology']['gateway_cores']}; outputs: {', '.join(res.get('outputs', []))}[/dim]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
