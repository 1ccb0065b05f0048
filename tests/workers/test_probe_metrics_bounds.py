"""`/metrics` is no health check, and what it said does not rule forever.

- A slow or trickling `/metrics` (a busy frontend rendering histograms, a proxy dribbling bytes)
  timed the whole probe out: the worker was ejected although `/health` and `/v1/models` answered
  at once, and a fleet slow to scrape under load all went out. It now has its own bound; running
  out of it is "no numbers this round", like a 404.
- The last good scrape was kept whenever a probe brought none, for good: a "KV 95% full" from
  before `/metrics` broke left a worker that served fine with no room (every request waited out
  its deadline, 503). After `METRICS_STALE_AFTER` probes in a row without a reading it is
  dropped to unknown, and the gateway's own in-flight counts decide.

A fake worker on 127.0.0.1 (a raw socket, keep-alive) answers `/health` and `/v1/models` at once
and `/metrics` as each test sets it. Timing is by bounded polling only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import httpx
import orjson
import pytest

import workers.registry as registry_module
from gateway.config import AdmissionSettings
from gateway.slots import Slots
from scoring.views import RoutingOptions
from tests.gateway.conftest import until
from tests.support.raw_worker import server
from workers.probe import Prober
from workers.registry import Registry
from workers.vllm_metrics import WorkerMetrics
from workers.worker import Health, WorkerSpec

MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
# Old code has no such constant: the bound the fix documents.
STALE_AFTER: int = getattr(registry_module, "METRICS_STALE_AFTER", 3)
STARTED = 1_700_000_000.0
CAP = AdmissionSettings().worker_concurrency


def exposition(kv: float, running: int) -> bytes:
    return (
        b"process_start_time_seconds %f\n"
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} %f\n'
        b'vllm:num_requests_running{engine="0",model_name="m"} %d\n' % (STARTED, kv, running)
    )


FULL = exposition(0.95, 3)  # saturated (saturation_kv 0.9): no room while it is believed


@dataclass
class FakeWorker:
    """`metrics` says how `/metrics` answers: "ok" (`body`), "500", "404", "garbage", "reset"
    (the connection closed unanswered), "slow" (never answers; held until the client leaves)
    or "trickle" (chunked, 4 bytes every 20 ms, for up to a minute)."""

    metrics: str = "ok"
    body: bytes = FULL
    models: int = 200  # /v1/models' status (its body: MODELS at 200, none otherwise)
    scrapes: int = 0  # /metrics requests received

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            if path == b"/health":
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            elif path == b"/v1/models":
                if self.models == 200:
                    w.write(_ok(MODELS))
                else:
                    w.write(b"HTTP/1.1 %d Nope\r\ncontent-length: 0\r\n\r\n" % self.models)
            elif path == b"/metrics":
                self.scrapes += 1
                if not await self._metrics(r, w):
                    return
            else:
                w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await w.drain()

    async def _metrics(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        """Answer one `/metrics`; False when the connection is done."""
        mode = self.metrics
        if mode == "ok":
            w.write(_ok(self.body))
        elif mode == "500":
            w.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nboom")
        elif mode == "404":
            w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
        elif mode == "garbage":
            w.write(_ok(b"vllm:kv_cache_usage_perc abc\n"))
        elif mode == "reset":
            return False
        elif mode == "slow":
            await r.read(1)  # until the client gives up and closes
            return False
        elif mode == "trickle":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(3000):  # a minute: far past any bound here
                w.write(b"4\r\n# x\n\r\n")
                await w.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.02):
                        if not await r.read(1):
                            return False  # the client closed it
            w.write(b"0\r\n\r\n")
        return True


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)


def slots(reg: Registry) -> Slots:
    return Slots(reg, AdmissionSettings(), RoutingOptions(), top_priority=1.0)


def records(
    caplog: pytest.LogCaptureFixture, text: str, level: int = logging.INFO
) -> list[logging.LogRecord]:
    """Records at `level` or above saying `text` (the repeats are logged at DEBUG)."""
    return [r for r in caplog.records if r.levelno >= level and text in r.getMessage()]


@pytest.mark.parametrize("mode", ["slow", "trickle"])
async def test_a_slow_or_trickling_metrics_is_no_failed_probe(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake = FakeWorker()
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)], healthy_after=1, unhealthy_after=2)
        async with httpx.AsyncClient(timeout=5) as client:
            # httpx's own read timeout (twice this, per read) never trips on the trickle.
            p = Prober(reg, client, interval_s=1, timeout_s=0.5)
            assert await p.probe_once("w0")
            w = reg.workers["w0"]
            assert (w.health, w.metrics.kv_usage) == (Health.HEALTHY, 0.95)

            fake.metrics = mode
            for i in range(STALE_AFTER + 2):
                ok = await p.probe_once("w0")
                assert ok, f"probe {i + 1}: {w.last_error}"
                assert w.health is Health.HEALTHY
                assert (w.consecutive_failures, w.last_error) == (0, "")
            assert fake.scrapes == STALE_AFTER + 3  # asked every time, never waited out

            # Its numbers are unknown now, not the old "KV full": it is routable, with room.
            assert w.metrics == WorkerMetrics(process_start=STARTED)
            assert w.in_flight_at_scrape is None
            assert reg.candidates("m") == [w]
            assert slots(reg).worker_room(w) == CAP
    slow = records(caplog, "/metrics not answered within", logging.WARNING)
    assert len(slow) == 1, [r.getMessage() for r in slow]  # once, not every probe


async def test_a_fleet_whose_metrics_trickle_stays_in_through_the_probe_loop() -> None:
    # The probe tasks as the gateway runs them: none of the workers may ever go out.
    fakes = [FakeWorker(metrics="trickle") for _ in range(3)]
    went: list[tuple[str, Health]] = []
    async with contextlib.AsyncExitStack() as stack:
        urls = [(await stack.enter_async_context(server(f.handle)))[0] for f in fakes]
        reg = Registry(
            [WorkerSpec(f"w{i}", u) for i, u in enumerate(urls)],
            healthy_after=1,
            unhealthy_after=2,
            on_change=lambda w, was: went.append((w.name, w.health)),
        )
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=5))
        p = Prober(reg, client, interval_s=0.05, timeout_s=0.3)
        p.sync()
        try:
            await until(lambda: all(f.scrapes >= 5 for f in fakes), 60, "5 scrapes each")
        finally:
            await p.stop()
    assert went == [(f"w{i}", Health.HEALTHY) for i in range(3)], went
    assert all(w.health is Health.HEALTHY for w in reg.workers.values())
    assert all(w.consecutive_failures == 0 for w in reg.workers.values())


@pytest.mark.parametrize("mode", ["500", "404", "garbage", "reset", "slow"])
async def test_a_kv_full_reading_is_dropped_once_metrics_stop_coming(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake = FakeWorker()
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)], healthy_after=1)
        room = slots(reg).worker_room
        async with httpx.AsyncClient(timeout=5) as client:
            p = Prober(reg, client, interval_s=1, timeout_s=0.5)
            assert await p.probe_once("w0")
            w = reg.workers["w0"]
            assert (w.metrics.kv_usage, w.metrics.running) == (0.95, 3)
            assert room(w) == 0  # believed full

            fake.metrics = mode
            for _ in range(STALE_AFTER - 1):
                # One lost scrape is no reason to forget: the reading is kept for a while.
                assert await p.probe_once("w0"), w.last_error
                assert (w.metrics.kv_usage, room(w)) == (0.95, 0)
            assert await p.probe_once("w0"), w.last_error
            # The bound: unknown now, as before a first scrape; the gateway's counts decide.
            assert w.metrics == WorkerMetrics(process_start=STARTED)
            assert w.in_flight_at_scrape is None
            assert room(w) == CAP
            w.in_flight = 5  # its own in-flight requests count against the cap
            assert room(w) == CAP - 5
            w.in_flight = 0
            for _ in range(2):
                assert await p.probe_once("w0")
                assert room(w) == CAP

            stale = records(caplog, "no /metrics reading for")
            assert len(stale) == 1, [r.getMessage() for r in stale]  # once, not every probe
            assert stale[0].levelno == logging.WARNING and "w0" in stale[0].getMessage()

            fake.metrics, fake.body = "ok", exposition(0.2, 1)
            assert await p.probe_once("w0")
            assert (w.metrics.kv_usage, w.metrics.running) == (0.2, 1)
            assert w.in_flight_at_scrape == 0
            back = records(caplog, "/metrics read again")
            assert len(back) == 1, [r.getMessage() for r in back]

            # A fresh "full" rules again, and a second outage is reported again.
            fake.body = FULL
            assert await p.probe_once("w0")
            assert room(w) == 0
            fake.metrics = mode
            for _ in range(STALE_AFTER):
                assert await p.probe_once("w0")
            assert room(w) == CAP
            assert len(records(caplog, "no /metrics reading for")) == 2
    assert w.health is Health.HEALTHY


async def test_a_worker_without_metrics_is_never_reported_stale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # OpenAI-compatible servers without Prometheus: nothing was ever read, nothing to drop.
    caplog.set_level(logging.DEBUG)
    fake = FakeWorker(metrics="404")
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)], healthy_after=1)
        async with httpx.AsyncClient(timeout=5) as client:
            p = Prober(reg, client, interval_s=1, timeout_s=1)
            for _ in range(STALE_AFTER + 2):
                assert await p.probe_once("w0")
    w = reg.workers["w0"]
    assert w.metrics == WorkerMetrics()
    assert w.health is Health.HEALTHY
    assert not records(caplog, "no /metrics reading for")
    assert not records(caplog, "/metrics read again")


async def test_a_failed_probe_counts_as_a_missing_reading() -> None:
    # A probe that fails (here /v1/models, with /metrics fine) brings no reading either; the
    # worker is ejected, and when it comes back it is not routed on what it said before.
    fake = FakeWorker()
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)], healthy_after=1, unhealthy_after=2)
        async with httpx.AsyncClient(timeout=5) as client:
            p = Prober(reg, client, interval_s=1, timeout_s=1)
            assert await p.probe_once("w0")
            w = reg.workers["w0"]
            assert w.metrics.kv_usage == 0.95
            fake.models = 503
            for _ in range(STALE_AFTER):
                assert not await p.probe_once("w0")
            assert w.health is Health.UNHEALTHY
            assert w.metrics == WorkerMetrics(process_start=STARTED)
            assert w.in_flight_at_scrape is None
            fake.models = 200
            assert await p.probe_once("w0")
            assert (w.health, w.metrics.kv_usage) == (Health.HEALTHY, 0.95)
