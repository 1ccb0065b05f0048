"""Gateway end-to-end harness: simulated workers in a child process (so they can crash for real),
the gateway in-process (so tests can look at its registry), all on 127.0.0.1 free ports."""

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
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from bench.peers import free_ports
from bench.redis_server import RedisServer, free_port
from gateway.app import Gateway
from gateway.asgi import create_app
from gateway.config import Settings
from gateway.server import build_server

MODEL = "sim-llama"


@dataclass
class SimProcess:
    proc: subprocess.Popen[bytes]
    urls: list[str]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def start_sims(n: int, *args: str, profile: str = "fast") -> SimProcess:
    """``n`` simulated workers in one `kvgate sim` process, healthy. The ports are free when
    chosen but another process may take one before the sim binds it (they come from the
    ephemeral range, which every outgoing connection draws from too): a sim that exits before it
    serves is started again on other ports, up to 5 times."""
    for attempt in range(5):
        port = free_ports(n)
        cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--workers", str(n)]
        cmd += ["--profile", profile, "--model", MODEL, *args]
        proc = subprocess.Popen(cmd, start_new_session=True)
        urls = [f"http://127.0.0.1:{port + i}" for i in range(n)]
        deadline = time.monotonic() + 30
        pending = set(urls)
        while pending:
            if proc.poll() is not None:
                break
            for u in list(pending):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(u + "/health", timeout=0.5).status_code == 200:
                        pending.discard(u)
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"simulated workers not healthy: {pending}")
            time.sleep(0.05)
        if not pending:
            return SimProcess(proc, urls)
        if attempt == 4:
            raise RuntimeError(f"kvgate sim exited with {proc.returncode}, 5 times")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    """A real redis-server on a free port, shared by a test module."""
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def sims() -> Iterator[Any]:
    started: list[SimProcess] = []

    def make(n: int = 2, *args: str, profile: str = "fast") -> SimProcess:
        sp = start_sims(n, *args, profile=profile)
        started.append(sp)
        return sp

    yield make
    for sp in started:
        sp.kill()


def settings_for(urls: list[str], **sections: dict[str, Any]) -> Settings:
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0},
        "probes": {"interval_s": 0.2, "timeout_s": 1.0, "unhealthy_after": 2},
        "timeouts": {"first_byte_s": 10, "idle_s": 5, "total_s": 30},
        "logging": {"level": "warning"},
        "workers": [{"name": f"w{i}", "url": u} for i, u in enumerate(urls)],
    }
    for k, v in sections.items():
        data[k] = v if isinstance(v, list) else {**data.get(k, {}), **v}
    return Settings(**data)


def keyed_settings(
    urls: list[str], key: str, usage_file: Path, tenant: dict[str, Any], **sections: Any
) -> Settings:
    """`settings_for` with one tenant, `t`, keyed by ``key`` (stored hashed) and limited by
    ``tenant``, its usage records written to ``usage_file`` (`last_usage` reads them)."""
    data = settings_for(urls, quota={"usage_file": str(usage_file)}, **sections).model_dump()
    data["tenants"] = {"t": {"keys_sha256": [hashlib.sha256(key.encode()).hexdigest()], **tenant}}
    return Settings(**data)


async def last_usage(usage_file: Path) -> dict[str, Any]:
    """The last usage record written to ``usage_file``, once there is one."""
    await until(lambda: usage_file.exists() and usage_file.stat().st_size > 0, 10, "usage record")
    return json.loads(usage_file.read_text().splitlines()[-1])  # noqa: ASYNC240 (a few lines)


@dataclass
class RunningGateway:
    url: str
    gw: Gateway
    server: uvicorn.Server | None = None

    async def metrics(self) -> dict[str, float]:
        async with httpx.AsyncClient() as c:
            text = (await c.get(self.url + "/metrics")).text
        return flat_metrics(text)

    async def wait_healthy(self, n: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while len(self.gw.registry.healthy()) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.gw.registry.healthy())} of {n} workers healthy")
            await asyncio.sleep(0.02)


async def until(pred: Callable[[], bool], timeout: float, what: str, step: float = 0.005) -> float:
    """Seconds until `pred()` holds (polling, never a fixed sleep); fails after `timeout`."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(step)
    return time.monotonic() - t0


def flat_metrics(text: str) -> dict[str, float]:
    """`name{a="x",b="y"}` -> value, labels sorted, for compact assertions."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@contextlib.asynccontextmanager
