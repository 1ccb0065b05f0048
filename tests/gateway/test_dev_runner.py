"""`kvgate dev` (what `make run` starts) and Ctrl-C.

A developer's Ctrl-C with a stream open must not sit through the production drain (30 s by
default): the first one drains briefly and ends open streams with the SSE error event, a second one
stops at once, and neither prints a traceback. `kvgate serve` keeps the configured drain
(tests/gateway/test_drain.py). Ctrl-C is modelled as SIGINT to the runner's process group, which is
what a terminal sends; the simulated workers run in their own sessions, as they do under a shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.conftest import MODEL, free_ports

# Far above the dev runner's drain (a few seconds) and the workers' stop, far below the
# production drain grace (30 s) that the runner used to wait for.
FIRST_CTRL_C_EXIT_S = 20.0
# A second Ctrl-C stops at once; the bound leaves room for the simulated workers' SIGTERM and a
# loaded CI machine, and is still well under what the old runner took (~12 s after the second).
SECOND_CTRL_C_EXIT_S = 8.0


def _chat(max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": max_tokens,
        "stream": True,
    }


@dataclass
class Runner:
    proc: asyncio.subprocess.Process
    url: str
    stderr: asyncio.Task[bytes]  # read from the start: the workers write there too


@contextlib.asynccontextmanager
async def _dev_runner(tmp_path: Path) -> AsyncIterator[Runner]:
    """`kvgate dev` on free ports with two simulated workers (the default, realistic timing
    profile: a long stream lasts far longer than the test), ready to serve."""
    sim_port = free_ports(2)
    port = free_ports(1)
    cfg = tmp_path / "dev.toml"
    cfg.write_text(
        f'[server]\nport = {port}\n[logging]\nlevel = "warning"\n[probes]\ninterval_s = 0.2\n'
        f'[[workers]]\nname = "sim-1"\nurl = "http://127.0.0.1:{sim_port}"\n'
        f'[[workers]]\nname = "sim-2"\nurl = "http://127.0.0.1:{sim_port + 1}"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "dev",
        "--config",
        str(cfg),
        "--model",
        MODEL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    assert proc.stderr is not None
    stderr = asyncio.create_task(proc.stderr.read())
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            deadline = time.monotonic() + 60
            while True:
                assert proc.returncode is None, "kvgate dev exited during start-up"
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(url + "/ready")).status_code == 200:
                        break
                assert time.monotonic() < deadline, "kvgate dev never became ready"
                await asyncio.sleep(0.1)
        yield Runner(proc, url, stderr)
    finally:
        if proc.returncode is None:  # a failed test: stop the runner and its workers hard
            for pid in [proc.pid, *_children(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        await proc.wait()
        if not stderr.done():
            stderr.cancel()


def _children(pid: int) -> list[int]:
    """The runner's simulated workers (each leads a session of its own, so a signal to the
    runner's group does not reach them)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _ctrl_c(proc: asyncio.subprocess.Process) -> None:
    os.killpg(proc.pid, signal.SIGINT)


async def _exit_by(runner: Runner, deadline: float) -> str:
    """Wait for the runner to exit by `deadline` (time.monotonic()); its stderr."""
    try:
        await asyncio.wait_for(runner.proc.wait(), max(0.1, deadline - time.monotonic()))
    except TimeoutError:
        raise AssertionError(
            "kvgate dev still running long after Ctrl-C (the full drain?)"
        ) from None
    return (await runner.stderr).decode(errors="replace")


async def test_ctrl_c_with_a_stream_open_drains_briefly_and_exits(tmp_path: Path) -> None:
    async with (
        _dev_runner(tmp_path) as dev,
        httpx.AsyncClient(timeout=httpx.Timeout(5, read=FIRST_CTRL_C_EXIT_S)) as c,
        c.stream("POST", dev.url + "/v1/chat/completions", json=_chat(8000)) as r,
    ):
        assert r.status_code == 200
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        _ctrl_c(dev.proc)
        deadline = time.monotonic() + FIRST_CTRL_C_EXIT_S
        async with asyncio.timeout_at(asyncio.get_running_loop().time() + FIRST_CTRL_C_EXIT_S):
            rest = [line async for line in lines if line]
        stderr = await _exit_by(dev, deadline)
    # The open stream was ended the documented way (error event, then the terminator), not cut.
    assert rest[-1] == "data: [DONE]"
    assert "shutting down" in rest[-2] and '"error"' in rest[-2]
    assert dev.proc.returncode == 0
    assert "Traceback" not in stderr, stderr[-3000:]


async def test_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path: Path) -> None:
    async with (
        _dev_runner(tmp_path) as dev,
        httpx.AsyncClient(timeout=httpx.Timeout(5, read=SECOND_CTRL_C_EXIT_S)) as c,
        c.stream("POST", dev.url + "/v1/chat/completions", json=_chat(8000)) as r,
    ):
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        _ctrl_c(dev.proc)
        # The drain has started (polled: /ready fails once the first Ctrl-C is handled; two
        # signals sent before the process runs again would arrive as one).
        async with httpx.AsyncClient(timeout=5) as probe:
            deadline = time.monotonic() + 10
            while (await probe.get(dev.url + "/ready")).status_code != 503:
                assert time.monotonic() < deadline, "the first Ctrl-C never started the drain"
                await asyncio.sleep(0.02)
        _ctrl_c(dev.proc)
        stderr = await _exit_by(dev, time.monotonic() + SECOND_CTRL_C_EXIT_S)
        with contextlib.suppress(httpx.HTTPError):
            async for _ in lines:
                pass
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "CancelledError" not in stderr, stderr[-3000:]
    assert dev.proc.returncode == 0
