"""`kvgate serve --processes N`'s supervisor (gateway/supervisor.py) with stand-in children:
every SIGTERM/SIGINT it receives reaches the children as one SIGTERM each (the second stops them
now, not a second drain), and a child that hangs before it listens is killed (then restarted with
the backoff, or at the first start the start fails with a clear error) instead of leaving its
slot empty. Deadlines are generous and conditions are polled: the cores are shared.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.redis_server import free_port
from tests.gateway.test_processes import CHILD_START

REPO = Path(__file__).resolve().parents[2]

# argv: port, child script, processes, start-up timeout (the module constant; the deadline adds
# probes.timeout_s + 1 s = 2 s), then the child's own arguments.
SUPERVISE = """
import sys
import gateway.supervisor as supervisor
from gateway.logs import setup_logging
from tests.gateway.conftest import settings_for
setup_logging("info", "text")
supervisor.STARTUP_TIMEOUT_S = float(sys.argv[4])
s = settings_for([], quota={"backend": "redis"}, server={"port": int(sys.argv[1])})
child = [sys.executable, "-c", sys.argv[2], *sys.argv[5:]]
sup = supervisor.Supervisor(s, child, int(sys.argv[3]), watch_interval_s=0.2, hung_after_s=30)
sys.exit(sup.run())
"""

# Serves; writes a line per SIGTERM to <argv[1]>.<index>. One SIGTERM drains for 30 s (as
# DrainingServer drains for drain_grace_s), a second one ends it at once.
COUNTING_CHILD = (
    CHILD_START
    + """
import signal
marks = sys.argv[1] + f".{spec['index']}"
terms = 0
def on_term(*_):
    global terms
    terms += 1
    with open(marks, "a") as f:
        f.write("TERM\\n")
signal.signal(signal.SIGTERM, on_term)
async def main():
    await serve()
    first = None
    while terms < 2:
        await asyncio.sleep(0.02)
        if terms == 1:
            first = first or time.monotonic()
            if time.monotonic() - first > 30:
                return
asyncio.run(main())
"""
)

# argv[1] "restart": the first start serves, slot 0 then crashes, and every later start hangs
# before it listens. "first": every start hangs before it listens.
STUCK_CHILD = (
    CHILD_START
    + """
if sys.argv[1] == "restart" and spec["starts"] == 1:
    async def main():
        await serve()
        await asyncio.sleep(0.5 if spec["index"] == 0 else 3600)
        sys.exit(7)
    asyncio.run(main())
else:
    time.sleep(3600)  # stuck in start-up (a hung connect): never listens
"""
)


def supervise(
    tmp_path: Path, child: str, processes: int, startup_s: float, *args: str
) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "sup.log"
    argv = [sys.executable, "-c", SUPERVISE, str(free_port()), child, str(processes)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*argv, str(startup_s), *args], stdout=f, stderr=subprocess.STDOUT, cwd=REPO
        )
    return proc, log


def wait_until(pred: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}\n{log.read_text()}")
        time.sleep(0.05)


def pending(pid: int, sig: int) -> bool:
    """`sig` is pending in `pid` (/proc/<pid>/status), read here independently of the module."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) >> (sig - 1) & 1:
            return True
    return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a supervisor a test left running, its children with it (they drain on the lifeline)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _two_signals_reach_the_child_as_two(tmp_path: Path, send: Callable[[int], None]) -> None:
    marks = tmp_path / "terms"
    proc, log = supervise(tmp_path, COUNTING_CHILD, 1, 60, str(marks))
    try:
        wait_until(lambda: "is serving" in log.read_text(), 60, "child serving", log)
        send(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)  # one SIGTERM alone would drain the child for 30 s
        got = Path(f"{marks}.0").read_text().count("TERM")
        assert got == 2 and proc.returncode == 0, (
            f"the child got {got} SIGTERM(s) for 2 signals sent to the supervisor "
            f"(supervisor exit: {proc.returncode})\n{log.read_text()}"
        )
    finally:
        stop(proc)