async def run_gateway(
    settings: Settings, config_path: Any = None, sndbuf: int | None = None
) -> AsyncIterator[RunningGateway]:
    """An in-process gateway on a free port. `sndbuf` fixes SO_SNDBUF on the listening socket
    (accepted sockets inherit it), so kernel autotuning cannot hide what a slow client makes the
    gateway itself hold."""
    app = create_app(settings, config_path)
    sock = socket.socket()
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # The production server (connection guard, protocol-error envelopes), not plain uvicorn.
    server = build_server(app, settings.server)
    server.config.timeout_graceful_shutdown = 1
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield RunningGateway(f"http://127.0.0.1:{port}", app.state.gateway, server)
    finally:
        server.should_exit = True
        # Bounded, so a shutdown that hangs names itself instead of running into the suite's
        # timeout (uvicorn's grace here is 1 s, then Gateway.stop, each of whose steps is bounded).
        _done, stuck = await asyncio.wait({task}, timeout=30)
        sock.close()
        assert not stuck, "the gateway did not stop within 30 s of should_exit"
        task.result()


# A scripted worker: fixed SSE bytes cut at awkward places, to prove the relay is byte-exact.
SCRIPTED_EVENTS = [
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"sim-llama","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n',
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"sim-llama","choices":[{"index":0,"delta":{"content":" caf\xc3\xa9 \\"usage\\"\\n\\n"},"logprobs":null,"finish_reason":null}]}\n\n',
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"sim-llama","choices":[{"index":0,"delta":{"content":" ok"},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n',
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"sim-llama","choices":[],"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}\n\n',
    b"data: [DONE]\n\n",
]


def scripted_fragments() -> list[bytes]:
    """The events re-cut into fragments of 1, 7, 50, 3, ... bytes (crossing every boundary)."""
    data = b"".join(SCRIPTED_EVENTS)
    sizes = [1, 7, 50, 3, 200, 2, 90, 1, 400]
    out, i, k = [], 0, 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        out.append(data[i : i + n])
        i += n
        k += 1
    return out


def chat_completion(content: str = "ok") -> dict[str, Any]:
    """A whole vLLM chat answer with its usage, as a stand-in worker returns it."""
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


def stub_app(chat: Any) -> Any:
    """A vLLM stand-in: /health, /v1/models (serving MODEL), and ``chat`` (a Starlette endpoint)
    at /v1/chat/completions."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def health(request: Request) -> Response:
        return Response(b"")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


@contextlib.asynccontextmanager
async def serve_app(app: Any, force_exit: bool = False) -> AsyncIterator[str]:
    """``app`` on a free 127.0.0.1 port until the block ends; yields its URL. ``force_exit``:
    stop without waiting for requests still open (a worker that never answers)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn exposes a flag)
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        server.force_exit = force_exit
        # Bounded, so a shutdown that hangs names itself instead of running into the suite's
        # timeout (uvicorn's grace here is 1 s, then Gateway.stop, each of whose steps is bounded).
        _done, stuck = await asyncio.wait({task}, timeout=30)
        sock.close()
        assert not stuck, "the server did not stop within 30 s of should_exit"
        task.result()


def scripted_app(received: list[bytes], burst: bool = False) -> Any:
    """The scripted worker's app: ``scripted_fragments`` 1 ms apart, or with ``burst`` the first
    event alone and then the others in one go (one HTTP chunk each, in the same socket read).
    A non-streaming request gets a whole answer, as vLLM gives one."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse

    async def chat(request: Request) -> Response:
        body = await request.body()
        received.append(body)
        if not json.loads(body).get("stream"):
            return JSONResponse(chat_completion())

        async def gen() -> AsyncIterator[bytes]:
            if burst:
                yield SCRIPTED_EVENTS[0]
                await asyncio.sleep(0.02)
                for event in SCRIPTED_EVENTS[1:]:
                    yield event
                return
            for frag in scripted_fragments():
                yield frag
                await asyncio.sleep(0.001)

        return StreamingResponse(gen(), media_type="text/event-stream; charset=utf-8")

    return stub_app(chat)


@contextlib.asynccontextmanager
async def run_scripted_worker(burst: bool = False) -> AsyncIterator[tuple[str, list[bytes]]]:
    received: list[bytes] = []
    async with serve_app(scripted_app(received, burst)) as url:
        yield url, received
