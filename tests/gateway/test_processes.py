"""`kvgate serve --processes N` (gateway/supervisor.py), run for real.

The real command as a subprocess, a real redis-server (quotas and [cluster] are shared through
it), simulated workers in a child process, everything on 127.0.0.1: both processes serve and one
scrape of /metrics covers both; SIGTERM drains (a stream in flight completes, then exit 0); a
process killed with SIGKILL is restarted while the other serves, and one that hangs is killed
and restarted; a killed supervisor's children drain and exit; SIGHUP and POST /admin/reload reach
every process; configs that cannot be shared (memory quotas), a port in use and children that
cannot start end the command with an error instead of a restart loop. Bounds are generous: the
cores are shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.redis_server import RedisServer, free_port
from gateway.config import load_settings
from gateway.metrics import merge_expositions
from gateway.process_child import tcp_socket
from gateway.supervisor import Supervisor, process_count
from tests.gateway.conftest import MODEL, flat_metrics, settings_for

REPO = Path(__file__).resolve().parents[2]
SLOW = ("--time-scale", "20")  # steps of 20-40 ms: a 60-token stream lasts 1-3 s
ADMIN_KEY = "kvg-admin-processes-test"


# -- harness -------------------------------------------------------------------------------------


def config_text(port: int, urls: list[str], redis_url: str, **extra: str) -> str:
    lines = [
        "[server]",
        f"port = {port}",
        f"drain_grace_s = {extra.get('drain_grace_s', '20')}",
        f"watch_config = {extra.get('watch_config', 'true')}",
        "[logging]",
        'level = "info"',
        'format = "text"',
        "requests = false",
        "[probes]",
        "interval_s = 0.2",
        "[quota]",
        f'backend = "{extra.get("backend", "redis")}"',
        f'redis_url = "{redis_url}"',
        "[cluster]",
        # Off in the file: the supervisor turns it on for its children.
        f'key_prefix = "kvgate:{{p-{uuid.uuid4().hex[:8]}}}:"',
        "[admission]",
        f"max_queued = {extra.get('max_queued', '1024')}",
        "[admin]",
        f'key_sha256 = "{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"',
    ]
    for i, u in enumerate(urls):
        lines += ["[[workers]]", f'name = "w{i}"', f'url = "{u}"']
    return "\n".join(lines) + "\n"


def child_pids(ppid: int) -> list[int]:
    """Children of `ppid` (from /proc): what a test must never leave behind."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(d.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(pred: Callable[[], bool], timeout: float, what: str, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            if pred():
                return
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"{what}: kvgate exited ({proc.proc.returncode}):\n{proc.tail()}")
        if time.monotonic() > deadline:
            tail = proc.tail() if proc is not None else ""
            raise AssertionError(f"not within {timeout}s: {what}\n{tail}")
        time.sleep(0.1)


