"""A reload signal sent while `kvgate serve` starts does not end it.

Review finding: SIGHUP was ignored during start-up only by the children of `--processes`; a lone
gateway (and the supervisor before it set its handlers) kept SIGHUP's default action until the
config watcher took it over, so an early reload (`systemctl reload` right after a start) killed
it with status 129. What is left is the interpreter's own start, before any of our code runs.
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

import pytest

from gateway import cli


class _Stop(Exception):
    pass


def test_serve_ignores_sighup_before_it_reads_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def load(path: str) -> Any:
        seen.append(signal.getsignal(signal.SIGHUP))
        raise _Stop

    monkeypatch.setattr(cli, "_load", load)
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        args = argparse.Namespace(child=None, config="kvgate.toml", host=None, port=None)
        with pytest.raises(_Stop):
            cli.cmd_serve(args)
    finally:
        signal.signal(signal.SIGHUP, before)
    assert seen == [signal.SIG_IGN]
