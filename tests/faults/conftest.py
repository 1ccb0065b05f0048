"""Fault-suite harness: simulated workers and the gateway in this test's event loop.

Unlike tests/gateway (workers in a child process), the workers run in-process here so a test can
read their engines directly (running/waiting requests, abort counts) and the gateway's uvicorn
server is kept so a test can look at its connections' write buffers. Only 127.0.0.1.

`assert_quiescent` is the leak check every fault test ends with: nothing in flight anywhere (the
gateway's per-worker counters, the tenants' concurrency leases and open reservations, the
workers' engines, the server's request tasks). `MemoryWatch` is the other half: the Python heap
of this process (gateway, in-process workers, clients) back near where it was before the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from prometheus_client import generate_latest

from gateway.app import Gateway
from gateway.config import Settings
from gateway.quota_memory import MemoryQuotaStore
from gateway.quota_redis import RedisQuotaStore
from tests.gateway.conftest import MODEL, flat_metrics, run_gateway, settings_for
from tests.support.sim_workers import SimFleet, run_sim_workers

__all__ = ["MODEL"]

# Two tenants: "capped" caps max_tokens at 16 and isolates its cache (so its bodies are always
# re-serialized by the gateway); "open" has no output cap (its bodies go upstream byte for byte
# unless streaming). Limits are high enough never to interfere, except the concurrency cap.
KEY_CAPPED = "kvg-fault-capped"
KEY_OPEN = "kvg-fault-open"
TENANTS = ("capped", "open")
MAX_CONCURRENT = 8
BODY_LIMIT = 64 * 1024
# Heap growth allowed across a fault run of ~100 requests (measured: 70-230 KiB): what legitimately
# stays is prefix-index and session entries, settled markers, lazily built state. A leak of ~10 KiB
# per request (a response buffer, a task, a reservation) fails it; slow leaks are for the soak
# bench, which watches RSS for 10 minutes.
HEAP_LIMIT = 1024 * 1024


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def fault_settings(
    urls: list[str],
    *,
    max_body_bytes: int = BODY_LIMIT,
    tenants: Mapping[str, Mapping[str, Any]] | None = None,
    **sections: Any,
) -> Settings:
    server = {"max_body_bytes": max_body_bytes, **sections.pop("server", {})}
    quota = {"backend": "memory", **sections.pop("quota", {})}
    probes = {"interval_s": 0.5, "timeout_s": 2.0, "unhealthy_after": 1000}
    data = settings_for(
        urls,
        quota=quota,
        server=server,
        probes={**probes, **sections.pop("probes", {})},
        **sections,
    ).model_dump()
    common = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max_concurrent": MAX_CONCURRENT}
    data["tenants"] = {
        "capped": {
            "keys_sha256": [sha(KEY_CAPPED)],
            **common,
            "max_output_tokens": 16,
            "default_max_tokens": 8,
            "isolate_cache": True,
        },
        "open": {"keys_sha256": [sha(KEY_OPEN)], **common, "default_max_tokens": 8},
    }
    for name, over in (tenants or {}).items():
        data["tenants"][name].update(over)
    return Settings(**data)


@dataclass
class Stack:
    url: str
    port: int
    gw: Gateway
    server: uvicorn.Server
    fleet: SimFleet | None  # None: the workers run in child processes

    def metrics(self) -> dict[str, float]:
        return flat_metrics(generate_latest(self.gw.metrics.registry).decode())

    def engine_counts(self) -> dict[str, float]:
        """Finished-request counts by reason, summed over the workers' engines."""
        out: dict[str, float] = {}
        for w in self.fleet.workers if self.fleet else ():
            for reason, n in w.engine.stats().request_success.items():
                out[reason] = out.get(reason, 0) + n
        return out

    def client_transports(self) -> list[Any]:
        """The gateway's server-side transports, one per open client connection."""
        conns = self.server.server_state.connections
        return [t for c in conns if (t := getattr(c, "transport", None)) is not None]

    async def leaks(self) -> dict[str, Any]:
        """Everything still held; {} when the stack is quiescent."""
        held: dict[str, Any] = {}
        gw = self.gw
        for w in gw.registry.workers.values():
            if w.in_flight or w.prefill_tokens:
                held[f"worker {w.name}"] = (w.in_flight, w.prefill_tokens)
        store = gw.quota.shared
        for name in TENANTS:
            n = (await store.usage(name))["in_flight"]
            if n:
                held[f"leases {name}"] = n
        if isinstance(store, MemoryQuotaStore):
            now = time.time() * 1e6
            open_recs = [
                k for k, r in store._records.items() if r.state == "open" and r.expires_us > now
            ]
            if open_recs:
                held["open reservations"] = open_recs
        elif isinstance(store, RedisQuotaStore):
            open_recs = []
            async for k in store.client.scan_iter(f"{gw.settings.quota.key_prefix}*:res:*"):
                if await store.client.hget(k, "state") == b"open":
                    open_recs.append(k)
            if open_recs:
                held["open reservations"] = open_recs
        if gw.quota.deferred:
            held["deferred settlements"] = gw.quota.deferred
        for k, v in self.metrics().items():
            if k.startswith(("kvgate_tenant_in_flight", "kvgate_worker_in_flight")) and v:
                held[k] = v
        for w in self.fleet.workers if self.fleet else ():
            s = w.engine.stats()
            if s.num_running or s.num_waiting or w.loop.num_in_flight:
                held[f"engine {w.cfg.name}"] = (s.num_running, s.num_waiting, w.loop.num_in_flight)
        tasks = [t for t in self.server.server_state.tasks if not t.done()]
        if tasks:
            held["gateway request tasks"] = len(tasks)
        return held

    async def leaks_after(self, timeout: float) -> dict[str, Any]:
        """What is still held once the stack went quiet, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            held = await self.leaks()
            if not held or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.01)

    async def assert_quiescent(self, timeout: float = 5.0) -> None:
        held = await self.leaks_after(timeout)
        assert not held, f"still held {timeout}s after the last request: {held}"


@contextlib.asynccontextmanager
async def run_stack(
    n_workers: int = 1,
    *,
    profile: Any = "fast",
    sim: Mapping[str, Any] | None = None,
    sndbuf: int | None = None,
    **settings: Any,
) -> AsyncIterator[Stack]:
    async with run_sim_workers(n_workers, profile=profile, **dict(sim or {})) as fleet:
        s = fault_settings(list(fleet), **settings)
        async with run_gateway(s, sndbuf=sndbuf) as running:
            url, gw, server = running.url, running.gw, running.server
            assert server is not None
            deadline = time.monotonic() + 10
            while len(gw.registry.healthy()) < n_workers:
                assert time.monotonic() < deadline, "workers never became healthy"
                await asyncio.sleep(0.02)
            yield Stack(url, int(url.rsplit(":", 1)[1]), gw, server, fleet)


class MemoryWatch:
    """The Python heap this process holds (tracemalloc), compared with a mark taken once warm.

    RSS would not do: the allocator keeps freed pages, and the test process holds pytest too.
    A fault test marks after a warm-up round (pools, lazy imports, metric children exist) and
    asserts the growth after the fault is small; on failure `top()` names the lines that grew.
    """

    def __init__(self) -> None:
        self._mark: tracemalloc.Snapshot | None = None
        self._base = 0

    def mark(self) -> None:
        gc.collect()
        self._base = tracemalloc.get_traced_memory()[0]
        self._mark = tracemalloc.take_snapshot()

    def growth(self) -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - self._base

    def top(self, n: int = 8) -> str:
        assert self._mark is not None
        diff = tracemalloc.take_snapshot().compare_to(self._mark, "lineno")
        return "\n".join(str(d) for d in diff[:n])

    def assert_near_baseline(self, limit_bytes: int) -> None:
        grown = self.growth()
        assert grown < limit_bytes, f"heap grew {grown / 1024:.0f} KiB:\n{self.top()}"


@contextlib.contextmanager
def memory_watch() -> Iterator[MemoryWatch]:
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        yield MemoryWatch()
    finally:
        if started:
            tracemalloc.stop()


# -- response checks --------------------------------------------------------------------------------
def assert_openai_error(status: int, content_type: str, body: bytes) -> dict[str, Any]:
    """`{"error": {"message": str, "type": str, "param": ..., "code": ...}}` as JSON."""
    assert content_type.startswith("application/json"), (status, content_type, body[:200])
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise AssertionError(f"{status} error body is not JSON: {body[:200]!r}") from None
    assert isinstance(doc, dict) and set(doc) == {"error"}, (status, body[:300])
    err = doc["error"]
    assert isinstance(err, dict), (status, body[:300])
    assert {"message", "type", "param", "code"} <= set(err), (status, body[:300])
    assert isinstance(err["message"], str) and err["message"], (status, body[:300])
    assert isinstance(err["type"], str) and err["type"], (status, body[:300])
    assert err["param"] is None or isinstance(err["param"], str), (status, body[:300])
    return err


# -- raw HTTP/1.1 on a socket ----------------------------------------------------------------------
@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_response(data: bytes) -> RawResponse:
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, f"no complete response head in {data[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2 :]
        return RawResponse(status, headers, body)
    return RawResponse(status, headers, rest)


async def raw_exchange(port: int, request: bytes, timeout: float = 15.0) -> RawResponse:
    """Send raw bytes on a new connection and read the response until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        data = b""
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                data += chunk
                if _complete(data):
                    break
        return parse_response(data)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


def _complete(data: bytes) -> bool:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    low = head.lower()
    if b"transfer-encoding: chunked" in low:
        return rest.endswith(b"0\r\n\r\n")
    for line in low.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":", 1)[1])
    return False


def http_request(
    path: str,
    body: bytes,
    *,
    headers: Mapping[str, str] | None = None,
    content_length: bool = True,
) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "connection: close"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if content_length:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
