"""The peer routers (SGLang router, vLLM router, SMG): installed from PyPI into their own
virtualenvs under `.build/peers/<name>`, started on 127.0.0.1 against a fleet of workers.

Why a module of its own: `bench.compare` (a trace through every router) and `bench.overhead
--peers` (a closed-loop concurrency ladder through every router) must install and launch each peer
the same way, with the same flags, or their numbers are not about the same routers. Each peer
lives in its own virtualenv so that its dependencies never touch kvgate's `.venv`; it is installed
on first use (one `pip install`, a few seconds to a minute) and reused after that. A peer that
cannot be installed or started is reported by its caller as skipped with the reason, never fatal:
the command must still run offline.

Versions are pinned to the ones the published figures were measured with (`Peer.version`), so a
later release cannot silently change a comparison; `installed_version` reports what a virtualenv
actually holds (an older `.build/peers/` is reused as is, and its version is what reports state).

Processes run in their own session (stopping one stops everything it started) and can be pinned
to CPU cores (`cores`): the Rust routers size their tokio runtimes from the cores they may use, so
pinning to one core gives every router, kvgate included, the same single core.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.cpu_cap import CpuCap
from bench.paths import REPO

PEERS_DIR = REPO / ".build" / "peers"
MODEL = "sim-llama"
HOST = "127.0.0.1"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ==================================================================================================
# Processes and ports
# ==================================================================================================


def free_ports(n: int) -> int:
    """First of n consecutive free ports on 127.0.0.1 (`kvgate sim` takes consecutive ports)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind((HOST, p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free consecutive ports")


@dataclass
class Proc:
    """A child process in its own session, so stopping it stops everything it started."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(8)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def tail(self, n: int = 6) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return _ANSI.sub("", " | ".join(lines[-n:]))[-600:]


def _pin(cores: Collection[int] | None, cap: CpuCap | None = None) -> Callable[[], None]:
    """Runs in the child before exec: the affinity and the CPU quota (`bench.cpu_cap`) are
    inherited by every thread and process it starts."""
    mask = set(cores or ())

    def f() -> None:
        if mask:
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setaffinity(0, mask)
        if cap is not None:
            cap.join()  # a failure fails the start: an uncapped router would mislead

    return f


def start(
    name: str,
    argv: list[str],
    logs: Path,
    env: dict[str, str] | None = None,
    cores: Collection[int] | None = None,
    cap: CpuCap | None = None,
) -> Proc:
    """Start `argv` with its output in `logs/<name>.log`, pinned to `cores` and held to the CPU
    quota `cap` when given."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    f = open(log, "wb")  # noqa: SIM115 - handed to the child, closed with the process
    popen = subprocess.Popen(
        argv,
        stdout=f,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        preexec_fn=_pin(cores, cap) if cores or cap else None,
    )
    f.close()
    return Proc(name, popen, log)


def wait_for(check: Callable[[], bool], proc: Proc, timeout: float, what: str) -> None:
    """Poll `check` until it is true; fail early, with the log's tail, when `proc` exits."""
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise RuntimeError(f"{what}: process exited ({proc.popen.returncode}): {proc.tail()}")
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            if check():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout:.0f} s: {proc.tail()}")
        time.sleep(0.2)


def warm(url: str) -> bool:
    """One tiny real completion through the router: ready means it routes, not just listens."""
    body = {"model": MODEL, "prompt": " the of and to", "max_tokens": 1, "stream": False}
    r = httpx.post(url + "/v1/completions", json=body, timeout=10.0)
    return r.status_code == 200


# ==================================================================================================
# The peers
# ==================================================================================================


@dataclass(slots=True, frozen=True)
class Peer:
    """An installable peer router (its PyPI package, in its own virtualenv), on 127.0.0.1."""

    name: str
    package: str
    version: str  # pinned: the version the published comparisons were measured with
    check: str  # a python -c snippet that fails when the install is broken
    argv: Callable[[Path, int, int, list[str]], list[str]]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}" if self.version else self.package


