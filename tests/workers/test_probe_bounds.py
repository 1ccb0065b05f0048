"""The prober reads every answer up to a byte cap, never whole: a worker whose `/metrics` (or any
other probed answer) is huge must not grow the gateway or stall its event loop, every interval.

A fake worker on 127.0.0.1 (a raw socket, keep-alive) serves whatever each path is set to, with a
content-length or chunked; the probe's client counts the body bytes it actually pulled off each
answer. Caps are patched down to 64 KiB so the oversized answers stay a few hundred KiB."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

import workers.probe as probe
import workers.vllm_metrics as vm
from tests.gateway.conftest import until
from tests.support.raw_worker import server
from workers.probe import Prober
from workers.registry import Registry
from workers.vllm_metrics import parse_vllm_metrics
from workers.worker import Health, WorkerSpec

CAP = 64 << 10
BIG = 512 << 10  # 8x the cap
READ = 64 << 10  # httpcore's network read: the most one chunk past the cap can add
FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm-0.32" / "metrics.txt"

MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
COMPLETION = orjson.dumps({"choices": [{"index": 0, "text": "x"}]})


def metrics(running: int, size: int = 0) -> bytes:
    """vLLM-like text the parser reads (`running` requests), padded with comments to `size`."""
    head = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running %d\n" % running
    pad = b"# padding padding padding padding padding padding padding padding\n"
    return head + pad * max(0, (size - len(head)) // len(pad) + 1) if size else head


@dataclass
class FakeWorker:
    """path -> body; `chunked` paths are sent in 16 KiB chunks without a content-length."""

    bodies: dict[str, bytes] = field(
        default_factory=lambda: {
            "/health": b"",
            "/v1/models": MODELS,
            "/metrics": metrics(3),
            "/v1/completions": COMPLETION,
        }
    )
    chunked: set[str] = field(default_factory=set)
    headers: dict[str, list[bytes]] = field(default_factory=dict)  # path -> request heads
    # Paths whose connection the client closed right after that answer (not kept for reuse).
    closed_after: list[str] = field(default_factory=list)

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        last = ""
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                path = lines[0].split(b" ")[1].decode()
                self.headers.setdefault(path, []).append(head.lower())
                n = next(
                    (
                        int(h.split(b":")[1])
                        for h in lines
                        if h.lower().startswith(b"content-length")
                    ),
                    0,
                )
                if n:
                    await r.readexactly(n)
                last = path
                body = self.bodies.get(path)
                if body is None:
                    w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                elif path in self.chunked:
                    w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    for i in range(0, len(body), 16 << 10):
                        part = body[i : i + (16 << 10)]
                        w.write(b"%x\r\n%b\r\n" % (len(part), part))
                        await w.drain()
                    w.write(b"0\r\n\r\n")
                else:
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_after.append(last)


class CountingTransport(httpx.AsyncBaseTransport):
    """Real HTTP, counting the body bytes the client pulled from each answer (by path)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.read: dict[str, list[int]] = {}  # path -> bytes read, one entry per answer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self.inner.handle_async_request(request)
        counts = self.read.setdefault(request.url.path, [])
        counts.append(0)
        inner = resp.stream
        assert isinstance(inner, httpx.AsyncByteStream)

        class Counted(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for chunk in inner:
                    counts[-1] += len(chunk)
                    yield chunk

            async def aclose(self) -> None:
                await inner.aclose()

        return httpx.Response(
            resp.status_code, headers=resp.headers, stream=Counted(), extensions=resp.extensions
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
def small_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    # raising=False: the same test runs (and fails) against a prober without caps.
    monkeypatch.setattr(probe, "METRICS_MAX_BYTES", CAP, raising=False)
    monkeypatch.setattr(probe, "ANSWER_MAX_BYTES", CAP, raising=False)


def too_large_warnings(caplog: pytest.LogCaptureFixture, path: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvgate.probe" and r.levelno == logging.WARNING and path in r.getMessage()
    ]


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
async def test_metrics_over_the_cap_is_cut_off_and_the_last_metrics_stay(
    chunked: bool, small_caps: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "kvgate.probe")
    fake = FakeWorker(chunked={"/metrics"} if chunked else set())
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)], healthy_after=1)
        transport = CountingTransport()
        async with httpx.AsyncClient(transport=transport, timeout=5) as client:
            p = Prober(reg, client, interval_s=1, timeout_s=5)
            assert await p.probe_once("w0")
            w = reg.workers["w0"]
            assert (w.health, w.metrics.running) == (Health.HEALTHY, 3)

            fake.bodies["/metrics"] = metrics(7, BIG)  # parseable, and 8x the cap
            for _ in range(2):
                # /metrics is no health check: the probe still succeeds, without its numbers.
                assert await p.probe_once("w0"), w.last_error
                assert (w.health, w.metrics.running) == (Health.HEALTHY, 3)
            big_reads = transport.read["/metrics"][1:]
            # Declared over the cap: not a byte read. Chunked: cut off one read past the cap.
            assert all(n <= (CAP + READ if chunked else 0) for n in big_reads), big_reads
            # The connection is dropped with the rest unread, not drained for reuse.
            await until(lambda: fake.closed_after.count("/metrics") >= 2, 5, "connection closed")
            assert len(too_large_warnings(caplog, "/metrics")) == 1  # once, not per probe

            fake.bodies["/metrics"] = metrics(5)
            assert await p.probe_once("w0")
            assert w.metrics.running == 5
            fake.bodies["/metrics"] = metrics(7, BIG)
            assert await p.probe_once("w0")
            assert w.metrics.running == 5
            warned = too_large_warnings(caplog, "/metrics")
            assert len(warned) == 2, warned  # it fit in between: warned again
            assert "cap" in warned[0]


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
async def test_health_or_models_over_the_cap_is_a_failed_probe(
    path: str, small_caps: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "kvgate.probe")
    fake = FakeWorker(chunked={path})
    # Still a valid answer (JSON may end in whitespace): only its size is wrong.
    fake.bodies[path] += b" " * BIG
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)])
        transport = CountingTransport()
        async with httpx.AsyncClient(transport=transport, timeout=5) as client:
            p = Prober(reg, client, interval_s=1, timeout_s=5)
            assert not await p.probe_once("w0")
            assert not await p.probe_once("w0")
    w = reg.workers["w0"]
    assert w.consecutive_failures == 2
    assert w.health is not Health.HEALTHY
    assert w.last_error.startswith(f"AnswerTooLarge: {path}: answer over"), w.last_error
    assert all(n <= CAP + READ for n in transport.read[path]), transport.read[path]
    assert len(too_large_warnings(caplog, path)) == 1


