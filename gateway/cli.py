"""The `kvgate` command: `serve` the gateway, run simulated workers (`sim`), `dev` (both, for
`make run`), and `key` (make an API/admin key and the hash that goes into the config)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from gateway.config import ConfigError, Settings, load_settings
from gateway.logs import setup_logging

if TYPE_CHECKING:
    from gateway.process_child import ChildSpec

DEFAULT_CONFIG = "config.example.toml"
# `kvgate dev`'s drain on Ctrl-C: long enough for a short request to finish, short enough that
# nobody waits on a stream they started by hand (`kvgate serve` uses server.drain_grace_s).
DEV_DRAIN_GRACE_S = 2.0


def _load(path: str) -> Settings:
    try:
        return load_settings(path)
    except ConfigError as e:
        sys.exit(f"kvgate: {e}")


async def _serve(
    settings: Settings,
    config_path: Path | None,
    on_ready: Callable[[Any], Awaitable[None]] | None = None,
    drain_grace_s: float | None = None,
    child: ChildSpec | None = None,
) -> None:
    """Serve until a signal stops it (gateway/server.py: connection guard, draining shutdown).

    `drain_grace_s` None: the configured `server.drain_grace_s` (`kvgate serve`); the dev runner
    passes a short one. `on_ready(app)` runs once the socket listens. `child`: one of
    `--processes N`'s children, on a SO_REUSEPORT socket of its own (gateway/process_child.py).
    """
    from gateway.asgi import create_app
    from gateway.server import build_server

    app = create_app(settings, config_path)
    server = build_server(app, settings.server, drain_grace_s=drain_grace_s)
    if child is not None:
        from gateway.process_child import run_child

        await run_child(app, server, child)
        return
    if on_ready is None:
        await server.serve()
        return
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn exposes a flag)
        await asyncio.sleep(0.05)
    if server.started:
        await on_ready(app)
    await task


def tune_gc() -> None:
    """Collect garbage as a serving process does (``bench.routing_speed`` measures under it too).

    A request allocates thousands of containers, so at the default threshold (700) the young
    generation was collected several times per request, each time scanning the objects of every
    request in flight. Every 50,000 allocations, with the startup objects frozen out of every
    collection: 3-4% less router CPU per request (bench overhead, c=16, 4 interleaved rounds:
    median 0.84 -> 0.81 ms); garbage cycles still go within a fraction of a second.
    """
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)


def run_async(coro) -> None:  # type: ignore[no-untyped-def]
    """Run on uvloop when installed: it roughly halves the event loop's share of each request."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        factory = None
    tune_gc()
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.process_child import ChildSpec
    from gateway.supervisor import process_count, shared_state_problem, supervise

    child = ChildSpec.from_arg(args.child) if args.child else None
    # Until the config watcher (or the supervisor) takes SIGHUP over, a reload sent while the
    # gateway starts (one the supervisor forwards, an early `systemctl reload`) must not end it
    # (SIGHUP's default): the file is read as it starts anyway. A lone gateway died of one.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # As the environment overrides any key (`KVGATE_SERVER__PORT`): so every load of the file
    # has them, the config watcher's reloads too. Applied to the first load only, each reload
    # read a [server] without them and warned that it had changed (review).
    for key, value in (("HOST", args.host), ("PORT", args.port)):
        if value is not None:
            os.environ[f"KVGATE_SERVER__{key}"] = str(value)
    settings = _load(args.config)
    setup_logging(settings.logging.level, settings.logging.format)
    if child is not None:
        from gateway.process_child import EXIT_CONFIG_REFUSED, start_settings

        try:
            settings = start_settings(settings, child)
        except ConfigError as e:
            logging.getLogger("kvgate.supervisor").error(
                "process %d refuses to start: %s", child.index, e
            )
            return EXIT_CONFIG_REFUSED
    try:
        processes = process_count(
            args.processes if args.processes is not None else settings.server.processes
        )
    except ValueError as e:
        sys.exit(f"kvgate: --processes: {e}")
    if child is None and processes == 1:
        problem = shared_state_problem(settings, processes)
        if problem:
            print(f"kvgate: {problem}", file=sys.stderr, flush=True)
            return 2
    if child is None and processes > 1:
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", args.config]
        for flag, value in (("--host", args.host), ("--port", args.port)):
            if value is not None:
                argv += [flag, str(value)]
        return supervise(settings, argv, processes)
    run_async(_serve(settings, Path(args.config), child=child))
    return 0


def _sim_groups(settings: Settings) -> list[tuple[int, int]]:
    """Consecutive localhost ports of the configured workers -> (first port, count) groups."""
    ports = []
    for w in settings.workers:
        u = urlsplit(w.url)
        if u.hostname not in ("127.0.0.1", "localhost") or u.port is None:
            sys.exit(f"kvgate dev: worker {w.name} ({w.url}) is not a local port to simulate")
        ports.append(u.port)
    groups: list[tuple[int, int]] = []
    for p in sorted(ports):
        if groups and groups[-1][0] + groups[-1][1] == p:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((p, 1))
    return groups


def _wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for p in procs:
            if p.poll() is not None:
                sys.exit(f"kvgate dev: a simulated worker exited with code {p.returncode}")
        for u in list(pending):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{u}/health", timeout=0.5).status_code == 200:
                    pending.discard(u)
        if time.monotonic() > deadline:
            sys.exit(f"kvgate dev: workers not healthy after {timeout:.0f}s: {sorted(pending)}")
        time.sleep(0.1)


