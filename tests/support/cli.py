"""A command-line tool's refusal, as a user meets it: exit status 2 and one line saying why."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def cli_error(
    capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], int], argv: list[str]
) -> str:
    """The last line a refused ``main(argv)`` wrote to stderr; fails on another exit status or
    on a traceback (a bad flag or input must be a usage error, never a crash)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line
    return line