async def test_deep_probe_answer_over_the_cap_is_a_failed_probe(small_caps: None) -> None:
    fake = FakeWorker(chunked={"/v1/completions"})
    fake.bodies["/v1/completions"] += b" " * BIG
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)])
        transport = CountingTransport()
        async with httpx.AsyncClient(transport=transport, timeout=5) as client:
            p = Prober(reg, client, interval_s=1, timeout_s=5, deep_every=1, deep_timeout_s=5)
            assert not await p.probe_once("w0")
    w = reg.workers["w0"]
    assert w.last_error.startswith("deep probe (m): AnswerTooLarge"), w.last_error
    assert all(n <= CAP + READ for n in transport.read["/v1/completions"])


async def test_a_real_size_metrics_answer_parses_as_before() -> None:
    # Default caps: vLLM 0.32's own exposition (~59 KB) is read and parsed whole.
    text = FIXTURE.read_bytes()
    fake = FakeWorker(chunked={"/metrics"})
    fake.bodies["/metrics"] = text
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)], healthy_after=1)
        async with httpx.AsyncClient(timeout=5) as client:
            p = Prober(reg, client, interval_s=1, timeout_s=5, deep_every=1)
            assert await p.probe_once("w0"), reg.workers["w0"].last_error
    w = reg.workers["w0"]
    assert w.health is Health.HEALTHY
    assert w.metrics == parse_vllm_metrics(text.decode())
    assert w.metrics.block_size and w.metrics.num_blocks


