"""Start simulated vLLM workers inside the current event loop, for tests and benches.

Tests of the gateway and of the simulator itself need real HTTP servers (real sockets, real SSE,
real disconnects) but no subprocesses: subprocess start-up dominates a test suite and hides
tracebacks. `run_sim_workers` binds free ports on 127.0.0.1 first (no port races), serves every
worker from this loop, and gives back their URLs plus the worker objects for direct inspection.

    async with run_sim_workers(2, profile="fast", num_blocks=256) as fleet:
        fleet[0]            # "http://127.0.0.1:41234"
        fleet.workers[0]    # SimWorker: .engine, .faults, .metrics

With `kv_events=True` every worker also publishes vLLM-style KV events on free ports:
`fleet.kv_endpoints[i]` (ZMQ PUB) and `fleet.kv_replay_endpoints[i]` (ROUTER replay), both
"tcp://127.0.0.1:PORT".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import fields, replace
from typing import Any

import uvicorn

from workers.sim.config import SimWorkerConfig
from workers.sim.engine_types import EngineConfig
from workers.sim.faults import Faults
from workers.sim.profiles import TimingProfile
from workers.sim.server import bind_sockets, serve_workers
from workers.sim.worker import SimWorker

__all__ = ["SimFleet", "run_sim_workers"]

_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))


class SimFleet(list[str]):
    """The workers' base URLs (a list, so `for url in fleet` works) plus their live objects."""

    def __init__(self, urls: list[str], workers: list[SimWorker]) -> None:
        super().__init__(urls)
        self.workers = workers

    @property
    def ports(self) -> list[int]:
        return [int(u.rsplit(":", 1)[1]) for u in self]

    @property
    def kv_endpoints(self) -> list[str]:
        """Each worker's KV-event PUB endpoint (empty unless started with kv_events=True)."""
        return [w.kv_endpoint for w in self.workers if w.kv_endpoint is not None]

    @property
    def kv_replay_endpoints(self) -> list[str]:
        return [w.kv_replay_endpoint for w in self.workers if w.kv_replay_endpoint is not None]


@contextlib.asynccontextmanager
async def run_sim_workers(
    n: int = 1,
    *,
    profile: str | TimingProfile = "fast",
    model: str = "sim-llama",
    default_max_tokens: int = 64,
    faults: dict[str, Any] | None = None,
    engine: EngineConfig | None = None,
    host: str = "127.0.0.1",
    kv_events: bool = False,
    kv_events_layout: str = "0.32",
    kv_events_topic: str = "kv",
    **engine_fields: Any,
) -> AsyncIterator[SimFleet]:
    """Serve `n` simulated workers on free ports until the block exits.

    `engine_fields` (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
    ...) override `engine` (default `EngineConfig()`) for every worker; `faults` is applied to each
    worker's own `Faults`. Workers are named sim-1..sim-n like the CLI names them. `kv_events`
    makes each worker publish KV events (and serve replay) on free ports of `host`.
    """
    unknown = set(engine_fields) - _ENGINE_FIELDS
    if unknown:
        raise TypeError(f"unknown engine setting(s): {sorted(unknown)}")
    base = replace(engine or EngineConfig(), **engine_fields)
    socks = bind_sockets(host, [0] * n)
    ports = [s.getsockname()[1] for s in socks]
    cfgs = []
    for i, port in enumerate(ports):
        f = Faults()
        if faults:
            f.update(dict(faults))
        cfgs.append(
            SimWorkerConfig(
                name=f"sim-{i + 1}",
                port=port,
                model=model,
                profile=profile,
                engine=replace(base),
                default_max_tokens=default_max_tokens,
                faults=f,
                kv_events=kv_events,
                kv_events_host=host,
                kv_events_layout=kv_events_layout,
                kv_events_topic=kv_events_topic,
            )
        )
    started: asyncio.Future[list[uvicorn.Server]] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()

    def on_started(servers: list[uvicorn.Server]) -> None:
        if not started.done():
            started.set_result(servers)

    task = asyncio.ensure_future(
        serve_workers(
            cfgs,
            host,
            sockets=socks,
            on_started=on_started,
            stop=stop,
            graceful_timeout_s=1.0,
        )
    )
    try:
        done, _ = await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises the start-up failure
            raise RuntimeError("simulated workers exited during start-up")
        servers = started.result()
        workers = [s.config.app.state.worker for s in servers]
        url_host = f"[{host}]" if ":" in host else host
        yield SimFleet([f"http://{url_host}:{p}" for p in ports], workers)
    finally:
        stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=10)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        except SystemExit:
            pass
        for s in socks:
            s.close()
