"""One of `kvgate serve --processes N`'s children: its spec, its socket, its view of its siblings.

The supervisor (gateway/supervisor.py: why N processes, why SO_REUSEPORT, restarts, signals) starts
each child as `kvgate serve --child <ChildSpec as JSON>`. What a child does beyond a lone gateway is
here, so a child never imports the supervisor's process management: it binds its own socket in the
address's SO_REUSEPORT group (`listen_socket`), tells the supervisor through its ready pipe once it
listens, drains when its lifeline pipe closes (the supervisor died) and, the last one out, removes
the orphaned run directory (`run_child`).

Metrics: each child also answers on a unix socket in the supervisor's private run directory
(mode 0700: the admin-key rule of /metrics cannot be sidestepped through it, as it could through a
127.0.0.1 port any local user can reach). The child that answers a scrape of /metrics fetches its
siblings' expositions there, concurrently, and merges them (`gateway.metrics.merge_expositions`):
one HELP/TYPE per family and a `process="k"` label (k = the slot, stable across restarts) on every
sample, so `sum without(process) (...)` is the gateway's total. A sibling that does not answer
within `SIBLING_TIMEOUT_S` is left out and counted (`kvgate_processes_scrape_errors_total`); the
scrape never fails for it (one still starting is left out without counting). The supervisor's own
state (target, live and serving children, restarts) is a small JSON file in the run directory that
children read for /metrics (`kvgate_processes{state=...}`, `kvgate_process_restarts_total`, with
no `process` label: one per gateway) and for the bodies of /health and /ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from pydantic import ValidationError

from gateway.config import ConfigError, Settings
from gateway.config_watcher import RESTART_ONLY_CLUSTER, RESTART_ONLY_SECTIONS
from gateway.metrics import merge_expositions, supervisor_exposition
from gateway.tenancy import Access

log = logging.getLogger("kvgate.supervisor")

SIBLING_TIMEOUT_S = 1.0
STATE_FILE = "state.json"
# What the gateway started with, as far as a child (re)started later must run it too
# (`write_start`, `start_settings`); in the private run directory: it holds Redis URLs.
START_FILE = "start.json"
# A child's exit status when it refuses the config it found (`start_settings`): the supervisor
# names the reason in its log (sysexits' EX_CONFIG).
EXIT_CONFIG_REFUSED = 78


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """What the supervisor hands one child (as JSON in a hidden `kvgate serve --child` argument)."""

    index: int
    processes: int
    run_dir: str
    ready_fd: int
    lifeline_fd: int
    host: str = "127.0.0.1"
    port: int = 0
    starts: int = 1
    supervisor_pid: int = 0

    def to_arg(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_arg(cls, text: str) -> ChildSpec:
        return cls(**json.loads(text))

    def metrics_path(self, index: int) -> Path:
        return Path(self.run_dir) / f"metrics-{index}.sock"


def write_start(run_dir: str | Path, settings: Settings) -> None:
    """Record, before the first child starts, what every child must run whenever it starts:
    the settings a reload cannot change (`RESTART_ONLY_SECTIONS`, `RESTART_ONLY_CLUSTER`) and
    who the gateway let in without a key (`Access`)."""
    pinned: dict[str, Any] = {
        section: getattr(settings, section).model_dump(mode="json")
        for section in RESTART_ONLY_SECTIONS
    }
    cluster = settings.cluster.model_dump(mode="json")
    pinned["cluster"] = {k: cluster[k] for k in RESTART_ONLY_CLUSTER}
    access = Access.of(settings)
    data = {
        "restart_only": pinned,
        "access": {"keyed": access.keyed, "anonymous": access.anonymous},
    }
    path = Path(run_dir) / START_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)


def start_settings(settings: Settings, spec: ChildSpec) -> Settings:
    """`settings` (the file as this child read it) as this child must run them: the restart-only
    settings the gateway started with, and never open where it started closed.

    A child reads the file as it starts, and one restarted after an edit (a crash, an OOM kill,
    the hung-child watchdog) read what its siblings only warned about ("takes effect after a
    restart"): `[quota] backend = "memory"` had it enforce every limit on its own beside the
    shared ones, which `supervise` refuses at start for this reason; a new `[server]`, Redis URL
    or cluster key prefix split the gateway the same way. Those are the start's here, as they
    are in the siblings, until the whole gateway restarts. A file that would let in callers
    without a key that the gateway turned away is refused (`ConfigError`): its siblings refused
    it as a reload (`Access.opened_by`), and this child is not to serve it either.

    Those sections are validated again, so the environment still beats both (the supervisor's
    `child_environment` overrides, which its own copy of the settings lacks).
    """
    path = Path(spec.run_dir) / START_FILE
    try:
        start = json.loads(path.read_bytes())
        pinned, access = start["restart_only"], Access(**start["access"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: cannot read what the gateway started with: {e}") from e
    opened = access.opened_by(settings)
    if opened:
        raise ConfigError(
            f"the config file has changed since the gateway started and {opened}: its running "
            "processes refused it, and so does this one; restart the whole gateway to run it"
        )
    sections = (*RESTART_ONLY_SECTIONS, "cluster")
    data = {s: getattr(settings, s).model_dump(mode="json") for s in sections}
    for section, values in pinned.items():
        data[section] = {**data[section], **values}  # [cluster]: the file's live keys stay
    try:
        validated = Settings(**data)
    except ValidationError as e:
        raise ConfigError(f"the start's restart-only settings do not fit the file: {e}") from e
    # Only those sections come from the round trip: the rest stays the file's, as read.
    merged = settings.model_copy(update={s: getattr(validated, s) for s in sections})
    changed = [s for s in sections if getattr(settings, s) != getattr(merged, s)]
    if changed:
        log.warning(
            "process %d: the config file's %s changed since the gateway started; this process "
            "runs the start's values, as its siblings do, until the whole gateway restarts",
            spec.index,
            ", ".join(f"[{s}]" for s in changed),
        )
    return merged


def read_state(run_dir: str | Path) -> dict[str, Any] | None:
    """The supervisor's last state (None when it is gone or the file is being replaced)."""
    try:
        data = json.loads((Path(run_dir) / STATE_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Siblings:
    """One child's view of the process group: who it is, and its siblings' metrics."""

    def __init__(self, spec: ChildSpec, registry: CollectorRegistry) -> None:
        self.spec = spec
        self.registry = registry
        self.scrape_errors = Counter(
            "kvgate_processes_scrape_errors",
            "Sibling processes that did not answer this process's /metrics scrape in time "
            "(left out of that scrape)",
            registry=registry,
        )
        self._server: asyncio.AbstractServer | None = None

    def own(self) -> bytes:
        return generate_latest(self.registry)

    async def start(self) -> None:
        """Answer siblings' scrapes on this slot's unix socket: the exposition, then close."""

        async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                w.write(self.own())
                await w.drain()
            except ConnectionError:  # the reader left early (a timed-out scrape)
                pass
            finally:
                w.close()

        path = self.spec.metrics_path(self.spec.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a killed predecessor's
        self._server = await asyncio.start_unix_server(answer, str(path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                self.spec.metrics_path(self.spec.index).unlink()

    async def _fetch(self, index: int) -> bytes | None:
        try:
            async with asyncio.timeout(SIBLING_TIMEOUT_S):
                r, w = await asyncio.open_unix_connection(str(self.spec.metrics_path(index)))
                try:
                    return await r.read()
                finally:
                    w.close()
        except (OSError, TimeoutError):
            return None

    async def scrape(self) -> bytes:
        """The whole gateway: every process's series labelled `process`, plus the supervisor's."""
        state = read_state(self.spec.run_dir)
        # The siblings the supervisor saw listening (all of them if its state is unreadable): one
        # starting or restarting is missing for a known reason, not a failed scrape.
        serving = state.get("serving_slots") if state else None
        if not isinstance(serving, list):
            serving = list(range(self.spec.processes))
        others = [k for k in serving if isinstance(k, int) and k != self.spec.index]
        got = await asyncio.gather(*(self._fetch(k) for k in others))
        missing = sum(1 for g in got if g is None)
        if missing:
            self.scrape_errors.inc(missing)
        parts = [(str(self.spec.index), self.own())]
        parts += [(str(k), g) for k, g in zip(others, got, strict=True) if g is not None]
        parts.sort(key=lambda p: int(p[0]))
        return merge_expositions(parts) + supervisor_exposition(state, len(parts))

    def reload_all(self) -> None:
        """`POST /admin/reload` answered here: the siblings reload too (the supervisor forwards
        SIGHUP to every child; this one finds its config unchanged). Only to our own supervisor:
        an orphan's parent is init or a subreaper."""
        if self.spec.supervisor_pid and os.getppid() == self.spec.supervisor_pid:
            os.kill(self.spec.supervisor_pid, signal.SIGHUP)

    def health(self) -> dict[str, Any]:
        """For /health and /ready: which process answered, and the supervisor's counts."""
        state = read_state(self.spec.run_dir) or {}
        return {
            "process": self.spec.index,
            "pid": os.getpid(),
            "processes": {
                "target": self.spec.processes,
                "live": state.get("live"),
                "restarts": state.get("restarts"),
            },
        }


def tcp_socket(host: str) -> socket.socket:
    """An unbound TCP socket for `host` (IPv4 or IPv6), set up as uvicorn binds: each child's
    listener and the supervisor's check that the address is free."""
    v6 = ":" in host
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    if v6:
        # IPv6 only, as asyncio's create_server makes one process's listener: without it "::"
        # is dual-stack here and N processes also listened on every IPv4 address.
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    return sock


def listen_socket(host: str, port: int) -> socket.socket:
    """This child's own socket in the address's SO_REUSEPORT group, bound, not listening: it
    joins the group (and gets its share of new connections) when uvicorn starts listening, after
    the gateway's start-up, so no connection waits on a process still starting."""
    sock = tcp_socket(host)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def run_child(app: Any, server: Any, spec: ChildSpec) -> None:
    """Serve as one of the supervisor's children: on a socket of its own in the address's
    SO_REUSEPORT group, answering siblings' scrapes, telling the supervisor once it listens,
    draining if the supervisor goes away."""
    gw = app.state.gateway
    siblings = Siblings(spec, gw.metrics.registry)
    gw.processes = siblings
    sock = listen_socket(spec.host, spec.port)
    await siblings.start()
    loop = asyncio.get_running_loop()
    orphaned = False

    def lifeline() -> None:
        # EOF: the supervisor is gone (it never writes). Drain as on a first SIGTERM.
        nonlocal orphaned
        with contextlib.suppress(OSError):
            if os.read(spec.lifeline_fd, 64):
                return
        loop.remove_reader(spec.lifeline_fd)
        orphaned = True
        if server.signals == 0:
            log.warning("process %d: the supervisor is gone; draining", spec.index)
            server.handle_exit(signal.SIGTERM, None)

    loop.add_reader(spec.lifeline_fd, lifeline)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn exposes a flag)
            await asyncio.sleep(0.02)
        if server.started:
            with contextlib.suppress(OSError):
                os.write(spec.ready_fd, b"ready\n")
        with contextlib.suppress(OSError):
            os.close(spec.ready_fd)
        await task
    finally:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(spec.lifeline_fd)
        await siblings.stop()
        if orphaned:  # the supervisor could not clean up: the last child out removes the dir
            _remove_run_dir(Path(spec.run_dir))


def _remove_run_dir(run_dir: Path) -> None:
    for name in (STATE_FILE, STATE_FILE + ".tmp", START_FILE):
        with contextlib.suppress(OSError):
            (run_dir / name).unlink()
    with contextlib.suppress(OSError):
        run_dir.rmdir()  # fails while a sibling's socket is still there