def cmd_dev(args: argparse.Namespace) -> int:
    settings = _load(args.config)
    setup_logging(settings.logging.level, "text")
    procs: list[subprocess.Popen[bytes]] = []
    kv_ports = {urlsplit(w.url).port: w.kv_events for w in settings.workers}
    for port, n in _sim_groups(settings):
        cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--workers", str(n)]
        cmd += ["--profile", args.profile, "--model", args.model]
        kv = urlsplit(kv_ports.get(port) or "")
        if kv.port:  # the group's first worker publishes there, the next ones 2 ports apart
            cmd += ["--kv-events-port", str(kv.port)]
        procs.append(subprocess.Popen(cmd, start_new_session=True))
    try:
        _wait_healthy([w.url for w in settings.workers], procs, 60)
        base = f"http://{settings.server.host}:{settings.server.port}"

        async def ready(app) -> None:  # type: ignore[no-untyped-def]
            gw = app.state.gateway
            for _ in range(100):
                if gw.registry.healthy():
                    break
                await asyncio.sleep(0.05)
            key = args.demo_key
            digest = hashlib.sha256(key.encode()).hexdigest()
            if settings.tenants and not any(
                digest in t.keys_sha256 for t in settings.tenants.values()
            ):
                key = "<your key>"
            print(_banner(base, args.model, len(settings.workers), key), flush=True)

        run_async(
            _serve(settings, Path(args.config), on_ready=ready, drain_grace_s=DEV_DRAIN_GRACE_S)
        )
    except KeyboardInterrupt:  # Ctrl-C before the server took the signals over
        pass
    finally:
        _stop_workers(procs)
        print("kvgate dev: stopped gateway and simulated workers", flush=True)
    return 0


def _stop_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, up to 5 s to exit, then SIGKILL; one more Ctrl-C meanwhile goes to SIGKILL at
    once (they run in sessions of their own: the terminal's Ctrl-C never reaches them)."""

    def kill(sig: int) -> None:
        for p in procs:
            if p.poll() is None:  # never a reaped one: its group id may belong to another by now
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)

    kill(signal.SIGTERM)
    try:
        deadline = time.monotonic() + 5
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass
    kill(signal.SIGKILL)
    for p in procs:
        p.wait()


def _python() -> str:
    """The interpreter that has `openai` (this one), as a command to paste from the repo's
    root: a bare `python` is the shell's, which lacks it."""
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        return str(exe.relative_to(Path.cwd()))
    return str(exe)


def _banner(base: str, model: str, n: int, key: str) -> str:
    return f"""
kvgate is serving on {base} in front of {n} simulated vLLM workers. Ctrl-C stops everything.

  curl -N {base}/v1/chat/completions -H 'content-type: application/json' \\
    -H 'authorization: Bearer {key}' \\
    -d '{{"model": "{model}", "stream": true, "max_tokens": 32,
         "messages": [{{"role": "user", "content": "Hello, kvgate!"}}]}}'

  {_python()} -c '
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=32,
        messages=[{{"role": "user", "content": "Hello, kvgate!"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
print()'

  fleet: curl {base}/ready    metrics: curl {base}/metrics
"""


def cmd_bench(args: argparse.Namespace) -> int:
    """Hand everything after `bench` to `bench.__main__`, which lists the tools and dispatches.

    `-h/--help` right after `bench` is an option of this subparser (argparse would otherwise call
    it an unrecognized argument of `kvgate`, exit 2); after a tool name it is part of `args.args`
    and reaches the tool's own parser."""
    from bench.__main__ import main as bench_main

    argv = [*args.args, "--help"] if args.bench_help else list(args.args)
    return int(bench_main(argv) or 0)


def cmd_key(args: argparse.Namespace) -> int:
    key = args.key or "kvg-" + secrets.token_urlsafe(24)
    print(f"key:    {key}")
    print(f"sha256: {hashlib.sha256(key.encode()).hexdigest()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from workers.sim.cli import add_sim_parser

    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="TOML config file (reloaded live)")
    p.add_argument("--host", default=None, help="override server.host")
    p.add_argument("--port", type=int, default=None, help="override server.port")
    p.add_argument(
        "--processes",
        default=None,
        metavar="N|auto",
        help="override server.processes: N gateway processes on one address (needs Redis)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # set by the supervisor
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("dev", help="simulated workers for every configured worker + the gateway")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="TOML config file")
    p.add_argument("--profile", default="default", help="simulator timing profile")
    p.add_argument("--model", default="sim-llama", help="model name the simulators serve")
    p.add_argument(
        "--demo-key",
        default="kvg-demo-team-a",
        help="API key shown in the printed examples (the example config's demo tenant)",
    )
    p.set_defaults(func=cmd_dev)

    p = sub.add_parser("key", help="make a key and print the sha256 the config stores")
    p.add_argument("--key", default=None, help="hash this key instead of making a new one")
    p.set_defaults(func=cmd_key)

    p = sub.add_parser(
        "bench",
        help="benchmarks and trace tools: simulate, capacity, replay, compare, ... "
        "(kvgate bench --help lists them)",
        add_help=False,
    )
    p.add_argument("-h", "--help", action="store_true", dest="bench_help", help=argparse.SUPPRESS)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    add_sim_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
