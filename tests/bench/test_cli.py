"""`kvgate bench`: the tool list, help, unknown tools, and a missing trace as one line."""

from __future__ import annotations

import ast
import importlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.__main__ import TOOLS
from bench.__main__ import main as bench_main
from bench.redis_server import free_port
from gateway.cli import _banner, _python
from gateway.cli import main as kvgate_main

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_help_lists_every_tool_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--help", "-h"):
        assert kvgate_main(["bench", flag]) == 0
        out = capsys.readouterr().out
        for name, (_, line) in TOOLS.items():
            assert f"  {name}" in out and line in out
            assert len(line) <= 80 and "\n" not in line
    assert bench_main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out


def test_bench_tool_help_is_the_tools_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        kvgate_main(["bench", "simulate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--policies" in out and "--wide" in out
    with pytest.raises(SystemExit) as e:
        kvgate_main(["bench", "overhead", "--help"])
    assert e.value.code == 0
    assert "--concurrency" in capsys.readouterr().out


def test_unknown_or_missing_tool_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate_main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown tool 'nope'" in err and "simulate" in err
    assert kvgate_main(["bench"]) == 2
    assert "which tool" in capsys.readouterr().err


def test_every_bench_module_with_a_main_is_a_tool() -> None:
    """A tool added to bench/ without an entry here would be 'unknown' to `kvgate bench`."""
    with_main = set()
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            with_main.add(path.stem)
    with_main.discard("__main__")
    assert {m.removeprefix("bench.") for m, _ in TOOLS.values()} == with_main
    assert set(TOOLS) == with_main
    for module, _ in TOOLS.values():  # every tool's main takes argv (the dispatcher passes it)
        fn = importlib.import_module(module).main
        assert "argv" in fn.__code__.co_varnames[: fn.__code__.co_argcount]


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--trace", "no/such/trace.jsonl", "--quiet"],
        ["capacity", "--trace", "no/such/trace.jsonl"],
        ["compare", "--trace", "no/such/trace.jsonl", "--peers", "none"],
        ["replay", "--url", "http://127.0.0.1:9", "--trace", "no/such/trace.jsonl"],
        ["traces", "info", "no/such/trace.jsonl"],
        ["sim_speed", "--trace", "no/such/trace.jsonl"],
    ],
)
def test_a_missing_trace_is_one_line_not_a_traceback(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        bench_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "trace not found: no/such/trace.jsonl" in err
    assert "bench/data/traces" in err  # where the shipped samples are


def test_a_bench_stopped_by_sigterm_cleans_up_what_it_started() -> None:
    # Doc audit: a bench stopped by `timeout` or `kill` (SIGTERM) died at once and left its
    # fleet, gateways and files behind; it now runs the clean-up Ctrl-C runs.
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "redis_server", "--port", str(port)],
        stdout=subprocess.PIPE,
        cwd=BENCH.parent,
        text=True,
    )
    try:
        assert proc.stdout is not None and f":{port}" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while True:  # the redis-server it started is gone with it
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "the bench's redis-server outlived it"
        time.sleep(0.1)


def test_a_tool_whose_extras_are_missing_says_how_to_install_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing(name: str) -> None:
        raise ModuleNotFoundError("No module named 'rich'", name="rich")

    monkeypatch.setattr(importlib, "import_module", missing)
    assert bench_main(["simulate"]) == 2
    assert "pip install '.[bench]'" in capsys.readouterr().err


def test_the_make_run_banner_names_a_python_that_has_openai() -> None:
    # Doc audit: the banner's `python -c` snippet failed as pasted (the shell's python has no
    # openai); it names this interpreter, relative to the repository when inside it.
    python = _python()
    done = subprocess.run(
        [python, "-c", "import openai"], cwd=Path.cwd(), capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert f"{python} -c '" in _banner("http://127.0.0.1:8000", "m", 4, "k")