@dataclass
class Gateway:
    """A running `kvgate serve` (supervisor and children) and its log."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    processes: int
    workers: int
    known_children: set[int] = field(default_factory=set)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def metrics(self) -> dict[str, float]:
        return flat_metrics(self.metrics_text())

    def pids(self, m: dict[str, float] | None = None) -> dict[int, int]:
        """process index -> pid, from the [cluster] replica ids (host-pid-random)."""
        m = self.metrics() if m is None else m
        out = {}
        for k in m:
            if k.startswith("kvgate_cluster_replica{"):
                labels = dict(p.split("=", 1) for p in k[k.index("{") + 1 : -1].split(","))
                out[int(labels["process"].strip('"'))] = int(labels["id"].strip('"').split("-")[-2])
        self.known_children |= set(out.values())
        return out

    def serving(self) -> bool:
        """Every process listening and seeing every worker healthy."""
        if self.processes == 1:
            r = httpx.get(self.url + "/ready", timeout=5)
            return r.status_code == 200 and r.json()["healthy_workers"] == self.workers
        m = self.metrics()
        if m.get('kvgate_processes{state="serving"}') != self.processes:
            return False
        if m.get('kvgate_processes{state="scraped"}') != self.processes:
            return False
        up = [
            m.get(f'kvgate_worker_up{{process="{k}",worker="w{i}"}}')
            for k in range(self.processes)
            for i in range(self.workers)
        ]
        return all(v == 1 for v in up) and len(self.pids(m)) == self.processes

    def stop(self) -> None:
        """Whatever state the test left it in: SIGTERM, then SIGKILL for every process left."""
        if self.proc.poll() is None:
            self.known_children |= set(child_pids(self.proc.pid))
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.known_children:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def gateways() -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def start(config: Path, *, processes: int = 2, workers: int = 2, wait: bool = True) -> Gateway:
        port = load_settings(config).server.port
        log = config.with_suffix(".log")
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
        cmd += ["--processes", str(processes)]
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
        gw = Gateway(proc, f"http://127.0.0.1:{port}", log, processes, workers)
        started.append(gw)
        if wait:
            wait_until(gw.serving, 90, "every process serving", gw)
        return gw

    yield start
    for gw in started:
        gw.stop()


def write_config(tmp_path: Path, urls: list[str], redis: RedisServer, **extra: str) -> Path:
    path = tmp_path / "kvgate.toml"
    path.write_text(config_text(free_port(), urls, redis.url, **extra), encoding="utf-8")
    return path


def chat(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Hello {uuid.uuid4().hex}"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def burst(url: str, n: int) -> list[int]:
    """`n` requests at once, each on a connection of its own (spread over the processes)."""
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(60)) as s:

        async def one() -> int:
            async with s.post(url + "/v1/chat/completions", json=chat(4)) as r:
                await r.read()
                return r.status

        return await asyncio.gather(*(one() for _ in range(n)))


def requests_by_process(m: dict[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in m.items():
        if k.startswith("kvgate_requests_total{"):
            p = int(k.split('process="')[1].split('"')[0])
            out[p] = out.get(p, 0.0) + v
    return out


# -- end to end ----------------------------------------------------------------------------------


def test_both_processes_serve_and_one_scrape_covers_them(
    tmp_path: Path, sims: Any, redis: RedisServer, gateways: Callable[..., Gateway]
) -> None:
    fleet = sims(2)
    gw = gateways(write_config(tmp_path, fleet.urls, redis))
    statuses = asyncio.run(burst(gw.url, 64)) + asyncio.run(burst(gw.url, 64))
    assert statuses == [200] * 128

    text = gw.metrics_text()
    # One HELP/TYPE per family, and the whole exposition parses.
    assert text.count("# TYPE kvgate_requests_total ") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all("process" in s.labels for s in families["kvgate_requests"].samples)
    m = flat_metrics(text)
    by_process = requests_by_process(m)
    assert sum(by_process.values()) == 128  # sum without(process) is the gateway's total
    assert set(by_process) == {0, 1} and min(by_process.values()) > 0, by_process
    assert m['kvgate_processes{state="target"}'] == 2
    assert m['kvgate_processes{state="live"}'] == 2
    assert m['kvgate_processes{state="scraped"}'] == 2
    assert m["kvgate_process_restarts_total"] == 0
    assert all(m[f'kvgate_processes_scrape_errors_total{{process="{k}"}}'] == 0 for k in (0, 1))
    # Each process is a [cluster] replica of its own; both count both.
    pids = gw.pids(m)
    assert len(set(pids.values())) == 2 and gw.proc.pid not in pids.values()
    assert all(m[f'kvgate_cluster_replicas{{process="{k}"}}'] == 2 for k in (0, 1))

    # /health and /ready say which process answered; fresh connections reach both.
    seen: dict[int, int] = {}
    for _ in range(40):
        with httpx.Client() as c:
            body = c.get(gw.url + "/health").json()
        seen[body["process"]] = body["pid"]
        assert body["processes"]["target"] == 2 and body["processes"]["live"] == 2
    assert seen == pids
    r = httpx.get(gw.url + "/ready")
    assert r.status_code == 200 and r.json()["process"] in (0, 1)


def test_sigterm_drains_every_process_then_exits_0(
    tmp_path: Path, sims: Any, redis: RedisServer, gateways: Callable[..., Gateway]
) -> None:
    fleet = sims(1, *SLOW)
    gw = gateways(write_config(tmp_path, fleet.urls, redis), workers=1)
    pids = gw.pids()
    events: list[bytes] = []

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            req = c.build_request("POST", gw.url + "/v1/chat/completions", json=chat(60, True))
            r = await c.send(req, stream=True)
            assert r.status_code == 200
            chunks = r.aiter_raw()
            events.append(await chunks.__anext__())
            gw.proc.send_signal(signal.SIGTERM)
            # Every process drains: /ready fails and new work is refused, wherever it lands.
            await asyncio.sleep(0.5)
            answered = 0
            for _ in range(6):
                # A process with nothing in flight is done draining at once and closes its
                # listener: a connection the kernel queued there in that instant is reset.
                with contextlib.suppress(httpx.ConnectError, httpx.ReadError):
                    async with httpx.AsyncClient(timeout=10) as fresh:
                        assert (await fresh.get(gw.url + "/ready")).status_code == 503
                        refused = await fresh.post(gw.url + "/v1/chat/completions", json=chat(4))
                        assert refused.status_code == 503, refused.text
                        answered += 1
            assert answered
            async for chunk in chunks:  # the stream in flight finishes
                events.append(chunk)
            await r.aclose()

    asyncio.run(scenario())
    body = b"".join(events)
    assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
    assert gw.proc.wait(60) == 0, gw.tail()
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10, "children gone")
    assert "draining" in gw.log.read_text()


def test_a_killed_process_is_restarted_while_the_other_serves(
    tmp_path: Path, sims: Any, redis: RedisServer, gateways: Callable[..., Gateway]
) -> None:
    fleet = sims(2)
    gw = gateways(write_config(tmp_path, fleet.urls, redis, drain_grace_s="2"))
    before = gw.pids()
    os.kill(before[0], signal.SIGKILL)
    # Meanwhile every new connection reaches the process still alive.
    for _ in range(20):
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat(4), timeout=30)
        assert r.status_code == 200, r.text

    def restarted() -> bool:
        m = gw.metrics()
        now = gw.pids(m)
        return (
            m.get("kvgate_process_restarts_total") == 1
            and gw.serving()
            and now.get(0) not in (None, before[0])
            and now[1] == before[1]
        )

    wait_until(restarted, 60, "process 0 restarted", gw)
    assert "process 0" in gw.tail(200) and "restarting it in" in gw.tail(200)
    base = requests_by_process(gw.metrics())
    assert asyncio.run(burst(gw.url, 64)) == [200] * 64
    after = requests_by_process(gw.metrics())
    assert after.get(0, 0) > base.get(0, 0), (base, after)  # the new process 0 takes its share

    # The supervisor dies without a word (SIGKILL): its children see their lifeline close and
    # drain themselves instead of serving on unsupervised.
    children = list(gw.pids().values())
    run_dirs = [p for p in Path(tempfile.gettempdir()).glob("kvgate-*") if _run_dir_of(p, children)]
    assert len(run_dirs) == 1
    gw.proc.kill()
    gw.proc.wait(10)
    wait_until(lambda: not any(pid_alive(p) for p in children), 30, "orphans drained and gone")
    assert not run_dirs[0].exists()  # the last one out removed the supervisor's run directory


def _run_dir_of(path: Path, pids: list[int]) -> bool:
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return False
    return sorted(state.get("pids", {}).values()) == sorted(pids)


@pytest.mark.parametrize("processes", [1, 2])
def test_sighup_and_admin_reload_reach_every_process(
    tmp_path: Path,
    sims: Any,
    redis: RedisServer,
    gateways: Callable[..., Gateway],
    processes: int,
) -> None:
    """With `server.watch_config` off, an edit is read only when SIGHUP or POST /admin/reload
    asks, and either reaches every process. (The edit goes through a hard link in another
    directory, which the watcher, were it on, would also see: through its watch of the file.)"""
    fleet = sims(1)
    port = free_port()
    # The watcher would apply any edit by itself (its file watch, its stat poll): off, so a
    # reload shows SIGHUP or /admin/reload reached the process.
    text_a = config_text(port, fleet.urls, redis.url, watch_config="false")
    text_b = config_text(port, fleet.urls, redis.url, max_queued="77", watch_config="false")
    conf, elsewhere = tmp_path / "conf", tmp_path / "elsewhere"
    conf.mkdir()
    elsewhere.mkdir()
    (conf / "kvgate.toml").write_text(text_a, encoding="utf-8")
    os.link(conf / "kvgate.toml", elsewhere / "kvgate.toml")  # one file, two directories
    gw = gateways(conf / "kvgate.toml", processes=processes, workers=1)

    def reloads() -> list[float]:
        m = gw.metrics()
        if processes == 1:
            return [m["kvgate_config_reloads_total"]]
        return [m[f'kvgate_config_reloads_total{{process="{k}"}}'] for k in range(processes)]

    def edit(text: str) -> None:
        (elsewhere / "kvgate.toml").write_text(text, encoding="utf-8")  # in place: same inode
        assert (conf / "kvgate.toml").read_text(encoding="utf-8") == text

    edit(text_b)
    time.sleep(1.0)
    assert reloads() == [0] * processes  # the watcher did not load it
    gw.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: reloads() == [1] * processes, 20, "every process reloaded", gw)
    assert gw.proc.poll() is None

    # POST /admin/reload reaches one process; it passes the reload on to the others.
    edit(text_b.replace("max_queued = 77", "max_queued = 78"))
    r = httpx.post(
        gw.url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    )
    assert r.status_code == 200, r.text
    wait_until(lambda: reloads() == [2] * processes, 20, "every process reloaded again", gw)


@pytest.mark.parametrize("how", ["flag", "file"])
def test_memory_quotas_with_several_processes_are_refused(
    tmp_path: Path, redis: RedisServer, how: str
) -> None:
    cfg = write_config(tmp_path, ["http://127.0.0.1:9"], redis, backend="memory")
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)]
    if how == "flag":
        cmd += ["--processes", "2"]
    else:
        cfg.write_text(cfg.read_text().replace("[server]\n", "[server]\nprocesses = 2\n"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and 'backend = "redis"' in err[0] and "processes = 2" in err[0], err


def test_a_port_in_use_ends_the_start_with_an_error(tmp_path: Path, redis: RedisServer) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        cfg = tmp_path / "kvgate.toml"
        cfg.write_text(config_text(port, ["http://127.0.0.1:9"], redis.url), encoding="utf-8")
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)]
        r = subprocess.run(
            [*cmd, "--processes", "2"], capture_output=True, text=True, timeout=60, cwd=REPO
        )
    assert r.returncode == 1
    assert "cannot listen" in r.stderr and "in use" in r.stderr, r.stderr


# -- the supervisor alone, with stand-in children -------------------------------------------------

# A child that says it is serving, then dies: the supervisor must restart it with a backoff.
CRASHING_CHILD = """
import json, os, sys, time
spec = json.loads(sys.argv[sys.argv.index("--child") + 1])
os.write(spec["ready_fd"], b"ready\\n")
time.sleep(0.1)
sys.exit(7)
"""

# Fake children's start: `serve(metrics=True)` answers on the metrics socket the supervisor's
# watchdog reads (as a real child does), then tells the supervisor the child is serving.
CHILD_START = """
import asyncio, json, os, sys, time
spec = json.loads(sys.argv[sys.argv.index("--child") + 1])
async def serve(metrics=True):
    if metrics:
        async def answer(r, w):
            w.write(b"# HELP x x\\n")
            w.close()
        path = os.path.join(spec["run_dir"], f"metrics-{spec['index']}.sock")
        await asyncio.start_unix_server(answer, path)
    os.write(spec["ready_fd"], b"ready\\n")