def test_sigterm_then_sigint_reach_the_children_as_two_sigterms(tmp_path: Path) -> None:
    """Two different signals sent back to back both reach the supervisor (the kernel merges
    only the same signal), land in the same turn of its loop, and were forwarded as one."""

    def send(pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)

    _two_signals_reach_the_child_as_two(tmp_path, send)


def test_kill_kill_reaches_the_children_as_two_sigterms(tmp_path: Path) -> None:
    """`kill $pid; kill $pid`: the second SIGTERM is sent once the supervisor took the first (a
    shell's two `kill` commands are that far apart; sooner, the kernel merges them before the
    supervisor could count them)."""

    def send(pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while pending(pid, signal.SIGTERM) and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.kill(pid, signal.SIGTERM)

    _two_signals_reach_the_child_as_two(tmp_path, send)


def test_a_restarted_child_stuck_in_start_up_is_killed_and_restarted(tmp_path: Path) -> None:
    """Slot 0 serves, crashes and is restarted; the new process hangs before it listens. It is
    killed at the start-up deadline (1 + 2 s here) and restarted again, with the backoff."""
    proc, log = supervise(tmp_path, STUCK_CHILD, 2, 1.0, "restart")
    try:
        wait_until(
            lambda: (
                "killing it (stuck in start-up)" in log.read_text()
                and log.read_text().count("process 0 restarted") >= 2
            ),
            90,
            "the stuck restart killed and restarted",
            log,
        )
    finally:
        stop(proc)
    text = log.read_text()
    assert "process 0 (pid" in text and "exited with signal SIGKILL" in text, text
    assert "restarting it in 1.0 s" in text, text  # the backoff doubled: the crash path
    stuck = [line for line in text.splitlines() if "stuck in start-up" in line]
    assert all("process 0 (pid" in line for line in stuck), text  # slot 1 serves throughout


def test_a_child_stuck_at_the_first_start_fails_the_start(tmp_path: Path) -> None:
    proc, log = supervise(tmp_path, STUCK_CHILD, 2, 1.0, "first")
    try:
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the start never ended\n{log.read_text()}") from None
    finally:
        stop(proc)
    text = log.read_text()
    assert code == 1, text
    assert "did not listen within 3 s of its start: the gateway cannot start" in text, text
    assert "restarted" not in text, text  # a first start is not retried


def test_signal_pending_reads_the_pending_set() -> None:
    """A SIGTERM a process blocks stays pending there; none is pending in this process."""
    from gateway.supervisor import _signal_pending

    code = "import signal, time; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); "
    code += "print('blocked', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"blocked\n"
        assert not _signal_pending(child.pid, signal.SIGTERM)
        child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not _signal_pending(child.pid, signal.SIGTERM):
            assert time.monotonic() < deadline, "SIGTERM never seen pending"
            time.sleep(0.01)
        assert not _signal_pending(child.pid, signal.SIGINT)
        assert not _signal_pending(os.getpid(), signal.SIGTERM)
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.wait(10)


def comment_above(text: str, key: str) -> str:
    """The comment lines right above `key = ...` in a TOML file, joined."""
    lines = text[: text.index(f"\n{key} = ")].splitlines()
    above: list[str] = []
    for line in reversed(lines):
        if not line.startswith("#"):
            break
        above.insert(0, line.lstrip("# "))
    return " ".join(above)


def test_docs_say_the_admission_queue_bounds_are_per_process() -> None:
    """With N processes each has its own admission queue: N times max_queued can wait. The README
    says so where it lists the per-process limits, and so do the config example's comments."""
    readme = (REPO / "README.md").read_text()
    para = readme[readme.index("- **Needs Redis.**") :]
    para = " ".join(para[: para.index("\n- **")].split())
    assert "`max_queued` and `max_queued_per_tenant`" in para, para
    assert "per process" in para and "N times the configured value" in para, para
    example = (REPO / "config.example.toml").read_text()
    for key in ("max_queued", "max_queued_per_tenant"):
        assert "per process" in comment_above(example, key).lower(), key