PEERS: dict[str, Peer] = {
    "sglang-router": Peer(
        "sglang-router",
        "sglang-router",
        "0.3.2",
        "import sglang_router",
        lambda venv, port, prom, urls: [
            *(str(venv / "bin" / "python"), "-m", "sglang_router.launch_router"),
            *("--host", HOST, "--port", str(port), "--worker-urls", *urls),
            *("--policy", "cache_aware", "--prometheus-host", HOST),
            *("--prometheus-port", str(prom), "--log-level", "warn"),
        ],
    ),
    "vllm-router": Peer(
        "vllm-router",
        "vllm-router",
        "0.1.17",
        "import shutil, sys; sys.exit(shutil.which('vllm-router') is None)",
        lambda venv, port, prom, urls: [
            str(venv / "bin" / "vllm-router"),
            *("--host", HOST, "--port", str(port), "--worker-urls", *urls),
            *("--policy", "cache_aware", "--prometheus-host", HOST),
            *("--prometheus-port", str(prom)),
        ],
    ),
    "smg": Peer(
        "smg",
        "smg",
        "1.13.0",
        "import shutil, sys; sys.exit(shutil.which('smg') is None)",
        lambda venv, port, prom, urls: [
            *(str(venv / "bin" / "smg"), "launch"),
            *("--host", HOST, "--port", str(port), "--worker-urls", *urls),
            *("--policy", "cache_aware", "--prometheus-host", HOST),
            *("--prometheus-port", str(prom)),
        ],
    ),
}


def _venv_env(venv: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}"}


def ensure_peer(peer: Peer, timeout: float = 600.0) -> tuple[Path | None, str]:
    """The peer's virtualenv, installing it on first use; (None, reason) when that fails."""
    venv = PEERS_DIR / peer.name
    py = venv / "bin" / "python"
    env = _venv_env(venv)

    def works() -> bool:
        if not py.exists():
            return False
        r = subprocess.run([str(py), "-c", peer.check], env=env, capture_output=True, timeout=60)
        return r.returncode == 0

    if works():
        return venv, "installed"
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    log = PEERS_DIR / f"{peer.name}.install.log"
    try:
        with open(log, "wb") as f:
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(venv)],
                stdout=f,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=120,
            )
            subprocess.run(
                [str(py), "-m", "pip", "install", "--quiet", peer.requirement],
                stdout=f,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=timeout,
            )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        return None, f"pip install {peer.requirement} failed: {e}; {' | '.join(tail)}"[:500]
    if not works():
        return None, f"{peer.requirement} installed but `{peer.check}` fails"
    return venv, "installed now"


def installed_version(peer: Peer, venv: Path) -> str | None:
    """The version of the peer's package in its virtualenv (what a report must state)."""
    code = f"import importlib.metadata as m; print(m.version({peer.package!r}))"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r = subprocess.run(
            [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60
        )
        if r.returncode == 0:
            return r.stdout.strip() or None
    return None


def peer_command(peer: Peer, venv: Path, urls: list[str]) -> tuple[list[str], str, dict[str, str]]:
    """The peer's command line against `urls` on free ports, the URL it will serve, and the
    environment it runs in (its virtualenv first on PATH)."""
    port, prom = free_ports(1), free_ports(1)
    while prom == port:
        prom = free_ports(1)
    env = {"PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}", "NO_COLOR": "1"}
    return peer.argv(venv, port, prom, urls), f"http://{HOST}:{port}", env


def start_peer(
    peer: Peer,
    venv: Path,
    urls: list[str],
    logs: Path,
    cores: Collection[int] | None = None,
    ready_timeout: float = 90.0,
    cap: CpuCap | None = None,
) -> tuple[Proc, str]:
    """Launch the peer against `urls` and wait until it routes one real completion."""
    argv, url, env = peer_command(peer, venv, urls)
    proc = start(peer.name, argv, logs, env, cores, cap)
    try:
        wait_for(lambda: warm(url), proc, ready_timeout, peer.name)
    except BaseException:
        proc.stop()
        raise
    return proc, url
