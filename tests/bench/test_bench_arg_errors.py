"""Flags the bench tools must refuse as usage errors (one line, exit 2) before anything starts:
policy weights and routing options out of range or of no such name, compare's fleet flags,
`--goodput` items and the SLO flags (review of the bench tools' inputs, fixes 2, 5 and 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import capacity, compare, replay, simulate, tune
from bench.simulate import PolicySpec
from tests.support.cli import cli_error

REC = {"arrival_s": 0, "request_id": "a", "input_length": 100, "output_length": 5,
       "block_size": 16, "block_ids": [1, 2, 3, 4, 5, 6]}  # fmt: skip


def _trace(tmp_path: Path) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(REC) + "\n")
    return str(p)


def _started(*_a: object, **_k: object) -> None:
    raise AssertionError("the tool started work before refusing its flags")


# -- fix 2: policy weights and options --------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--policies", "kv_aware[affinity_slack=nan]"], "affinity_slack"),
        (["--policies", "kv_aware[affinity_slack=inf]"], "affinity_slack"),
        (["--policies", "kv_aware[affinity_slack=-5]"], "affinity_slack"),
        (["--policies", "kv_aware[queue=-1]"], "queue"),
        (["--policies", "kv_aware", "--weights", "nosuch=1"], "nosuch"),
        (["--policies", "kv_aware", "--weights", "prefix=nan"], "prefix"),
        (["--policies", "kv_aware", "--options", "nosuch=1"], "nosuch"),
        (["--policies", "kv_aware", "--options", "block_chars=0"], "block_chars"),
        (["--policies", "kv_aware", "--options", "sample_size=inf"], "sample_size"),
    ],
)
def test_simulate_refuses_bad_weights_and_options(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    named: str,
) -> None:
    monkeypatch.setattr(simulate, "trace_from_args", _started)
    argv = ["--trace", _trace(tmp_path), "--workers", "1", "--jobs", "1", "--quiet", *flags]
    line = cli_error(capsys, simulate.main, [*argv, "--json", str(tmp_path / "o.json")])
    assert "--policies/--weights/--options" in line
    assert named in line


@pytest.mark.parametrize("text", ["kv_aware[affinity_slack=nan]", "kv_aware[tie_tolerance=-1]"])
def test_policy_spec_check_raises_value_error(text: str) -> None:
    with pytest.raises(ValueError, match=text.split("[")[1].split("=")[0]):
        PolicySpec.parse(text).check()
    with pytest.raises(ValueError, match="nosuch"):
        PolicySpec.parse("kv_aware", {"nosuch": 1.0}).check()
    with pytest.raises(ValueError, match="nosuch"):
        PolicySpec.parse("kv_aware", None, {"nosuch": 1.0}).check()


def test_a_valid_variant_still_checks() -> None:
    spec = PolicySpec.parse("kv_aware[queue=0.4;affinity_slack=2;sample_size=8]").check()
    assert dict(spec.options) == {"affinity_slack": 2.0, "sample_size": 8.0}


def test_compare_refuses_a_bad_option_before_it_starts_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compare, "prepare", _started)
    argv = ["--trace", _trace(tmp_path), "--policies", "kv_aware[affinity_slack=-5]"]
    line = cli_error(capsys, compare.main, [*argv, "--out", str(tmp_path / "cmp")])
    assert "affinity_slack" in line
    assert not (tmp_path / "cmp").exists()


# -- fix 5: compare's fleet flags -------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--workers", "0"),
        ("--workers", "-1"),
        ("--num-blocks", "0"),
        ("--block-size", "0"),
        ("--profile", "bogus"),
        ("--gpu-slowdown", "0"),
        ("--gpu-slowdown", "nan"),
        ("--max-output", "-5"),
    ],
)
def test_compare_refuses_bad_fleet_flags(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flag: str,
    value: str,
) -> None:
    monkeypatch.setattr(compare, "prepare", _started)
    argv = ["--trace", _trace(tmp_path), flag, value, "--out", str(tmp_path / "cmp")]
    line = cli_error(capsys, compare.main, argv)
    assert f"argument {flag}" in line


def test_compare_max_output_zero_is_still_no_cap() -> None:
    args = compare.build_parser().parse_args(["--max-output", "0"])
    assert args.max_output == 0


# -- fix 6: --goodput and the SLO flags -------------------------------------------------------


@pytest.mark.parametrize("item", ["ttft:abc", "ttft", "ttft:nan", "ttft:-1", "nosuch:5", "ttft:"])
def test_replay_and_compare_refuse_a_bad_goodput(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    item: str,
) -> None:
    monkeypatch.setattr(compare, "prepare", _started)
    monkeypatch.setattr(replay, "prepare_trace", _started)
    trace = _trace(tmp_path)
    argv = ["--trace", trace, "--goodput", item, "--out", str(tmp_path / "cmp")]
    assert "argument --goodput" in cli_error(capsys, compare.main, argv)
    argv = ["--url", "http://127.0.0.1:9", "--trace", trace, "--goodput", item]
    assert "argument --goodput" in cli_error(capsys, replay.main, argv)


def test_a_valid_goodput_still_parses() -> None:
    slo = replay.parse_goodput(["ttft:2000", "tpot:100", "e2el:5000"])
    assert (slo.ttft, slo.tpot, slo.e2e) == (2.0, 0.1, 5.0)
    with pytest.raises(ValueError, match="ttft"):
        replay.parse_goodput(["ttft:nan"])


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
@pytest.mark.parametrize("flag", ["--slo-ttft", "--slo-tpot", "--slo-e2e"])
def test_simulate_tune_capacity_refuse_a_bad_slo(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flag: str,
    value: str,
) -> None:
    for mod in (simulate, tune, capacity):
        monkeypatch.setattr(mod, "trace_from_args", _started)
    trace = _trace(tmp_path)
    for main in (simulate.main, tune.main, capacity.main):
        argv = ["--trace", trace, "--workers", "1", f"{flag}={value}"]
        line = cli_error(capsys, main, [*argv, "--json", str(tmp_path / "o.json")])
        assert f"argument {flag}" in line
    argv = ["--trace", trace, "--workers", "1", f"--slo-ttft-p95={value}"]
    line = cli_error(capsys, capacity.main, [*argv, "--json", str(tmp_path / "o.json")])
    assert "argument --slo-ttft-p95" in line
