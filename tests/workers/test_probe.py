"""The prober against answers a worker should not give, and its timeouts across a reload: no
answer may end a worker's probe task (nothing restarts it), and a reloaded `timeout_s` must
reach the HTTP requests, not only the outer deadline."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.gateway.conftest import until
from tests.support.raw_worker import Script, server
from workers.probe import Prober
from workers.registry import Registry
from workers.worker import Health, WorkerSpec

MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}

Handler = Callable[[httpx.Request], httpx.Response]


def healthy_worker(metrics: str = "vllm:num_requests_running 0\n") -> Handler:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if req.url.path == "/metrics":
            return httpx.Response(200, text=metrics)
        return httpx.Response(200)

    return handler


@pytest.mark.parametrize("body", [b"[]", b"null", b'"ready"'], ids=["list", "null", "string"])
async def test_models_body_that_is_not_an_object_is_a_failed_probe(body: bytes) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, content=body)  # valid JSON, not an object
        return healthy_worker()(req)

    r = Registry([WorkerSpec("w0", "http://w0")])
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        p = Prober(r, client, interval_s=1, timeout_s=1)
        assert not await p.probe_once("w0")
    w = r.workers["w0"]
    assert w.consecutive_failures == 1
    assert w.last_error.startswith("ProbeError: /v1/models: not a JSON object"), w.last_error


async def test_infinite_gauge_is_skipped_and_the_probe_succeeds() -> None:
    text = "vllm:num_requests_waiting +Inf\nvllm:num_requests_running 3\n"
    r = Registry([WorkerSpec("w0", "http://w0")])
    transport = httpx.MockTransport(healthy_worker(text))
    async with httpx.AsyncClient(transport=transport) as client:
        p = Prober(r, client, interval_s=1, timeout_s=1)
        assert await p.probe_once("w0")
    m = r.workers["w0"].metrics
    assert (m.running, m.waiting) == (3, 0)


async def test_probe_loop_survives_an_unexpected_exception_counts_it_and_keeps_probing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A transport that raises something no except clause names: stands for any answer, or bug,
    # that nothing in probe_once foresaw.
    state = {"raise": True, "raised": 0}
    ok = healthy_worker()

    def handler(req: httpx.Request) -> httpx.Response:
        if state["raise"] and req.url.path == "/health":
            state["raised"] += 1
            raise RuntimeError("boom")
        return ok(req)

    r = Registry([WorkerSpec("w0", "http://w0")], unhealthy_after=2, backoff_initial_s=0.01)
    r.probe_ok("w0", MODELS["data"], None)
    w = r.workers["w0"]
    caplog.set_level(logging.DEBUG, "kvgate.probe")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        p = Prober(r, client, interval_s=0.01, timeout_s=1)
        p.sync()
        try:
            await until(
                lambda: w.health is Health.UNHEALTHY and state["raised"] >= 3, 2, "counted out"
            )
            assert w.last_error == "probe raised RuntimeError: boom"
            state["raise"] = False
            await until(lambda: w.health is Health.HEALTHY, 2, "probed back in")
            assert not p._tasks["w0"].done()
        finally:
            await p.stop()
    # Logged with the worker's name, and the traceback once however often it repeats.
    errors = [rec for rec in caplog.records if rec.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert "worker w0: probe raised RuntimeError: boom" in errors[0].getMessage()


async def test_reloaded_timeout_is_sent_with_every_probe_request() -> None:
    seen: list[dict[str, float | None]] = []
    ok = healthy_worker()

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.extensions["timeout"])
        return ok(req)

    r = Registry([WorkerSpec("w0", "http://w0")])
    # Built as the gateway builds it: connect bounded by [timeouts] connect_s.
    timeout = httpx.Timeout(0.3, connect=0.1)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), timeout=timeout) as client:
        p = Prober(r, client, interval_s=1, timeout_s=0.3)
        p.timeout_s = 3.0  # what Gateway.apply does on reload
        assert await p.probe_once("w0")
        raised = seen[:]
        seen.clear()
        p.timeout_s = 0.05  # lower than the connect bound: that shrinks too
        assert await p.probe_once("w0")
    assert len(raised) == 3  # /health, /v1/models, /metrics
    # Twice the bounds: the probe's own bound (which forgives the gateway's stalls up to its
    # length again) decides, not httpx, which counts them.
    assert all(t == {"connect": 0.2, "read": 6.0, "write": 6.0, "pool": 6.0} for t in raised)
    assert all(t == dict.fromkeys(("connect", "read", "write", "pool"), 0.1) for t in seen)


def slow_health(delay_s: float) -> Script:
    """/health answers after `delay_s`, on a real socket: only then does httpx's own read
    timeout, not just the outer deadline, decide. One request per connection, so no handler
    outlives its answer for the loop's teardown to cancel."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n", 1)[0]
        body = b""
        if line.startswith(b"GET /health"):
            await asyncio.sleep(delay_s)
        elif line.startswith(b"GET /v1/models"):
            body = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
        head = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
        writer.write(head % len(body) + body)
        await writer.drain()

    return handler


