"""Latency distributions, SLOs and the machine description shared by every bench report.

One percentile definition everywhere (nearest rank, as `workers.sim.vclock.percentile`): the
offline simulation and the HTTP replay must be comparable number for number, and nearest rank
always reports a latency that some request actually had (interpolation invents values between
two requests, which at p99 of a few hundred requests is noticeably off).
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.sim.vclock import nearest_rank

QUANTILES: tuple[int, ...] = (50, 90, 95, 99)


def dist(values: Sequence[float]) -> dict[str, float | None]:
    """`{"mean", "p50", "p90", "p95", "p99", "max", "count"}` of values (None when empty).

    Sorted once for all quantiles: ITL lists run to ~10^6 gaps on a full trace.
    """
    if not values:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}, "max": None, "count": 0}
    ordered = sorted(values)
    out: dict[str, float | None] = {"mean": math.fsum(ordered) / len(ordered)}
    for q in QUANTILES:
        out[f"p{q}"] = nearest_rank(ordered, q)
    out["max"] = ordered[-1]
    out["count"] = len(ordered)
    return out


@dataclass(slots=True, frozen=True)
class SLO:
    """Per-request service levels a request must all meet to count towards goodput (seconds).

    `None` leaves that metric unconstrained. TPOT is vLLM's: (E2E - TTFT) / (output tokens - 1),
    undefined (and so unconstrained) for single-token outputs.
    """

    ttft: float | None = 2.0
    tpot: float | None = 0.1
    e2e: float | None = None

    def met(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        if ttft is None or e2e is None:
            return False  # failed or unfinished: never good
        if self.ttft is not None and ttft > self.ttft:
            return False
        if self.tpot is not None and tpot is not None and tpot > self.tpot:
            return False
        return not (self.e2e is not None and e2e > self.e2e)

    def describe(self) -> str:
        parts = [
            f"{name} <= {v:g} s"
            for name, v in (("TTFT", self.ttft), ("TPOT", self.tpot), ("E2E", self.e2e))
            if v is not None
        ]
        return ", ".join(parts) or "none"

    def to_json(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e}


def tpot(e2e: float | None, ttft: float | None, output_tokens: int) -> float | None:
    """vLLM's time per output token after the first; None when it is undefined."""
    if e2e is None or ttft is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def balance(counts: Sequence[float]) -> float | None:
    """max/mean of per-worker amounts: 1.0 is perfectly even, N means one worker took it all."""
    if not counts:
        return None
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else None


def machine() -> dict[str, Any]:
    """What ran the bench: every report states it (a 2-core laptop is not an 8-GPU node)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "load_avg_1m": load,
    }


def fmt_s(v: float | None, digits: int = 3) -> str:
    """Seconds for a table cell ("-" for missing)."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"
