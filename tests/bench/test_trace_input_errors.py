"""Traces the bench tools must survive: a block size or request too large to build, Azure times
read in the machine's zone, numbers that overflow, JSON nested too deeply, generator formats
given a file, an unwritable `--out`, and Zipf exponents or turn counts out of range (review of
the bench tools' inputs, fixes 1, 3, 4, 7, 8 and 9).

Each ends in a clean error naming the file/line/field (`TraceError`, or one line and exit 2 from
the CLI), or, for a request too long for the fleet, a refusal counted as vLLM counts it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bench import simulate, traces
from bench.simulate import FleetSpec, PolicySpec, simulate_policy
from bench.traces import Trace, TraceError, TraceRequest, load_trace, read_jsonl
from tests.support.cli import cli_error

REC = {"arrival_s": 0, "request_id": "a", "input_length": 100, "output_length": 5,
       "block_size": 16, "block_ids": [1, 2, 3, 4, 5, 6]}  # fmt: skip


def _write(path: Path, *records: object) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# -- fix 1: a block size or a request too large to build -------------------------------------


def test_an_absurd_block_size_is_a_malformed_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = {**REC, "block_size": 1_000_000_000, "block_ids": []}
    path = _write(tmp_path / "t.jsonl", rec)
    with pytest.raises(TraceError, match=r"t\.jsonl:1: .*block_size must be 1\.\.1048576"):
        read_jsonl(path)
    argv = ["--trace", path, "--workers", "2", "--num-blocks", "512", "--policies", "round_robin"]
    argv += ["--jobs", "1", "--quiet", "--json", str(tmp_path / "o.json")]
    assert "block_size" in cli_error(capsys, simulate.main, argv)


@pytest.mark.parametrize(
    "spec", ["conversation:sessions=3,block_size=1000000000", "synthetic:block_size=1000000000"]
)
def test_a_generator_with_an_absurd_block_size_is_refused(spec: str) -> None:
    with pytest.raises(TraceError, match="block_size must be <= 1048576"):
        load_trace(spec)


def test_a_block_size_at_the_bound_still_builds_its_prompt() -> None:
    bs = traces.MAX_BLOCK_SIZE
    r = TraceRequest(0.0, "a", 10, 1, bs, [7])
    r.validate()
    assert len(traces.prompt_token_ids(r)) == 10


def _spy_prompts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    built: list[int] = []
    real = simulate.prompt_token_ids

    def spy(r: TraceRequest) -> list[int]:
        built.append(r.input_length)
        return real(r)

    monkeypatch.setattr(simulate, "prompt_token_ids", spy)
    return built


@pytest.mark.parametrize("keys", ["trace", "gateway"])
def test_a_request_over_the_context_is_refused_without_building_its_prompt(
    monkeypatch: pytest.MonkeyPatch, keys: str
) -> None:
    built = _spy_prompts(monkeypatch)
    n = 50_000_000  # 8 bytes a token as a list (much more as Python ints): GBs if built
    big = TraceRequest(1.0, "big", n, 4, 512, list(range(-(-n // 512))))
    small = TraceRequest(0.0, "small", 100, 4, 16, [f"s{i}" for i in range(7)])
    trace = Trace([small, big], "t", "kvgate")
    fleet = FleetSpec(workers=2, num_blocks=512, max_model_len=4096)
    out = simulate_policy(trace, PolicySpec.parse("kv_aware"), fleet, keys=keys)
    assert out["failed_by_reason"] == {"context_length": 1}
    assert out["completed"] == 1
    assert max(built) < n  # the refused prompt was never built in full


def test_a_request_over_the_kv_cache_is_refused_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = _spy_prompts(monkeypatch)
    big = TraceRequest(0.0, "big", 20_000, 4, 16, [f"b{i}" for i in range(1250)])
    fleet = FleetSpec(workers=1, num_blocks=64, block_size=16, max_model_len=1 << 20)
    out = simulate_policy(Trace([big], "t", "kvgate"), PolicySpec.parse("round_robin"), fleet)
    assert out["failed_by_reason"] == {"exceeds_kv_cache": 1}
    assert built == []


def test_the_cli_counts_a_too_long_mooncake_request_as_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _spy_prompts(monkeypatch)  # --jobs 1: the run is in this process
    n = 20_000_000
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": n, "output_length": 4, "hash_ids": list(range(n // 512))},
    ]
    path = _write(tmp_path / "mc.jsonl", *rows)
    out = tmp_path / "o.json"
    argv = ["--trace", path, "--workers", "2", "--num-blocks", "512", "--policies", "round_robin"]
    assert simulate.main([*argv, "--jobs", "1", "--quiet", "--json", str(out)]) == 0
    (pol,) = json.loads(out.read_text())["policies"]
    assert pol["failed_by_reason"] == {"context_length": 1}
    assert built and max(built) < n


# -- fix 3: Azure times are UTC ---------------------------------------------------------------


def test_azure_times_do_not_depend_on_the_machine_zone(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"  # 02:00-03:00 on 2023-03-12 does not exist in New York
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-03-12 01:59:59.0,100,10\n"
        "2023-03-12 03:00:01.0,100,10\n"
    )
    old = os.environ.get("TZ")
    durations = []
    try:
        for tz in ("America/New_York", "UTC", "Asia/Kolkata"):
            os.environ["TZ"] = tz
            time.tzset()
            durations.append(load_trace(path).duration_s)
    finally:
        if old is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old
        time.tzset()
    assert durations == [3602.0, 3602.0, 3602.0]


# -- fix 4: overflowing numbers and deep JSON -------------------------------------------------


@pytest.mark.parametrize(
    ("field", "raw"),
    [("input_length", "1e999"), ("output_length", "-1e999"), ("arrival_s", "1" + "0" * 400)],
)
def test_a_kvgate_number_that_overflows_is_a_trace_error(
    tmp_path: Path, field: str, raw: str
) -> None:
    line = json.dumps({**REC, field: 0}).replace(f'"{field}": 0', f'"{field}": {raw}')
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:1: "):
        load_trace(path)


@pytest.mark.parametrize(("field", "raw"), [("input_length", "1e999"), ("timestamp", "9" * 400)])
def test_a_mooncake_number_that_overflows_is_a_trace_error(
    tmp_path: Path, field: str, raw: str
) -> None:
    rec = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}
    line = json.dumps(rec).replace(f'"{field}": {rec[field]}', f'"{field}": {raw}')
    path = tmp_path / "mc.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=r"mc\.jsonl:1: "):
        load_trace(path)
    with pytest.raises(TraceError, match=r"mc\.jsonl:1: "):
        load_trace(path, "mooncake")


@pytest.mark.parametrize(("where", "raw"), [("in", "1e999"), ("t", "1" + "0" * 400)])
def test_a_weka_number_that_overflows_is_a_trace_error(
    tmp_path: Path, where: str, raw: str
) -> None:
    req = {"t": 0, "type": "llm", "in": 100, "out": 5, "hash_ids": [1, 2]}
    text = json.dumps({"id": "s", "block_size": 64, "requests": [req]})
    text = text.replace(f'"{where}": {req[where]}', f'"{where}": {raw}', 1)
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=r"s\.json"):
        load_trace(path, "weka-agentic")


def test_deeply_nested_json_is_a_trace_error(tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    kv = tmp_path / "deep.jsonl"
    kv.write_text('{"arrival_s": ' + deep + "}\n")
    mc = tmp_path / "mc_deep.jsonl"
    mc.write_text('{"timestamp": 0, "hash_ids": ' + deep + "}\n")
    for path, fmt in ((kv, None), (kv, "kvgate"), (mc, None), (mc, "mooncake")):
        with pytest.raises(TraceError, match=path.name):
            load_trace(path, fmt)
    with pytest.raises(TraceError, match=r"deep\.jsonl:1"):
        read_jsonl(kv)
    with pytest.raises(TraceError):
        traces.detect_format(kv)


def test_deeply_nested_weka_sub_agents_are_a_trace_error(tmp_path: Path) -> None:
    leaf = json.dumps({"t": 0, "type": "llm", "in": 100, "out": 5, "hash_ids": [1, 2]})
    depth = 3000
    opens = "".join(
        f'{{"type": "subagent", "t": 0, "agent_id": "{k}", "requests": [' for k in range(depth)
    )
    text = '{"id": "deep", "block_size": 64, "requests": [' + opens + leaf + "]}" * depth + "]}"
    path = tmp_path / "sub_deep.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=r"sub_deep\.json"):
        load_trace(path, "weka-agentic")


# -- fix 7: traces convert --out that cannot be written ---------------------------------------


def test_convert_to_a_directory_or_under_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _write(tmp_path / "t.jsonl", REC)
    line = cli_error(capsys, traces.main, ["convert", src, "--out", str(tmp_path)])
    assert f"--out {tmp_path}" in line
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = cli_error(capsys, traces.main, ["convert", src, "--out", str(blocker / "o.jsonl")])
    assert "--out" in line


# -- fix 8: a generator format given a file ---------------------------------------------------


@pytest.mark.parametrize("fmt", ["synthetic", "conversation"])
def test_a_generator_format_refuses_a_real_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    src = _write(tmp_path / "t.jsonl", REC)
    out = tmp_path / "o.jsonl"
    argv = ["convert", src, "--format", fmt, "--out", str(out)]
    line = cli_error(capsys, traces.main, argv)
    assert f"--format {fmt}" in line and "t.jsonl" in line
    assert not out.exists()
    with pytest.raises(TraceError, match=f"--format {fmt}"):
        load_trace(src, fmt)
    assert load_trace(f"{fmt}:", fmt).requests  # a spec still generates


# -- fix 9: Zipf exponents and turn counts ----------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("conversation:turns_s=-1000,sessions=3", "turns_s"),
        ("conversation:turns_s=1e6,sessions=3", "turns_s"),
        ("conversation:system_s=-500,sessions=3", "system_s"),
        ("conversation:turns_s=nan,sessions=3", "turns_s"),
        ("conversation:max_turns=1000000,sessions=3", "max_turns"),
        ("synthetic:zipf_s=-2000,num_requests=3", "zipf_s"),
        ("synthetic:zipf_s=1e6,num_requests=3", "zipf_s"),
    ],
)
def test_out_of_range_generator_exponents_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, named: str
) -> None:
    with pytest.raises(TraceError, match=named):
        load_trace(spec)
    assert named in cli_error(capsys, traces.main, ["info", spec])


def test_in_range_exponents_still_generate() -> None:
    assert load_trace("conversation:turns_s=-10,sessions=3,max_turns=10000").requests
    assert load_trace("synthetic:zipf_s=10,num_requests=3").requests
