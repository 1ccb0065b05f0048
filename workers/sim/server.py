"""Serving simulated workers: one uvicorn server per worker, all of them in one event loop.

One process serving 8-32 workers is what makes a fleet fit on a laptop, and tests want real
sockets without subprocesses. So every port is bound up front (a taken port fails the whole start,
and callers can pass sockets bound to port 0), the servers share the caller's loop, and signals are
handled once for all of them rather than by each uvicorn server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn

from workers.sim.app import create_app
from workers.sim.config import SimWorkerConfig

__all__ = ["bind_sockets", "build_servers", "serve_workers"]


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to `serve_workers` (one handler for all)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def bind_sockets(host: str, ports: Sequence[int]) -> list[socket.socket]:
    """Bind every port up front so a taken port fails the whole start with a clear error."""
    socks: list[socket.socket] = []
    try:
        for port in ports:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                s.close()
                raise OSError(e.errno, f"cannot bind {host}:{port}: {e.strerror}") from e
            s.set_inheritable(True)
            socks.append(s)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _loop_impl() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def build_servers(
    cfgs: Sequence[SimWorkerConfig], host: str, graceful_timeout_s: float = 3.0
) -> list[uvicorn.Server]:
    servers: list[uvicorn.Server] = []
    try:
        for cfg in cfgs:
            servers.append(_build_server(cfg, host, graceful_timeout_s))
    except BaseException:  # e.g. a taken KV-event port: release what the others bound
        for s in servers:
            s.config.app.state.worker.close_sockets()
        raise
    return servers


def _build_server(cfg: SimWorkerConfig, host: str, graceful_timeout_s: float) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(cfg),
        host=host,
        port=cfg.port,
        loop=_loop_impl(),
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=graceful_timeout_s,
        timeout_keep_alive=30,
    )
    return _Server(config)


async def serve_workers(
    cfgs: Sequence[SimWorkerConfig],
    host: str = "127.0.0.1",
    *,
    sockets: Sequence[socket.socket] | None = None,
    on_started: Callable[[list[uvicorn.Server]], None] | None = None,
    stop: asyncio.Event | None = None,
    graceful_timeout_s: float = 3.0,
    handle_signals: bool | None = None,
) -> None:
    """Run one uvicorn server per config in this event loop until `stop` is set or a signal.

    `sockets` (one per config, already bound) lets callers use port 0; otherwise each config's
    port is bound here. With `handle_signals` (default: when binding here, i.e. when this is the
    process's main job) SIGINT/SIGTERM stop every server gracefully; a second one forces it.
    uvicorn's own per-server signal capture is disabled: with several servers in one loop only
    the last one installed would ever see the signal.
    """
    socks = list(sockets) if sockets is not None else bind_sockets(host, [c.port for c in cfgs])
    if len(socks) != len(cfgs):
        raise ValueError("one socket per worker config is required")
    try:
        servers = build_servers(cfgs, host, graceful_timeout_s)
    except BaseException:  # as after serving: the HTTP sockets are closed either way
        for sk in socks:
            sk.close()
        raise
    loop = asyncio.get_running_loop()

    def request_exit() -> None:
        for s in servers:
            if s.should_exit:
                s.force_exit = True
            s.should_exit = True

    installed: list[int] = []
    if handle_signals is None:
        handle_signals = sockets is None
    if handle_signals:
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, request_exit)
                installed.append(sig)

    async def watch_stop() -> None:
        if stop is None:
            return
        await stop.wait()
        request_exit()

    async def announce() -> None:
        while not all(s.started for s in servers):
            if any(s.should_exit for s in servers):
                return
            await asyncio.sleep(0.01)
        if on_started is not None:
            on_started(servers)

    stopper = asyncio.ensure_future(watch_stop())
    announcer = asyncio.ensure_future(announce())
    try:
        await asyncio.gather(*(s.serve(sockets=[sk]) for s, sk in zip(servers, socks, strict=True)))
    finally:
        stopper.cancel()
        announcer.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
        for sk in socks:
            sk.close()
        # A server stopped before its startup finished skips its lifespan shutdown.
        for s in servers:
            s.config.app.state.worker.close_sockets()