async def test_reloaded_longer_timeout_lets_a_slow_health_answer_through() -> None:
    async with server(slow_health(0.3)) as (url, _):
        r = Registry([WorkerSpec("w0", url)])
        # connect bounded generously: a loaded host's loopback connect is not what this tests
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.1, connect=5)) as client:
            p = Prober(r, client, interval_s=1, timeout_s=0.1)
            assert not await p.probe_once("w0")  # 0.3 s > 0.1 s
            p.timeout_s = 5.0
            assert await p.probe_once("w0"), r.workers["w0"].last_error
    assert r.workers["w0"].health is Health.HEALTHY


async def test_a_probe_of_the_old_url_does_not_admit_the_new_one_after_a_reload() -> None:
    # The old server answers (slowly) while a reload moves the name to a new URL that is down:
    # reported by name, its 200 made the new record healthy without it ever answering.
    served: set[str] = set()

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "new":
            raise httpx.ConnectError("connection refused", request=req)
        if req.url.path == "/health":
            await asyncio.sleep(0.3)
        served.add(req.url.path)
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        return httpx.Response(200 if req.url.path == "/health" else 404)

    reg = Registry([WorkerSpec("w0", "http://old:8000")], healthy_after=1)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        pr = Prober(reg, client, interval_s=5.0, timeout_s=2.0)
        pr.sync()
        await asyncio.sleep(0.1)  # the probe of the old URL is in flight
        reg.sync([WorkerSpec("w0", "http://new:8000")])
        pr.sync()
        try:
            await until(lambda: {"/v1/models", "/metrics"} <= served, 5, "the old server answered")
            for _ in range(10):  # the rest of that probe runs without waiting on anything
                await asyncio.sleep(0)
            assert reg.workers["w0"].health is not Health.HEALTHY
        finally:
            await pr.stop()


@contextlib.contextmanager
def worker_thread() -> Iterator[str]:
    """A healthy worker on its own thread and loop: it answers at once while the test's loop,
    which the prober runs on, is held up."""
    ready, done = threading.Event(), threading.Event()
    box: list[str] = []

    def run() -> None:
        async def main() -> None:
            async with server(slow_health(0.0)) as (url, _):
                box.append(url)
                ready.set()
                await asyncio.to_thread(done.wait)

        asyncio.run(main())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield box[0]
    finally:
        done.set()
        t.join(10)


async def test_the_gateways_own_stalls_do_not_time_a_probe_out() -> None:
    """Review: the probe's bound counted the gateway's own stalls, so a loop slowed by a spike
    timed out every probe of healthy, serving workers and ejected them all (then 503s). Each
    turn of the loop here takes 0.1 s: a probe of a worker that answers at once takes W of
    that; bounded at W / 1.5 it still succeeds (the stalls are forgiven up to the bound
    again), where counting them timed it out."""
    stop = False

    async def hog() -> None:
        while not stop:
            time.sleep(0.1)  # noqa: ASYNC251 (the loop's turn, taken by other work)
            await asyncio.sleep(0)

    with worker_thread() as url:
        r = Registry([WorkerSpec("w0", url)])
        async with httpx.AsyncClient() as client:
            h = asyncio.create_task(hog())
            try:
                p = Prober(r, client, interval_s=1, timeout_s=60)
                t0 = time.perf_counter()
                assert await p.probe_once("w0"), r.workers["w0"].last_error
                took = time.perf_counter() - t0
                p.timeout_s = took / 1.5
                assert await p.probe_once("w0"), r.workers["w0"].last_error
                # Bounded at a quarter, it times out with the loop stalled all along: that says
                # nothing of the worker, and is not counted against it.
                p.timeout_s = took / 4
                assert not await p.probe_once("w0")
                assert p.stalled_probes == 1 and r.workers["w0"].consecutive_failures == 0
            finally:
                stop = True
                await h
    assert r.workers["w0"].health is Health.HEALTHY
