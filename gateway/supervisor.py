"""`kvgate serve --processes N`: N full gateway processes behind one listening address.

One gateway process tops out at one core (the event loop). The supervisor (`Supervisor`, the
process `kvgate serve` becomes when N > 1) checks that the address is free, then starts N
children, each `kvgate serve` with a `ChildSpec`, each a whole gateway on its own SO_REUSEPORT
listener: its own probes, routing state, admission queue, upstream pool. They share what replicas
share, through Redis: quotas (the redis backend is required, or every process would enforce every
limit in full) and per-worker load (`[cluster]`, turned on for them, each child a replica with an
id of its own; each also counts as a replica in the quota store's fail-open share). Limits in
[server] (`max_connections`, `max_concurrent_requests`) are per process, and so are the
[admission] queue bounds (`max_queued`, `max_queued_per_tenant`: each process queues on its own,
N times the configured value in all).

Why SO_REUSEPORT per child and not one pre-forked socket that every child accepts from, measured
(2 shared cores, one simulated worker, the real children, aiohttp clients; connections per process
read from `kvgate_client_connections`; largest share of one process over 10 bursts, median /
worst, where an even split is 1/N):

    64 kept-alive connections opened at once     shared socket        SO_REUSEPORT
      2 processes (even 0.50)                    0.59-0.62 / 0.66-1.00 0.53 / 0.63
      4 processes (even 0.25)                    0.45 / 0.57           0.32 / 0.38
      4 processes, connections spread over 1 s   0.32 / 0.40           0.32 / 0.34
    process killed (SIGKILL) under 64 users opening a connection per request, 4 s:
      failed requests, 4 runs                    14-35                 9-50
    process stopped (SIGSTOP), 64 new connections, killed 2 s later:
      served / reset                             64 / 0 (the other)    34-39 / 25-30

With one shared socket whichever process wakes first takes a whole burst (libuv accepts until the
queue is empty): one run put all 64 connections on one of two processes, and with four, one got
1-3 of 64 in 6 bursts of 10. Kept-alive clients (load balancers, SDK pools) then stay where they
landed, so N processes did not carry N times the load. The kernel's hash spreads them evenly. What
SO_REUSEPORT costs: a dying process's accept queue is reset, which under load measured no worse
(the requests in flight on the killed process are most of the failures either way), and a process
that hangs without dying keeps getting 1/N of new connections, reset when it is killed; with one
socket the others would take them; the supervisor kills and restarts a process whose metrics
socket has not answered for `HUNG_AFTER_S` (30 s), which bounds that. A bind without
SO_REUSEPORT first (`check_address`) fails on any listener, so the children never quietly join
another gateway's group on the same port; no child alive means connections are refused, not
queued.

Supervision: a child that exits before it ever listened makes the whole start fail (exit 1: the
config or the environment is wrong, and restarting would only loop); a child that dies later is
restarted after a backoff (0.5 s doubling to 30 s, back to 0.5 s once a child has lived 60 s),
each restart logged, while the others serve. A restarted child listens once its first probes
found a healthy worker (`Gateway._first_probes`), not answering 503 beside siblings that serve.
A child that has not listened `STARTUP_TIMEOUT_S` (60 s) plus that first-probe wait after its
start is stuck (a hung connect) and is killed: restarted like a crashed one, or at the first start
the start fails; otherwise its slot would stay empty without a word.
A child reads the config file as it starts, so one restarted after an edit would run settings its
siblings only warned about ("takes effect after a restart"): memory quotas beside shared ones (what
`shared_state_problem` refuses at start), another Redis, cluster key prefix or [server]. The
supervisor records its start's restart-only settings in the run directory (`write_start`) before
any child starts, and every child runs those (`gateway.process_child.start_settings`). A child
whose file would let in callers without a key that the gateway turned away exits 78 instead of
serving it (its siblings refused the same file as a reload); it is restarted with the backoff,
and starts once the file is fixed.
SIGTERM/SIGINT are forwarded (as SIGTERM) to every child, one per signal received: the first
drains each of them (gateway/server.py `DrainingServer`), a second stops them now, a fourth kills
them; the supervisor exits once all have exited (0 when every child it stopped exited cleanly).
Signals are counted from the wakeup pipe, one byte per delivery (the Python-level handler runs
once for deliveries that land before the interpreter looks), and each is forwarded only once
every child took the previous one: a standard signal sent while the same one is still pending
merges into it, so two sent back to back could reach a child as one drain.
SIGHUP is forwarded to every child that is listening (each reloads its config, as the single
process does on SIGHUP), and to a child still starting once it listens. Children run in process
groups of their own, so a terminal's Ctrl-C reaches the supervisor alone and each child sees one
signal per forwarded signal; a child whose supervisor died (SIGKILL) sees its lifeline pipe close
and drains itself. Under systemd use `KillMode=mixed` (the default `control-group` would signal
the children directly as well, and two signals mean "stop now").

The child's side (its spec and socket, the ready and lifeline pipes, the merged /metrics that
children answer for the whole gateway) is gateway/process_child.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import Settings, TenantSettings
from gateway.process_child import (
    EXIT_CONFIG_REFUSED,
    STATE_FILE,
    ChildSpec,
    tcp_socket,
    write_start,
)

log = logging.getLogger("kvgate.supervisor")

BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
# A child that lived this long before dying crashed on its own, not in a loop: backoff restarts.
BACKOFF_RESET_S = 60.0
# Every WATCH_INTERVAL_S the supervisor reads each serving child's metrics socket; a child that
# has not answered for HUNG_AFTER_S is hung (alive, not serving its share of new connections) and
# is killed, then restarted. Generous: a reload that loads a tokenizer blocks a loop for seconds.
WATCH_INTERVAL_S = 5.0
HUNG_AFTER_S = 30.0
# A child that has not listened this long after its start is stuck in start-up (a Redis, cluster
# or KV-events connect, a tokenizer load): it is killed, then restarted with the backoff, or at the
# first start the start fails. The deadline is this plus the part of start-up the child bounds
# itself (a restarted child waits up to probes.timeout_s + 1 s for its first probes), so a slow
# probe setting cannot make a healthy start look stuck. A module constant, not a setting: config.py
# has no field for it, and a healthy start takes seconds.
STARTUP_TIMEOUT_S = 60.0
# Signals forwarded to a child at least this far apart (once the kernel delivered one, the
# child's Python-level handler must run before the next, or it runs once for both), and the next
# one no later than FORWARD_WAIT_MAX_S after the last even while that is still pending there (a
# stopped child never takes it; sent anyway, it merges, which is all that could happen to it).
FORWARD_SPACING_S = 0.1
FORWARD_WAIT_MAX_S = 1.0


def process_count(value: int | str) -> int:
    """`server.processes` / `--processes` as a number: "auto" is the cores this process may run
    on (its affinity mask, which is what a container's cpuset gives), else the int itself."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            try:
                return max(1, len(os.sched_getaffinity(0)))
            except (AttributeError, OSError):  # no affinity masks (macOS)
                return max(1, os.cpu_count() or 1)
        value = int(value)
    if value < 1:
        raise ValueError(f"processes must be >= 1 or 'auto', got {value}")
    return value


def shared_state_problem(settings: Settings, processes: int) -> str | None:
    """Why `settings` cannot run as `processes` processes, in one line, or None.

    Also for one process that is one of several replicas ([cluster] on, or `quota.replicas` >
    1): with the memory backend each replica enforced the rate and concurrency limits on its own
    (two admitted 10 requests against a burst of 5) and nothing said so. Checked at the start
    only: a reload cannot change [quota] or [cluster] enabled (restart-only, pinned).
    Per-request caps (`max_input_tokens`, `max_output_tokens`) need no shared state."""
    if settings.quota.backend == "redis":
        return None
    if processes > 1:
        return (
            f"server.processes = {processes} needs shared quotas: set [quota] backend = "
            f'"redis" (and redis_url); with the memory backend each process would enforce every '
            f"limit on its own, {processes} times over"
        )
    if settings.cluster.enabled or settings.quota.replicas > 1:
        limited = sorted(n for n, t in settings.tenants.items() if _shared_limit(t))
        if limited:
            return (
                '[quota] backend = "memory" with several replicas ([cluster] enabled or '
                "quota.replicas > 1): each would enforce the rate and concurrency limits of "
                f'tenants {limited} on its own; set [quota] backend = "redis" (and redis_url)'
            )
    return None


def _shared_limit(t: TenantSettings) -> bool:
    """A limit counted across requests (rates, bursts, concurrency): one every replica shares."""
    own = (t.rpm, t.tpm, t.burst_requests, t.burst_tokens, t.max_concurrent)
    return any(v is not None for v in own) or any(
        v is not None
        for m in t.model_limits.values()
        for v in (m.rpm, m.tpm, m.burst_requests, m.burst_tokens)
    )


def child_environment(settings: Settings, processes: int) -> dict[str, str]:
    """Overrides every child runs with (environment beats the file, at start and on reload):
    `[cluster]` on, and each process counted as a replica in the quota store's fail-open share."""
    return {
        "KVGATE_CLUSTER__ENABLED": "true",
        "KVGATE_QUOTA__REPLICAS": str(settings.quota.replicas * processes),
    }


# ==================================================================================================
# The supervisor's side
# ==================================================================================================


@dataclass
class Slot:
    """One of the N places a child runs in; `index` is its `process` label, kept on restart."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    ready_r: int | None = None  # read end of the child's ready pipe, until it answers or exits
    ready: bool = False
    ever_ready: bool = False
    # Its exit was handled (Popen.send_signal may reap a child itself: `returncode` alone is no
    # sign that this loop saw the exit).
    reaped: bool = False
    started_at: float = 0.0
    starts: int = 0
    backoff_s: float = BACKOFF_INITIAL_S
    restart_at: float | None = None
    reload_pending: bool = False
    stuck: bool = False  # killed for not listening within the start-up deadline
    probe: socket.socket | None = None  # the watchdog's read of its metrics socket, in progress
    probe_at: float = 0.0
    answered_at: float = 0.0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


def _signal_pending(pid: int, sig: int) -> bool:
    """Whether `sig`, sent to `pid`, is still pending there (Linux /proc; False where it cannot be
    read): one more of it sent now would merge into it (standard signals do not queue)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    bit = 1 << (sig - 1)
    for line in text.splitlines():
        if line.startswith(("ShdPnd:", "SigPnd:")):
            with contextlib.suppress(IndexError, ValueError):
                if int(line.split()[1], 16) & bit:
                    return True
    return False


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    if code == EXIT_CONFIG_REFUSED:
        return (
            f"code {code} (it refused the config file, which changed since the gateway started "
            "in a way only a restart of the whole gateway may apply; its reason is logged above)"
        )
    return f"code {code}"


class Supervisor:
    """Starts, watches and restarts the children; forwards signals; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        child_argv: Sequence[str],
        processes: int,
        *,
        watch_interval_s: float = WATCH_INTERVAL_S,
        hung_after_s: float = HUNG_AFTER_S,
        startup_timeout_s: float | None = None,
    ) -> None:
        self.settings = settings
        self.watch_interval_s = watch_interval_s
        self.hung_after_s = hung_after_s
        # None: STARTUP_TIMEOUT_S plus the first-probe wait a restarted child bounds itself.
        if startup_timeout_s is None:
            startup_timeout_s = STARTUP_TIMEOUT_S + settings.probes.timeout_s + 1.0
        self.startup_timeout_s = startup_timeout_s
        self.child_argv = list(child_argv)
        self.n = processes
        self.host, self.port = settings.server.host, settings.server.port
        self.slots = [Slot(k) for k in range(processes)]
        self.env = {**os.environ, **child_environment(settings, processes)}
        self.run_dir = ""
        self.lifeline_r = self.lifeline_w = -1
        self.stopping = False
        self.stopped: list[Slot] = []
        self.signals = 0  # SIGTERM/SIGINT received (counted from the wakeup pipe)
        self.forwarded = 0  # of them, forwarded to the children
        self.forwarded_at = 0.0
        self.reload = False
        self.restarts = 0
        self.all_ready = False
        self._wake_r, self._wake_w = -1, -1

    # -- lifecycle -------------------------------------------------------------------------------
    def check_address(self) -> None:
        """Fail now (OSError) when anything listens on the address, kvgate children of another
        supervisor included: a bind without SO_REUSEPORT is refused by any listener, where the
        children's SO_REUSEPORT binds would quietly join another gateway's group. Port 0 becomes
        a concrete port here, the one every child binds."""
        probe = tcp_socket(self.host)
        try:
            probe.bind((self.host, self.port))
            self.port = probe.getsockname()[1]
        finally:
            probe.close()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def run(self) -> int:
        """Supervise until every child has exited after a signal; the exit status."""
        self.run_dir = tempfile.mkdtemp(prefix="kvgate-")
        # Before any child: a child restarted after an edit runs what its siblings run.
        write_start(self.run_dir, self.settings)
        self.lifeline_r, self.lifeline_w = os.pipe()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        old_wakeup = signal.set_wakeup_fd(self._wake_w)
        handlers = {
            sig: signal.signal(sig, self._on_signal)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }
        try:
            log.info(
                "starting %d processes on %s (SO_REUSEPORT; [cluster] on, quotas in Redis)",
                self.n,
                self.address,
            )
            for slot in self.slots:
                self._start(slot)
            self._write_state()
            return self._loop()
        finally:
            for slot in self.slots:  # only on a crash of this loop: never leave children behind
                if slot.alive and slot.proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.kill()
                    slot.proc.wait()
            for sig, h in handlers.items():
                signal.signal(sig, h)
            signal.set_wakeup_fd(old_wakeup)
            for fd in (self.lifeline_r, self.lifeline_w, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            for slot in self.slots:
                self._close_ready(slot)
                self._close_probe(slot)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _on_signal(self, sig: int, frame: object) -> None:
        """Installed so that CPython writes each delivery's number into the wakeup pipe, where
        `_wait` counts it; nothing is counted here: this runs once for several deliveries that
        land before the interpreter checks for signals."""

    def _loop(self) -> int:
        while True:
            self._forward_signals()
            if self.reload:
                self.reload = False
                self._forward_reload()
            # Shorter while a received signal still waits for the children to take the last one.
            self._wait(FORWARD_SPACING_S if self.forwarded < self.signals else 0.2)
            changed = self._read_ready()
            # Stopping too: a child whose loop hangs (or that is stopped, or stuck starting)
            # never acts on the forwarded SIGTERM, and the stop waited for it forever; a
            # draining child still answers its metrics socket.
            changed |= self._watch()
            changed |= self._check_startup()
            changed |= self._reap()
            if not self.stopping:
                if not self.all_ready and any(
                    s.proc is not None and s.proc.returncode is not None and not s.ever_ready
                    for s in self.slots
                ):
                    return self._abort_start()
                changed |= self._restart_due()
            if changed:
                self._write_state()
            if self.stopping and not any(s.alive for s in self.slots):
                # Of the children the stop found running (a crashed one waiting for its restart
                # was logged already); our SIGTERM ends one still starting with -15.
                codes = [s.proc.returncode for s in self.stopped if s.proc is not None]
                bad = [c for c in codes if c not in (0, -signal.SIGTERM)]
                log.info("all processes exited%s", f" ({bad} not cleanly)" if bad else "")
                return 1 if bad else 0

    def _wait(self, timeout: float) -> None:
        fds: list[Any] = [self._wake_r] + [s.ready_r for s in self.slots if s.ready_r is not None]
        fds += [s.probe for s in self.slots if s.probe is not None]
        with contextlib.suppress(InterruptedError):
            readable, _, _ = select.select(fds, [], [], timeout)
            if self._wake_r in readable:
                data = b""
                with contextlib.suppress(BlockingIOError, OSError):
                    data = os.read(self._wake_r, 512)
                # One byte per delivery, its signal number (more bytes: the next turn reads them).
                self.signals += data.count(signal.SIGTERM) + data.count(signal.SIGINT)
                if signal.SIGHUP in data:
                    self.reload = True

    # -- children --------------------------------------------------------------------------------
    def _start(self, slot: Slot) -> None:
        ready_r, ready_w = os.pipe()
        slot.starts += 1
        spec = ChildSpec(
            index=slot.index,
            processes=self.n,
            run_dir=self.run_dir,
            ready_fd=ready_w,
            lifeline_fd=self.lifeline_r,
            host=self.host,
            port=self.port,
            starts=slot.starts,
            supervisor_pid=os.getpid(),
        )
        try:
            slot.proc = subprocess.Popen(
                [*self.child_argv, "--child", spec.to_arg()],
                pass_fds=(ready_w, self.lifeline_r),
                env=self.env,
                process_group=0,  # a terminal's Ctrl-C reaches the supervisor only
            )
        finally:
            os.close(ready_w)
        slot.ready_r = ready_r
        slot.ready = slot.reaped = slot.stuck = False
        slot.started_at = time.monotonic()
        slot.restart_at = None

    def _close_ready(self, slot: Slot) -> None:
        if slot.ready_r is not None:
            with contextlib.suppress(OSError):
                os.close(slot.ready_r)
            slot.ready_r = None

    def _read_ready(self) -> bool:
        changed = False
        for slot in self.slots:
            if slot.ready_r is None:
                continue
            r, _, _ = select.select([slot.ready_r], [], [], 0)
            if not r:
                continue
            data = b""
            with contextlib.suppress(OSError):
                data = os.read(slot.ready_r, 64)
            self._close_ready(slot)  # one message, or EOF (it exited before listening)
            if data and slot.alive and slot.proc is not None:
                slot.ready = slot.ever_ready = changed = True
                slot.answered_at = time.monotonic()
                log.info("process %d (pid %d) is serving", slot.index, slot.proc.pid)
                if slot.reload_pending:
                    slot.reload_pending = False
                    self._kill(slot, signal.SIGHUP)
                if not self.all_ready and all(s.ready for s in self.slots):
                    self.all_ready = True
                    log.info("all %d processes are serving on %s", self.n, self.address)
        return changed

    def _reap(self) -> bool:
        changed = False
        now = time.monotonic()
        for slot in self.slots:
            p = slot.proc
            if p is None or slot.reaped or p.poll() is None:
                continue
            slot.reaped = changed = True
            slot.ready = slot.reload_pending = False
            self._close_ready(slot)
            self._close_probe(slot)
            if self.stopping or not (slot.ever_ready or self.all_ready):
                # Stopping, or a first start that failed (`_loop` then ends the whole start).
                log.info(
                    "process %d (pid %d) exited with %s",
                    slot.index,
                    p.pid,
                    _exit_text(p.returncode),
                )
                continue
            if now - slot.started_at >= BACKOFF_RESET_S:
                slot.backoff_s = BACKOFF_INITIAL_S
            delay = slot.backoff_s
            slot.backoff_s = min(BACKOFF_MAX_S, slot.backoff_s * 2)
            slot.restart_at = now + delay
            self.restarts += 1
            log.warning(
                "process %d (pid %d) exited with %s after %.1f s; restarting it in %.1f s "
                "(restart %d of this gateway)",
                slot.index,
                p.pid,
                _exit_text(p.returncode),
                now - slot.started_at,
                delay,
                self.restarts,
            )
        return changed

    # -- the watchdog ----------------------------------------------------------------------------
    def _watch(self) -> bool:
        """Read each serving child's metrics socket now and then (non-blocking, over several
        turns of the loop); kill one that has not answered for `hung_after_s`."""
        now = time.monotonic()
        changed = False
        for slot in self.slots:
            if not (slot.ready and slot.alive and slot.proc is not None):
                continue
            if slot.probe is not None:
                self._read_probe(slot, now)
            elif now - max(slot.answered_at, slot.probe_at) >= self.watch_interval_s:
                self._open_probe(slot, now)
            silent = now - slot.answered_at
            if silent >= self.hung_after_s:
                log.error(
                    "process %d (pid %d) has not answered for %.0f s: killing it (hung)",
                    slot.index,
                    slot.proc.pid,
                    silent,
                )
                self._close_probe(slot)
                self._kill(slot, signal.SIGKILL)
                slot.ready, changed = False, True  # not serving; restarted once reaped
        return changed

    def _check_startup(self) -> bool:
        """Kill a child that has not listened within `startup_timeout_s` of its start. The
        watchdog (`_watch`) looks at serving children only, and a start-up that hangs would
        otherwise leave its slot empty for good (N-1 processes serve, silently), or at the first
        start block the start forever. Once reaped, a restart goes through the backoff like any
        crash; at the first start `_loop` ends the start (`_abort_start`)."""
        now = time.monotonic()
        changed = False
        for slot in self.slots:
            if slot.ready or slot.stuck or not slot.alive or slot.proc is None:
                continue
            waited = now - slot.started_at
            if waited < self.startup_timeout_s:
                continue
            first = not (slot.ever_ready or self.all_ready)
            log.error(
                "process %d (pid %d) has not listened %.0f s after its start: killing it (stuck "
                "in start-up)%s",
                slot.index,
                slot.proc.pid,
                waited,
                "" if first else "; it is restarted like a crashed one",
            )
            slot.stuck = changed = True
            self._kill(slot, signal.SIGKILL)
        return changed

    def _open_probe(self, slot: Slot, now: float) -> None:
        slot.probe_at = now
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(Path(self.run_dir) / f"metrics-{slot.index}.sock"))
        except (BlockingIOError, InterruptedError):
            pass  # in progress: a full backlog
        except OSError:  # no socket, or no one listening on it: silence, tried again later
            sock.close()
            return
        slot.probe = sock

    def _read_probe(self, slot: Slot, now: float) -> None:
        assert slot.probe is not None
        try:
            while slot.probe.recv(1 << 16):  # to the end: the child writes its whole exposition
                pass
        except (BlockingIOError, InterruptedError):
            return  # more to come
        except OSError:
            self._close_probe(slot)
            return
        slot.answered_at = now
        self._close_probe(slot)

    def _close_probe(self, slot: Slot) -> None:
        if slot.probe is not None:
            slot.probe.close()
            slot.probe = None

    def _restart_due(self) -> bool:
        now = time.monotonic()
        due = [s for s in self.slots if s.restart_at is not None and s.restart_at <= now]
        for slot in due:
            self._start(slot)
            log.info("process %d restarted", slot.index)
        return bool(due)

    def _abort_start(self) -> int:
        for slot in self.slots:
            code = slot.proc.returncode if slot.proc is not None else None
            if code is not None and not slot.ever_ready and slot.stuck:
                log.error(
                    "process %d did not listen within %.0f s of its start: the gateway cannot "
                    "start (stuck in start-up: a Redis, cluster or KV-events connect, a tokenizer "
                    "load?); stopping the others",
                    slot.index,
                    self.startup_timeout_s,
                )
            elif code is not None and not slot.ever_ready:
                log.error(
                    "process %d exited with %s before it served: the gateway cannot start (its "
                    "error is logged above); stopping the others",
                    slot.index,
                    _exit_text(code),
                )
        self.stopping = True
        for slot in self.slots:
            self._kill(slot, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for slot in self.slots:
            if slot.proc is not None:
                try:
                    slot.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    slot.proc.kill()
                    slot.proc.wait()
        return 1

    def _kill(self, slot: Slot, sig: int) -> None:
        if slot.alive and slot.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                slot.proc.send_signal(sig)

    def _forward_signals(self) -> None:
        """Forward the next SIGTERM/SIGINT received, if any, once the children took the last
        one (`_signal_pending`) and at least FORWARD_SPACING_S after it: two sent back to back
        merge in the child, and a second signal would only prolong the drain."""
        if self.forwarded >= self.signals:
            return
        now = time.monotonic()
        if self.forwarded:
            since = now - self.forwarded_at
            if since < FORWARD_SPACING_S:
                return
            if since < FORWARD_WAIT_MAX_S and any(
                _signal_pending(s.proc.pid, signal.SIGTERM)
                for s in self.slots
                if s.alive and s.proc is not None
            ):
                return
        self.forwarded += 1
        self.forwarded_at = now
        self._shutdown(self.forwarded)

    def _shutdown(self, count: int) -> None:
        """Signal `count` (SIGTERM/SIGINT): forwarded as SIGTERM; the fourth kills."""
        if not self.stopping:
            self.stopping = True
            self.stopped = [s for s in self.slots if s.alive]
            log.warning("stopping: draining %d processes", len(self.stopped))
        for slot in self.slots:
            slot.restart_at = None
            self._kill(slot, signal.SIGKILL if count >= 4 else signal.SIGTERM)
        self._write_state()

    def _forward_reload(self) -> None:
        n = 0
        for slot in self.slots:
            if slot.ready:
                self._kill(slot, signal.SIGHUP)
                n += 1
            elif slot.alive:
                slot.reload_pending = True  # sent once it listens (its handler is in place)
        log.info("SIGHUP: config reload sent to %d processes", n)

    def _write_state(self) -> None:
        state = {
            "target": self.n,
            "live": sum(1 for s in self.slots if s.alive),
            "serving": sum(1 for s in self.slots if s.ready),
            "serving_slots": [s.index for s in self.slots if s.ready],
            "restarts": self.restarts,
            "stopping": self.stopping,
            "pids": {str(s.index): s.proc.pid for s in self.slots if s.alive and s.proc},
        }
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_name(STATE_FILE + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(state), encoding="utf-8")
            os.replace(tmp, path)


def supervise(
    settings: Settings,
    child_argv: Sequence[str],
    processes: int,
) -> int:
    """`kvgate serve` with N > 1: check the config can be shared, bind, supervise."""
    problem = shared_state_problem(settings, processes)
    if problem:
        print(f"kvgate: {problem}", file=sys.stderr, flush=True)
        return 2
    sup = Supervisor(settings, child_argv, processes)
    try:
        sup.check_address()
    except OSError as e:
        print(f"kvgate: cannot listen on {sup.address}: {e}", file=sys.stderr, flush=True)
        return 1
    if not settings.cluster.enabled:
        log.warning(
            "server.processes = %d: [cluster] turned on for the processes (they share per-worker "
            "load through Redis like replicas)",
            processes,
        )
    return sup.run()
