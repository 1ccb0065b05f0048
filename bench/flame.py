"""A flame graph of a running process, and its top frames, with py-spy (`bench overhead --flame`).

Why py-spy: it samples a live CPython process from outside (no instrumentation, no restart, no
change to what is measured: `--nonblocking` reads the target's memory without pausing it), and it
writes the SVG itself. Two samplers run side by side over the same window: one writes the flame
graph, the other the collapsed stacks (`raw`), which `top_frames` turns into the table of where
the time went, so a before/after comparison is two tables, not two pictures.

Attaching needs ptrace rights over the target: root, or `kernel.yama.ptrace_scope = 0` for a
process that is not a descendant of py-spy. Without them the recorder reports py-spy's reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["FlameRecorder", "py_spy", "top_frames"]

SAMPLE_RATE = 250  # per second: ~2,000 samples over an 8 s level


def py_spy() -> str | None:
    """The py-spy next to this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def top_frames(raw: str, n: int = 15) -> list[dict[str, Any]]:
    """The ``n`` frames with the most samples of their own (self) from py-spy's collapsed stacks
    (``frame;frame;... count`` per line), each with its inclusive share too. Frames are named
    ``function (file:line)`` as py-spy prints them; the shares are of all samples."""
    own: Counter[str] = Counter()
    within: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = stack.split(";")
        total += k
        own[frames[-1]] += k
        for f in set(frames):
            within[f] += k
    if not total:
        return []
    return [
        {"frame": f, "self": round(k / total, 4), "inclusive": round(within[f] / total, 4)}
        for f, k in own.most_common(n)
    ]


class FlameRecorder:
    """py-spy on ``pid`` from ``delay_s`` from now for ``seconds``: an SVG at ``svg`` and the
    collapsed stacks beside it (``.txt``). ``finish`` waits for both and says what came of it."""

    def __init__(self, pid: int, svg: Path, delay_s: float, seconds: float) -> None:
        self.pid = pid
        self.svg = svg
        self.raw = svg.with_suffix(".txt")
        self.seconds = seconds
        self._procs: list[subprocess.Popen[bytes]] = []
        self._error = ""
        self._timer = threading.Timer(max(0.0, delay_s), self._start)
        self._timer.daemon = True
        self._timer.start()

    def _start(self) -> None:
        exe = py_spy()
        if exe is None:
            self._error = "py-spy is not installed (pip install py-spy)"
            return
        self.svg.parent.mkdir(parents=True, exist_ok=True)
        base = [exe, "record", "-p", str(self.pid), "-d", f"{max(1, round(self.seconds))}"]
        # --function: a function's samples in one frame (named by its first line), not one
        # frame per line it was on, so the top table names functions.
        base += ["-r", str(SAMPLE_RATE), "--nonblocking", "--function"]
        try:
            for fmt, out in (("flamegraph", self.svg), ("raw", self.raw)):
                self._procs.append(
                    subprocess.Popen(
                        [*base, "-f", fmt, "-o", str(out)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                    )
                )
        except OSError as e:
            self._error = f"py-spy did not start: {e}"

    def finish(self, n: int = 15) -> dict[str, Any]:
        """{"svg", "raw", "samples", "top"} once both files are written, else {"error"}."""
        self._timer.join()
        errors = [self._error] if self._error else []
        for p in self._procs:
            try:
                _, err = p.communicate(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode != 0:
                tail = (err or b"").decode(errors="replace").strip().splitlines()[-3:]
                errors.append(f"py-spy exited {p.returncode}: {' | '.join(tail)}")
        if errors or not (self.svg.exists() and self.raw.exists()):
            return {"error": "; ".join(errors) or "py-spy wrote no output"}
        raw = self.raw.read_text(errors="replace")
        samples = sum(
            int(c) for c in (line.rpartition(" ")[2] for line in raw.splitlines()) if c.isdigit()
        )
        return {
            "svg": str(self.svg),
            "raw": str(self.raw),
            "samples": samples,
            "top": top_frames(raw, n),
        }