async def test_probes_ask_for_an_uncompressed_answer() -> None:
    # What the cap counts is then what arrives: a compressed answer decodes to far more than
    # the bytes read (vLLM gzips /metrics on request).
    fake = FakeWorker()
    async with server(fake.handle) as (url, _):
        reg = Registry([WorkerSpec("w0", url)])
        async with httpx.AsyncClient(timeout=5) as client:
            p = Prober(reg, client, interval_s=1, timeout_s=5, deep_every=1)
            assert await p.probe_once("w0")
    for path in ("/health", "/v1/models", "/metrics", "/v1/completions"):
        assert b"accept-encoding: identity\r\n" in fake.headers[path][0], path


async def test_metrics_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under the cap, a /metrics full of lines the parser reads still costs ~20 us a line: on the
    # loop, every stream in flight would wait it out.
    threads: list[int] = []

    def spy(text: str) -> vm.WorkerMetrics:
        threads.append(threading.get_ident())
        return parse_vllm_metrics(text)

    monkeypatch.setattr(probe, "parse_vllm_metrics", spy)

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, content=MODELS)
        if req.url.path == "/metrics":
            return httpx.Response(200, content=metrics(4))
        return httpx.Response(200)

    reg = Registry([WorkerSpec("w0", "http://w0")])
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        p = Prober(reg, client, interval_s=1, timeout_s=1)
        assert await p.probe_once("w0")
    assert reg.workers["w0"].metrics.running == 4
    assert threads and threading.get_ident() not in threads


def test_more_lines_of_the_families_read_than_the_limit_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vm, "MAX_RELEVANT_LINES", 10, raising=False)
    ok = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(10))
    assert parse_vllm_metrics(ok).running == 10
    too_many = ok + 'vllm:num_requests_running{engine="10"} 1\n'
    too_large = getattr(vm, "MetricsTooLarge", None)
    assert too_large is not None and issubclass(too_large, ValueError)
    with pytest.raises(too_large):
        parse_vllm_metrics(too_many)


async def test_metrics_with_too_many_lines_read_leave_the_last_metrics(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "kvgate.probe")
    monkeypatch.setattr(vm, "MAX_RELEVANT_LINES", 10, raising=False)
    body = {"/metrics": metrics(3)}

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, content=MODELS)
        if req.url.path == "/metrics":
            return httpx.Response(200, content=body["/metrics"])
        return httpx.Response(200)

    reg = Registry([WorkerSpec("w0", "http://w0")])
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        p = Prober(reg, client, interval_s=1, timeout_s=1)
        assert await p.probe_once("w0")
        body["/metrics"] = b"".join(
            b'vllm:num_requests_running{engine="%d"} 1\n' % i for i in range(11)
        )
        assert await p.probe_once("w0")
        assert await p.probe_once("w0")
    assert reg.workers["w0"].metrics.running == 3
    assert len(too_large_warnings(caplog, "/metrics")) == 1


def test_a_family_name_inside_another_line_is_not_a_line_of_it() -> None:
    # The lines are found by name, not by splitting the text: a name in a label value or in
    # another family's HELP text must not start a line there.
    text = (
        "# HELP other_total mentions vllm:num_requests_running 9\n"
        '# TYPE other_total counter\nother_total{src="vllm:num_requests_running 9"} 1\n'
        "vllm:num_requests_running 2\n"
        "# TYPE vllm:num_requests_waiting gauge\r\nvllm:num_requests_waiting 4\r\n"
    )
    kept = vm.relevant_lines(text)
    assert "other_total" not in kept
    m = parse_vllm_metrics(text)
    assert (m.running, m.waiting) == (2, 4)
