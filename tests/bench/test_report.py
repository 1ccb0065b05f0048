"""Reports: tables readable in a 100-column terminal with every digit, outputs under bench/out/."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from bench import capacity, paths, simulate, soak, spike
from bench.compare import console_table
from bench.simulate import print_table, report_table

SYNTH = "synthetic:groups=4,users=2,system_tokens=512,question_tokens=64,output_tokens=8,rate=40,num_requests=60,block_size=16"
SMALL_FLEET = ["--workers", "2", "--num-blocks", "200", "--max-model-len", "4096"]
REPO = Path(__file__).resolve().parents[2]


def _dist(base: float) -> dict[str, float]:
    return {"mean": base, "p50": base, "p90": base * 3, "p95": base * 4, "p99": base * 5}


def _policy(name: str, hit: float) -> dict[str, Any]:
    """A report row with wide numbers (long TTFT tails, thousands of tokens/s), the case that
    used to be cut to `0.…` in a 100-column terminal."""
    return {
        "policy": name,
        "hit_rate": hit,
        "hit_vs_bound": hit / 0.65,
        "hit_vs_pooled_bound": hit / 0.395,
        "ttft": _dist(12.345678),
        "ttft_p99_vs_floor": 12.345678 / 1.9213,
        "tpot": _dist(0.123456),
        "itl": _dist(0.0987654),
        "e2e": _dist(123.456),
        "goodput": {"fraction": 0.4531},
        "throughput": {"requests_s": 19.4712, "output_tokens_s": 12345.6},
        "load": {"requests_max_over_mean": 1.2345, "prefill_max_over_mean": 2.3456},
        "preempted_requests": 4321,
        "reasons": {"affinity": 1010, "load": 2897},
    }


REPORT: dict[str, Any] = {
    "policies": [_policy("round_robin", 0.053), _policy("kv_aware_precise", 0.354)],
    "trace": {
        "describe": "synthetic_trace.jsonl (mooncake, 3993 requests)",
        "bound": {"token_hit_rate": 0.65, "block_hit_rate": 0.659},
        "pooled_bound": {"token_hit_rate": 0.395},
        "ttft_floor": {"p50": 0.0271, "p99": 1.9213},
    },
    "time_scale": 0.2,
    "fleet": {"workers": 8, "num_blocks": 32768},
    "fleet_describe": "8 workers, profile default, 32768 blocks x 16 tokens",
    "keys": "trace",
    "replicas": 1,
    "seed": 0,
    "slo_describe": "TTFT <= 2 s, TPOT <= 0.1 s",
    "machine": {"cpu": "AMD EPYC", "cores": 2},
}


def _render(table: Any, width: int = 100) -> str:
    buf = io.StringIO()
    print_table(Console(file=buf, width=width, color_system=None), table)
    return buf.getvalue()


def _numbers(report: dict[str, Any], wide: bool) -> list[str]:
    """Every cell of the table as the report formats it (policy names aside)."""
    cols = [c for c in simulate.REPORT_COLUMNS if wide or not c[1]][1:]
    return [cell(p) for p in report["policies"] for _, _, cell in cols]


def test_default_table_fits_100_columns_with_every_digit() -> None:
    out = _render(report_table(REPORT))
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 100
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("round_", "kv_aw"))]
    assert len(rows) == 2
    for n in _numbers(REPORT, wide=False):  # whole, on the policy's own line
        assert any(re.search(rf"(?<![\d.]){re.escape(n)}(?![\d.])", r) for r in rows), n
    for header in ("hit rate", "/bound", "goodput", "req/s"):
        assert header in out


def test_wide_table_keeps_every_digit_even_in_a_narrow_terminal() -> None:
    out = _render(report_table(REPORT, wide=True))
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) > 100  # all columns: left to the terminal
    for n in _numbers(REPORT, wide=True):
        assert n in out, n
    assert "out" in out and "1.23/2.35" in out
    assert (
        "6.43" in out and "floor (each request alone, infinite cache) p50 0.027, p99 1.921" in out
    )


def test_a_long_policy_label_folds_instead_of_cutting_numbers() -> None:
    report = {**REPORT, "policies": [_policy("kv_aware[affinity_slack=10;queue=0.4]", 0.35)]}
    out = _render(report_table(report))
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    for n in _numbers(report, wide=False):
        assert n in out, n


def test_compare_console_table_fits_100_columns() -> None:
    res = {
        "completed": 1234, "failed": 5, "not_sent": 0, "hit_rate": 0.3456,
        "median_ttft_ms": 1234.5, "p90_ttft_ms": 23456.7, "p99_ttft_ms": 34567.8,
        "median_tpot_ms": 123.4, "p99_tpot_ms": 234.5, "p99_e2el_ms": 123456.7,
        "request_throughput": 12.34, "request_goodput": 11.1, "worker_balance": 1.23,
    }  # fmt: skip
    predicted = {"hit_rate": 0.351, "ttft": {"p99": 12.345}}
    report = {
        "trace": REPORT["trace"],
        "fleet_describe": "8 simulated workers",
        "slo_describe": "TTFT <= 2 s",
        "seed": 0,
        "targets": [
            {
                "name": "kvgate:kv_aware_precise",
                "status": "ok",
                "result": res,
                "predicted": predicted,
            },
            {"name": "sglang-router", "status": "ok", "result": res, "predicted": None},
            {"name": "smg", "status": "skipped", "reason": "pip", "result": {}},
        ],
    }
    out = _render(console_table(report))
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    for n in ("1234/5", "34.6%", "0.53", "1.234", "34.568", "0.234", "123.457", "35.1% / 12.345"):
        assert n in out, n
    assert "smg" not in out.split("bench.compare")[1].split("\n\n")[0]  # skipped: not a row
    wide = _render(console_table(report, wide=True))
    assert "23.457" in wide and "11.10" in wide and "…" not in wide


# -- default outputs ---------------------------------------------------------------------------


def test_default_outputs_live_in_the_git_ignored_bench_out() -> None:
    assert paths.OUT_DIR == REPO / "bench" / "out"
    probe = paths.out_path("simulate.json").relative_to(REPO)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=REPO)
    assert ignored.returncode == 0
    for default in (spike.DEFAULT_OUT, soak.DEFAULT_OUT, spike.SpikeOptions().out):
        assert default is not None and default.is_relative_to(paths.OUT_DIR)


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Run from an empty working directory, with bench/out/ redirected into tmp_path."""
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(paths, "OUT_DIR", out)
    return cwd, out


def test_simulate_writes_its_report_under_bench_out_by_default(
    elsewhere: tuple[Path, Path],
) -> None:
    cwd, out = elsewhere
    assert simulate.main(["--trace", SYNTH, *SMALL_FLEET, "--policies", "kv_aware", "--quiet"]) == 0
    report = json.loads((out / "simulate.json").read_text())
    assert [p["policy"] for p in report["policies"]] == ["kv_aware"]
    assert os.listdir(cwd) == []  # nothing in the working directory (was the repo root)


def test_capacity_writes_plot_and_probes_under_bench_out_by_default(
    elsewhere: tuple[Path, Path],
) -> None:
    cwd, out = elsewhere
    argv = ["--trace", SYNTH, *SMALL_FLEET, "--policies", "kv_aware", "--jobs", "1"]
    assert capacity.main([*argv, "--iterations", "0", "--max-scale", "2"]) == 0
    assert (out / "capacity.png").stat().st_size > 0
    assert json.loads((out / "capacity.json").read_text())["answers"][0]["policy"] == "kv_aware"
    assert os.listdir(cwd) == []