"""

# A child that says it is serving and then answers on its metrics socket (as a real one does),
# or never does (`hang`: alive, silent, like a process whose event loop is stuck).
QUIET_CHILD = (
    CHILD_START
    + """
async def main():
    await serve(metrics=sys.argv[1] != "hang")
    await asyncio.sleep(3600)
asyncio.run(main())
"""
)

# A child that drains on SIGTERM, as a real one does (its server's handler). The test of a child
# stuck during the stop needs it: a signal left at its default action is acted on by the kernel
# even in a stopped process, which then died of the forwarded SIGTERM instead of hanging (that
# test then failed about one run in three).
DRAINING_CHILD = (
    CHILD_START
    + """
import signal
async def main():
    await serve()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: os._exit(0))
    await asyncio.sleep(3600)
asyncio.run(main())
"""
)

SUPERVISE = """
import sys
from gateway.logs import setup_logging
from gateway.supervisor import Supervisor
from tests.gateway.conftest import settings_for
setup_logging("info", "text")
s = settings_for([], quota={"backend": "redis"}, server={"port": int(sys.argv[1])})
child = [sys.executable, "-c", sys.argv[2], *sys.argv[3:]]
sys.exit(Supervisor(s, child, 2, watch_interval_s=0.2, hung_after_s=1.5).run())
"""


def supervise(tmp_path: Path, child: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "sup.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", SUPERVISE, str(free_port()), child, *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    return proc, log


def test_children_that_cannot_start_end_the_start(tmp_path: Path) -> None:
    s = settings_for([], quota={"backend": "redis"})
    sup = Supervisor(s, [sys.executable, "-c", "import sys; sys.exit(3)"], 2)
    t0 = time.monotonic()
    assert sup.run() == 1
    assert time.monotonic() - t0 < 30
    assert all(slot.starts == 1 for slot in sup.slots)  # never restarted
    assert not Path(sup.run_dir).exists()


def test_crashed_children_are_restarted_with_a_doubling_backoff(tmp_path: Path) -> None:
    proc, log = supervise(tmp_path, CRASHING_CHILD)
    try:
        wait_until(lambda: "restarting it in 2.0 s" in log.read_text(), 60, "third restart")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    text = log.read_text()
    assert "exited with code 7 after" in text and "is serving" in text, text
    for delay in ("0.5", "1.0", "2.0"):
        assert f"restarting it in {delay} s" in text, text


@pytest.mark.parametrize("mode", ["hang", "answer"])
def test_a_hung_child_is_killed_and_restarted(tmp_path: Path, mode: str) -> None:
    proc, log = supervise(tmp_path, QUIET_CHILD, mode)
    try:
        wait_until(lambda: log.read_text().count("is serving") >= 2, 30, "children serving")
        if mode == "hang":
            wait_until(lambda: "restarting it in" in log.read_text(), 30, "hung child restarted")
        else:
            time.sleep(4.0)  # > hung_after_s, several watch intervals: answering, never killed
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    text = log.read_text()
    if mode == "hang":
        assert "has not answered for" in text and "killing it (hung)" in text, text
        assert "exited with signal SIGKILL" in text, text
    else:
        assert "has not answered" not in text and "restarting" not in text, text
        assert code == 0, text


def test_a_child_that_hangs_during_the_stop_is_killed_and_the_stop_ends(tmp_path: Path) -> None:
    # Process review: the watchdog stopped with the first SIGTERM, so a child whose loop was
    # stuck (here: stopped) never took the forwarded SIGTERM and the stop waited for it forever.
    proc, log = supervise(tmp_path, DRAINING_CHILD)
    kids: list[int] = []
    try:
        wait_until(lambda: log.read_text().count("is serving") >= 2, 30, "children serving")
        kids = child_pids(proc.pid)
        assert len(kids) == 2, kids
        os.kill(kids[0], signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)  # within hung_after_s: the stop begins first
        code = proc.wait(60)
    finally:
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "killing it (hung)" in text, text
    assert code == 1, text  # ended, and not cleanly: one child had to be killed


# -- units ---------------------------------------------------------------------------------------


def _exposition(proc: int) -> bytes:
    r = CollectorRegistry()
    c = Counter("kvgate_t_requests", "Requests", ["model"], registry=r)
    c.labels("m").inc(proc + 1)
    Gauge("kvgate_t_open", "Open", registry=r).set(10 * (proc + 1))
    h = Histogram("kvgate_t_seconds", "Seconds", buckets=(1.0,), registry=r)
    h.observe(0.5)
    return generate_latest(r)


def test_merge_labels_every_sample_and_keeps_one_help_per_family() -> None:
    text = merge_expositions([("0", _exposition(0)), ("1", _exposition(1))]).decode()
    assert text.count("# HELP kvgate_t_requests_total ") == 1
    assert text.count("# TYPE kvgate_t_seconds histogram") == 1
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = [s for f in fams.values() for s in f.samples]
    assert samples and all(s.labels.get("process") in ("0", "1") for s in samples)
    req = {
        s.labels["process"]: s.value
        for s in fams["kvgate_t_requests"].samples
        if s.name.endswith("_total")
    }
    assert req == {"0": 1.0, "1": 2.0} and all(
        s.labels["model"] == "m" for s in fams["kvgate_t_requests"].samples
    )
    opened = {s.labels["process"]: s.value for s in fams["kvgate_t_open"].samples}
    assert opened == {"0": 10.0, "1": 20.0}
    counts = [
        s.value for s in fams["kvgate_t_seconds"].samples if s.name == "kvgate_t_seconds_count"
    ]
    assert counts == [1.0, 1.0]
    # A process missing from a scrape leaves the others' series whole.
    alone = merge_expositions([("1", _exposition(1))]).decode()
    assert 'kvgate_t_open{process="1"} 20.0' in alone


def test_a_child_listening_on_ipv6_any_does_not_take_ipv4() -> None:
    # Process review: one process's "::" listener is IPv6 only (asyncio sets IPV6_V6ONLY); the
    # children's own sockets were dual-stack, so N processes also listened on 0.0.0.0.
    for host in ("::", "::1"):
        with contextlib.closing(tcp_socket(host)) as sock:
            assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
    with contextlib.closing(tcp_socket("127.0.0.1")) as sock:
        assert sock.family == socket.AF_INET


def test_process_count() -> None:
    assert process_count(3) == 3 and process_count("2") == 2
    assert process_count("auto") == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError):
        process_count(0)


def test_server_processes_setting() -> None:
    from gateway.config import ServerSettings

    assert ServerSettings().processes == 1
    assert ServerSettings(processes="auto").processes == "auto"
    for bad in (0, True, "many"):
        with pytest.raises(ValueError):
            ServerSettings(processes=bad)


def test_child_spec_round_trips() -> None:
    from gateway.process_child import ChildSpec

    spec = ChildSpec(index=1, processes=4, run_dir="/tmp/x", ready_fd=5, lifeline_fd=6, port=80)
    assert ChildSpec.from_arg(spec.to_arg()) == spec
    assert json.loads(spec.to_arg())["index"] == 1
