"""Argparse types the bench CLIs share: a number flag checked as it is parsed.

Why: a flag out of its range (`--rate-scale 0`, `--sample inf`, `--workers -1`) used to pass
argparse and then fail deep in a run as a traceback, or be silently ignored where the code tested
it for truth (`if args.rate_scale:`), or turn into NaN in a report. As a `type=` it is refused
like any usage error, `prog: error: argument --rate-scale: ...` on one line with exit 2, before a
trace is loaded or a process forked, and the same flag means the same range in every tool.
"""

from __future__ import annotations

import argparse
import math


def positive(text: str) -> float:
    """A finite number > 0: a rate, a scale, a load, a fraction or count to sample."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text!r}")
    return value


def count(text: str) -> int:
    """A whole number >= 1: workers, blocks, tokens, requests to keep."""
    return _whole(text, 1)


def _whole(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, not {text!r}")
    return value


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def goodput(text: str) -> str:
    """One `--goodput` item, `vllm bench serve`'s METRIC:MS (ttft, tpot or e2el; MS a finite
    number > 0), checked as it is parsed: `ttft`, `ttft:abc` and `ttft:nan` were a traceback or an
    SLO no request could meet. Returned as written, for `bench.replay.parse_goodput`."""
    metric, sep, ms = text.partition(":")
    if metric.strip().lower() not in GOODPUT_METRICS or not sep:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}"
        )
    try:
        positive(ms)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds {e}") from None
    return text


def nonnegative_int(text: str) -> int:
    """A whole number >= 0, where 0 means "no cap" (`--max-output 0`)."""
    return _whole(text, 0)
