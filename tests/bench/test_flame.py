"""bench.flame: py-spy's collapsed stacks summarised, a recorder that says why it got nothing, and
`bench overhead --flame` recording the gateway in a tiny real ladder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import overhead
from bench.flame import FlameRecorder, py_spy, top_frames

RAW = "\n".join(
    [
        "main (a.py:1);loop (a.py:5);handle (b.py:10) 6",
        "main (a.py:1);loop (a.py:5) 3",
        "main (a.py:1);loop (a.py:5);handle (b.py:10);record (c.py:7) 1",
        "garbage line",
        "",
    ]
)


def test_top_frames_ranks_own_samples_with_inclusive_shares() -> None:
    top = top_frames(RAW)
    assert [r["frame"] for r in top] == ["handle (b.py:10)", "loop (a.py:5)", "record (c.py:7)"]
    assert top[0] == {"frame": "handle (b.py:10)", "self": 0.6, "inclusive": 0.7}
    assert top[1] == {"frame": "loop (a.py:5)", "self": 0.3, "inclusive": 1.0}
    assert top_frames(RAW, n=1) == top[:1]
    assert top_frames("") == []


def test_a_recorder_without_a_target_says_why(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    got = FlameRecorder(dead.pid, tmp_path / "f.svg", 0.0, 1.0).finish()
    assert set(got) == {"error"} and "py-spy" in got["error"]
    assert not (tmp_path / "f.svg").exists()


def test_py_spy_is_installed_with_the_bench_extras() -> None:
    assert py_spy() is not None


def test_overhead_flame_records_the_gateway(tmp_path: Path) -> None:
    """kvgate alone, 1 simulated worker, one short level profiled: the SVG and the stacks are
    written and the top frames are the gateway's own code and its event loop."""
    svg, out_json = tmp_path / "kvgate.svg", tmp_path / "o.json"
    argv = [
        *("--flame", str(svg), "--workers", "1", "--concurrency", "4", "--no-direct"),
        *("--seconds", "2", "--warmup", "0.5", "--json", str(out_json)),
        *("--png", str(tmp_path / "o.png")),
    ]
    assert overhead.main(argv) == 0
    (kv,) = json.loads(out_json.read_text())["targets"]
    flame = kv["flame"]
    assert "error" not in flame, flame
    assert flame["level"] == 4 and flame["samples"] > 0
    assert svg.read_text(errors="replace").lstrip().startswith(("<?xml", "<svg"))
    stacks = Path(flame["raw"]).read_text()
    assert "gateway/" in stacks  # the walk's own frames were sampled
    assert 1 <= len(flame["top"]) <= 15
    assert all(0 < r["self"] <= r["inclusive"] <= 1 for r in flame["top"])


def test_flame_at_needs_flame() -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--flame-at", "16"])
