"""A simulator that survives any trace and any flag: what the bench tools do with inputs they
cannot use (review of the bench tools' inputs, findings 1-14 and the BOM / line-number notes).

Every bad trace or flag ends the tool with one line on stderr and exit 2 (argparse's usage error,
or `exit_on_trace_error`), never a traceback, a hang, a NaN in a report or a silent substitution;
what is valid still loads as it did.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import capacity, compare, replay, simulate, traces, tune
from bench.capacity import Objective, Search, answer_lines
from bench.simulate import FleetSpec, PolicySpec, simulate_policy
from bench.traces import (
    ConversationSpec,
    SyntheticSpec,
    Trace,
    TraceError,
    TraceNotFoundError,
    TraceRequest,
    chain_keys,
    detect_format,
    load_trace,
    retime_gamma,
    sample,
    scale_time,
    write_jsonl,
)

# A trace the tools load and simulate in well under a second.
TINY = (
    "synthetic:groups=2,users=2,system_tokens=64,question_tokens=16,output_tokens=4,rate=50,"
    "num_requests=6,block_size=16"
)
SIM = ["--workers", "1", "--num-blocks", "512", "--policies", "round_robin", "--jobs", "1"]
URL = "http://127.0.0.1:9"  # nothing listens: a replay that got as far as sending fails fast


def _one_line_exit(run: Callable[[], Any], capsys: pytest.CaptureFixture[str]) -> str:
    """Run a CLI that must refuse its input: exit 2 and one error line on stderr (after
    argparse's usage lines, for a flag), no traceback. Returns the error line."""
    with pytest.raises(SystemExit) as e:
        run()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert "Traceback" not in err, err
    *usage, line = err.splitlines()
    assert ": error: " in line, err
    assert all(u.startswith(("usage:", " ")) for u in usage), err
    return line


def _kv(**kw: Any) -> dict[str, Any]:
    return {
        "arrival_s": 0.0,
        "request_id": "r0",
        "input_length": 128,
        "output_length": 4,
        "block_size": 64,
        "block_ids": [1, 2],
        **kw,
    }


def _write_lines(path: Path, lines: list[str], encoding: str = "utf-8") -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding=encoding)
    return path


def _kv_file(path: Path, *records: dict[str, Any]) -> Path:
    return _write_lines(path, [json.dumps(r) for r in records])


def _mc(t: Any = 0, **kw: Any) -> str:
    row = {"timestamp": t, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2], **kw}
    return json.dumps(row)


_TWO = object()  # _weka_doc's default: two good requests


def _weka_doc(sid: str = "s1", requests: Any = _TWO, **kw: Any) -> dict[str, Any]:
    if requests is _TWO:
        requests = [
            {"t": 0, "in": 128, "out": 5, "hash_ids": [1, 2]},
            {"t": 1, "in": 192, "out": 5, "hash_ids": [1, 2, 3]},
        ]
    return {"id": sid, "block_size": 64, "requests": requests, **kw}


# -- 1: a file named like a generator is a file ----------------------------------------------------


@pytest.mark.parametrize(
    "name", ["conversations.jsonl", "synthetic_trace.jsonl", "conversation", "synthetic"]
)
def test_an_existing_file_named_like_a_generator_is_read_as_a_file(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _kv_file(tmp_path / name, _kv(), _kv(arrival_s=1.0, request_id="r1"))
    assert detect_format(name) == "kvgate"
    trace = load_trace(name)
    assert trace.format.startswith("kvgate") and len(trace.requests) == 2


@pytest.mark.parametrize("name", ["conversations.jsonl", "synthetic_trace.jsonl", "synthetics"])
def test_a_missing_file_named_like_a_generator_is_not_found_not_generated(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TraceNotFoundError, match="trace not found"):
        load_trace(name)


@pytest.mark.parametrize(
    ("spec", "fmt"),
    [
        ("synthetic", "synthetic"),
        ("synthetic:", "synthetic"),
        ("synthetic:num_requests=3", "synthetic"),
        ("conversation:sessions=2", "conversation"),
    ],
)
def test_generator_specs_are_still_specs(spec: str, fmt: str) -> None:
    assert detect_format(spec) == fmt


def test_a_spec_longer_than_a_file_name_is_a_spec() -> None:
    # Telling a spec from a path looks the path up first: a spec of 255+ characters is a file
    # name the system refuses to look up (ENAMETOOLONG), which must not be an OSError.
    spec = "conversation:sessions=2," + ",".join(["seed=1"] * 60)
    assert len(spec) > 300
    assert detect_format(spec) == "conversation"
    assert len(load_trace(spec).requests) > 0
    with pytest.raises(TraceNotFoundError):
        load_trace("x" * 300 + ".jsonl")


def test_traces_info_on_a_file_named_like_a_generator_reads_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `cd bench/data/traces/mooncake && kvgate bench traces info synthetic_trace.jsonl`
    monkeypatch.chdir(tmp_path)
    _kv_file(tmp_path / "synthetic_trace.jsonl", _kv())
    assert traces.main(["info", "synthetic_trace.jsonl"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 1


# -- 2: arrival times are finite numbers -----------------------------------------------------------


@pytest.mark.parametrize("t", ["NaN", "Infinity", "-Infinity", '"nan"', '"inf"', '"-inf"'])
def test_a_kvgate_record_with_a_non_finite_arrival_is_refused_with_its_line(
    t: str, tmp_path: Path
) -> None:
    good = json.dumps(_kv(request_id="r1"))
    bad = json.dumps(_kv()).replace('"arrival_s": 0.0', f'"arrival_s": {t}')
    path = _write_lines(tmp_path / "t.jsonl", [good, bad])
    with pytest.raises(TraceError, match=r"t\.jsonl:2: .*arrival_s"):
        load_trace(path)


@pytest.mark.parametrize("t", ["NaN", "Infinity"])
def test_mooncake_and_weka_non_finite_times_are_refused(t: str, tmp_path: Path) -> None:
    mc = _write_lines(
        tmp_path / "mc.jsonl", [_mc(0), _mc(0).replace('"timestamp": 0', f'"timestamp": {t}')]
    )
    with pytest.raises(TraceError, match=r"mc\.jsonl:2: .*arrival_s"):
        load_trace(mc)
    d = tmp_path / "weka"
    d.mkdir()
    doc = json.dumps(_weka_doc()).replace('"t": 1', f'"t": {t}')
    (d / "a.json").write_text(doc, encoding="utf-8")
    with pytest.raises(TraceError, match="arrival_s"):
        load_trace(d)


@pytest.mark.parametrize(
    "spec",
    [
        "conversation:sessions=3,think_s=nan",
        "conversation:sessions=3,session_rate=nan",
        "conversation:sessions=3,session_rate=inf",
        "conversation:sessions=3,read_s_per_token=inf",
        "synthetic:num_requests=3,rate=nan",
        "synthetic:num_requests=3,rate=inf",
        "synthetic:num_requests=3,zipf_s=nan",
    ],
)
def test_generator_specs_with_non_finite_numbers_are_refused(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(TraceError):
        load_trace(spec)
    err = _one_line_exit(lambda: traces.main(["info", spec]), capsys)
    assert "finite" in err or "> 0" in err


def test_traces_info_never_prints_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write_lines(
        tmp_path / "t.jsonl",
        [json.dumps(_kv()), json.dumps(_kv(request_id="r1")).replace("0.0", "NaN", 1)],
    )
    _one_line_exit(lambda: traces.main(["info", str(path)]), capsys)


def test_replay_refuses_a_non_finite_arrival_before_sending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write_lines(
        tmp_path / "t.jsonl",
        [json.dumps(_kv()), json.dumps(_kv(request_id="r1")).replace("0.0", "NaN", 1)],
    )
    argv = ["--url", URL, "--trace", str(path), "--quiet", "--json", str(tmp_path / "r.json")]
    _one_line_exit(lambda: replay.main(argv), capsys)
    assert not (tmp_path / "r.json").exists()


def test_generated_requests_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever the spec checks miss, a generator's records pass the reader's own validation.
    bad = TraceRequest(math.nan, "x", 64, 1, 16, [1, 2, 3, 4])
    monkeypatch.setattr(traces, "synthetic", lambda spec: Trace([bad], "synthetic", "synthetic"))
    with pytest.raises(TraceError, match="arrival_s"):
        load_trace("synthetic:num_requests=1")


# -- 3: block ids are ints or strings, in a list ---------------------------------------------------


@pytest.mark.parametrize(
    "ids", [[1.5, 2], [None, 2], [{"a": 1}, 2], [[1], [2]], [True, False], "ab", 12, {"a": 1}]
)
def test_block_ids_of_other_types_are_refused(ids: Any, tmp_path: Path) -> None:
    path = _kv_file(tmp_path / "t.jsonl", _kv(block_ids=ids))
    with pytest.raises(TraceError, match=r"t\.jsonl:1: .*block_ids"):
        load_trace(path)


@pytest.mark.parametrize("ids", [[1.5, 2], [None, 2], [[1], [2]], [True, False], "ab"])
def test_mooncake_hash_ids_of_other_types_are_refused(ids: Any, tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "mc.jsonl", [_mc(0, hash_ids=ids)])
    with pytest.raises(TraceError, match=r"mc\.jsonl:1: .*hash_ids"):
        load_trace(path)


def test_integral_float_block_ids_are_ints(tmp_path: Path) -> None:
    path = _kv_file(tmp_path / "t.jsonl", _kv(block_ids=[1.0, 2.0]), _kv(request_id="r1"))
    a, b = load_trace(path).requests
    assert a.block_ids == [1, 2] and all(type(x) is int for x in a.block_ids)
    assert chain_keys(a) == chain_keys(b)  # the same ids as the int ones
    mc = _write_lines(tmp_path / "mc.jsonl", [_mc(0, hash_ids=[1.0, 2.0])])
    assert load_trace(mc).requests[0].block_ids == [1, 2]


def test_block_id_types_are_checked_for_any_record() -> None:
    with pytest.raises(ValueError, match="block_ids"):
        TraceRequest(0.0, "r", 32, 1, 16, [1.5, 2]).validate()  # type: ignore[list-item]


@pytest.mark.parametrize(
    "field", [{"prompt": 5}, {"prompt_token_ids": "a" * 128}, {"prompt_token_ids": [1.5] * 128}]
)
def test_prompts_of_other_types_are_refused(field: dict[str, Any], tmp_path: Path) -> None:
    path = _kv_file(tmp_path / "t.jsonl", _kv(**field))
    with pytest.raises(TraceError, match=r"t\.jsonl:1: .*prompt"):
        load_trace(path)


# -- 4: session ids are strings --------------------------------------------------------------------


@pytest.mark.parametrize(("sid", "want"), [(7, "7"), (7.5, "7.5"), ("s", "s"), (None, None)])
def test_scalar_session_ids_become_strings(sid: Any, want: str | None, tmp_path: Path) -> None:
    path = _kv_file(tmp_path / "t.jsonl", _kv(session_id=sid))
    assert load_trace(path).requests[0].session_id == want


@pytest.mark.parametrize("sid", [[1, 2], {"a": 1}])
def test_list_or_object_session_ids_are_refused(
    sid: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _kv_file(tmp_path / "t.jsonl", _kv(session_id=sid))
    with pytest.raises(TraceError, match=r"t\.jsonl:1: .*session_id"):
        load_trace(path)
    _one_line_exit(lambda: traces.main(["info", str(path)]), capsys)
    argv = ["--trace", str(path), *SIM, "--quiet", "--json", ""]
    _one_line_exit(lambda: simulate.main(argv), capsys)


def test_a_replayed_request_that_raises_is_recorded_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def boom(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(replay, "stream", boom)
    req = TraceRequest(0.0, "r0", 32, 1, 16, [1, 2], session_id=7)  # type: ignore[arg-type]
    rec = replay.RequestRecord("r0", 0.0, url=URL)
    opts = replay.ReplayOptions(url=URL)

    async def go() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            await replay._one(http, req, rec, opts, 0.0)

    asyncio.run(go())
    assert rec.error is not None and "boom" in rec.error and not rec.ok


# -- 5: request ids are unique ---------------------------------------------------------------------


def test_duplicate_request_ids_are_refused_with_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _kv_file(
        tmp_path / "t.jsonl",
        _kv(output_length=50),
        _kv(arrival_s=0.001, output_length=50, block_ids=[3, 4]),
        _kv(arrival_s=0.002, request_id="q"),
    )
    with pytest.raises(TraceError, match=r"t\.jsonl:2: request_id 'r0'"):
        load_trace(path)
    argv = ["--trace", str(path), *SIM, "--quiet", "--json", ""]
    _one_line_exit(lambda: simulate.main(argv), capsys)


def test_weka_subagents_sharing_an_agent_id_are_separate_sessions(tmp_path: Path) -> None:
    sub = [{"t": 0, "in": 128, "out": 50, "hash_ids": [1, 2]}]
    doc = _weka_doc(
        "x",
        [
            {"type": "subagent", "t": 0, "agent_id": "a", "requests": sub},
            {"type": "subagent", "t": 0.001, "agent_id": "a", "requests": sub},
        ],
    )
    path = tmp_path / "a.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    trace = load_trace(path)
    ids = [r.request_id for r in trace.requests]
    assert len(set(ids)) == len(ids) == 2
    assert len({r.session_id for r in trace.requests}) == 2
    assert {r.session_id for r in trace.requests} >= {"x/a"}
    # The overlapping pair once crashed the simulator (KeyError on the shared id).
    out = simulate_policy(trace, PolicySpec.parse("round_robin"), FleetSpec(workers=1))
    assert out["completed"] == 2


def test_weka_files_sharing_an_id_are_separate_sessions(tmp_path: Path) -> None:
    d = tmp_path / "weka"
    d.mkdir()
    for name in ("a.json", "b.json"):
        (d / name).write_text(json.dumps(_weka_doc("s1")), encoding="utf-8")
    trace = load_trace(d)
    ids = [r.request_id for r in trace.requests]
    assert len(set(ids)) == len(ids) == 4
    assert len({r.session_id for r in trace.requests}) == 2


@pytest.mark.parametrize(("notes", "want"), [("one note", ["one note"]), (["a", "b"], ["a", "b"])])
def test_header_notes_are_lines(notes: Any, want: list[str], tmp_path: Path) -> None:
    path = _kv_file(tmp_path / "t.jsonl", {"kvgate_trace": 1, "notes": notes}, _kv())
    assert load_trace(path).notes == want  # a string was once one note per character


def test_header_notes_of_another_type_are_refused(tmp_path: Path) -> None:
    path = _kv_file(tmp_path / "t.jsonl", {"kvgate_trace": 1, "notes": 5}, _kv())
    with pytest.raises(TraceError, match=r"t\.jsonl:1: .*notes"):
        load_trace(path)


# -- 6: a first line longer than 4096 characters ---------------------------------------------------


def test_formats_are_told_from_a_long_first_line(tmp_path: Path) -> None:
    n = 3000  # block ids: a first line of ~20k characters
    kv = _kv_file(tmp_path / "t.jsonl", _kv(input_length=64 * n, block_ids=list(range(n))))
    assert detect_format(kv) == "kvgate" and len(load_trace(kv).requests) == 1
    mc = _write_lines(
        tmp_path / "mc.jsonl", [_mc(0, input_length=512 * n, hash_ids=list(range(n)))]
    )
    assert detect_format(mc) == "mooncake" and len(load_trace(mc).requests) == 1


# -- 7: malformed Azure rows and odd weka files ----------------------------------------------------


def test_an_azure_row_with_too_few_columns_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write_lines(
        tmp_path / "az.csv",
        [
            "TIMESTAMP,ContextTokens,GeneratedTokens",
            "2023-11-16 18:17:03.9799600,4808,10",
            "2023-11-16 18:17:04.0000000,4808",
        ],
    )
    with pytest.raises(TraceError, match=r"az\.csv:3: .*3 columns"):
        load_trace(path)
    _one_line_exit(lambda: traces.main(["info", str(path)]), capsys)


@pytest.mark.parametrize(
    "doc",
    [
        [1, 2],
        _weka_doc(requests=[5]),
        _weka_doc(requests=None),
        _weka_doc(requests={"t": 0}),
        _weka_doc(requests=[{"type": "subagent", "t": 1, "agent_id": "a", "requests": None}]),
        _weka_doc(requests=[{"type": "subagent", "t": 1, "agent_id": "a", "requests": [7]}]),
        _weka_doc(requests=[{"t": 0, "in": 128, "out": 5, "hash_ids": "ab"}]),
        _weka_doc(requests=[{"t": 0, "in": 128, "out": 5, "hash_ids": [[1], 2]}]),
    ],
)
def test_odd_weka_files_are_one_line_naming_the_file(
    doc: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "weka"
    d.mkdir()
    (d / "a.json").write_text(json.dumps(doc), encoding="utf-8")
    (d / "b.json").write_text(json.dumps(_weka_doc("s2")), encoding="utf-8")
    with pytest.raises(TraceError, match=r"a\.json"):
        load_trace(d)
    _one_line_exit(lambda: traces.main(["info", str(d)]), capsys)


def test_a_weka_directory_skips_dotfiles_and_directories(tmp_path: Path) -> None:
    d = tmp_path / "weka"
    d.mkdir()
    (d / "._b.json").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS resource fork
    (d / ".a.json").write_text("garbage", encoding="utf-8")
    (d / "sub.json").mkdir()
    (d / "b.json").write_text(json.dumps(_weka_doc()), encoding="utf-8")
    assert detect_format(d) == "weka-agentic"
    assert len(load_trace(d).requests) == 2
    only_odd = tmp_path / "odd"
    only_odd.mkdir()
    (only_odd / "a.json").mkdir()
    (only_odd / "._a.json").write_text("x", encoding="utf-8")
    with pytest.raises(TraceError, match="without"):
        load_trace(only_odd)


@pytest.mark.parametrize(
    "error", [IndexError("list index"), AttributeError("no get"), OSError(5, "I/O error")]
)
def test_any_converter_error_is_a_trace_error_naming_the_file(
    error: Exception, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _kv_file(tmp_path / "t.jsonl", _kv())

    def fail(*_a: Any, **_k: Any) -> Trace:
        raise error

    monkeypatch.setattr(traces, "read_jsonl", fail)
    with pytest.raises(TraceError, match=r"t\.jsonl"):
        load_trace(path)


# -- 8 and 9: generator specs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "synthetic:groups=0",
        "synthetic:users=0",
        "synthetic:num_requests=0",
        "synthetic:block_size=0,num_requests=3",
        "synthetic:rate=0,num_requests=3",
        "synthetic:rate=-1,num_requests=3",
        "synthetic:system_tokens=-1,num_requests=3",
        "synthetic:question_tokens=-1,num_requests=3",
        "synthetic:output_tokens=-5,num_requests=3",
        "synthetic:system_tokens=0,question_tokens=0,num_requests=3",
        "conversation:sessions=3,user_tokens=0",
        "conversation:sessions=3,system_tokens=0,user_tokens=0",
        "conversation:sessions=3,system_tokens=-1",
        "conversation:sessions=3,output_tokens=-1",
        "conversation:sessions=3,max_input=0",
        "conversation:sessions=3,max_input=100",  # no first turn fits: no request at all
        "conversation:sessions=3,think_s=-1",
        "conversation:sessions=3,read_s_per_token=-1",
    ],
)
def test_generator_specs_that_cannot_make_a_trace_are_one_line(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(TraceError):
        load_trace(spec)
    _one_line_exit(lambda: traces.main(["info", spec]), capsys)


def test_spec_parsers_check_their_ranges() -> None:
    with pytest.raises(ValueError, match="groups"):
        SyntheticSpec.parse("synthetic:groups=0")
    with pytest.raises(ValueError, match="user_tokens"):
        ConversationSpec.parse("conversation:user_tokens=0")
    assert SyntheticSpec.parse("synthetic:system_tokens=0,question_tokens=5").system_tokens == 0
    assert ConversationSpec.parse("conversation:read_s_per_token=0,think_s=0").think_s == 0.0


# -- 10 and 11: flags ------------------------------------------------------------------------------


def _sim(*flags: str) -> list[str]:
    return ["--trace", TINY, *SIM, "--quiet", "--json", "", *flags]


@pytest.mark.parametrize(
    "flags",
    [
        ["--workers", "0"],
        ["--workers", "-1"],
        ["--num-blocks", "0"],
        ["--block-size", "0"],
        ["--max-num-seqs", "0"],
        ["--max-num-batched-tokens", "0"],
        ["--max-model-len", "0"],
        ["--profile", "bogus"],
        ["--profile-scale", "0"],
        ["--profile-scale", "-1"],
        ["--profile-scale", "nan"],
        ["--rate-scale", "0"],
        ["--rate-scale", "-1"],
        ["--rate-scale", "inf"],
        ["--rate-scale", "nan"],
        ["--time-scale", "0"],
        ["--time-scale", "-2"],
        ["--time-scale", "inf"],
        ["--time-scale", "1", "--rate-scale", "0"],
        ["--sample", "inf"],
        ["--sample", "0"],
        ["--sample", "-1"],
        ["--sample", "nan"],
        ["--limit", "-1"],
        ["--limit", "0"],
    ],
)
def test_simulate_refuses_bad_flags_in_one_line(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _one_line_exit(lambda: simulate.main(_sim(*flags)), capsys)
    assert flags[-2] in err  # names the flag


@pytest.mark.parametrize(
    "flags",
    [
        ["--workers", "0"],
        ["--profile-scale", "0"],
        ["--rate-scale", "inf"],
        ["--rate-scale", "nan"],
        ["--sample", "0"],
    ],
)
def test_tune_refuses_bad_flags_in_one_line(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--trace", TINY, "--workers", "1", "--trials", "2", "--jobs", "1", "--quiet"]
    _one_line_exit(lambda: tune.main([*argv, "--json", "", "--png", "", *flags]), capsys)


@pytest.mark.parametrize(
    "flags",
    [
        ["--sample", "-1"],
        ["--sample", "inf"],
        ["--time-scale", "-1"],
        ["--time-scale", "0"],
        ["--time-scale", "nan"],
        ["--rate", "-1"],
        ["--rate", "0"],
        ["--rate", "inf"],
        ["--rate", "5", "--burstiness", "0"],
        ["--rate", "5", "--burstiness", "nan"],
        ["--load", "1", "--capacity", "0"],
        ["--load", "inf", "--capacity", "1"],
        ["--num-requests", "-2"],
        ["--num-requests", "0"],
        ["--limit", "-1"],
    ],
)
def test_replay_refuses_bad_flags_in_one_line(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", URL, "--trace", TINY, "--quiet", "--json", str(tmp_path / "r.json")]
    _one_line_exit(lambda: replay.main([*argv, *flags]), capsys)
    assert not (tmp_path / "r.json").exists()  # refused before any request


@pytest.mark.parametrize(
    "flags",
    [["--sample", "-1"], ["--sample", "inf"], ["--time-scale", "0"], ["--time-scale", "nan"]],
)
def test_traces_convert_refuses_bad_flags_in_one_line(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.jsonl"
    _one_line_exit(lambda: traces.main(["convert", TINY, "--out", str(out), *flags]), capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    "flags",
    [["--sample", "inf"], ["--sample", "-1"], ["--time-scale", "0"], ["--rate", "nan"]],
)
def test_compare_refuses_bad_trace_flags_in_one_line(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--trace", TINY, "--peers", "none", "--out", str(tmp_path / "c"), *flags]
    _one_line_exit(lambda: compare.main(argv), capsys)
    assert not (tmp_path / "c").exists()  # refused before anything ran


def test_capacity_refuses_bad_flags_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--trace", TINY, *SIM, "--json", "", "--png", ""]
    for flags in (["--workers", "0"], ["--max-scale", "0"], ["--sample", "inf"]):
        _one_line_exit(lambda f=flags: capacity.main([*argv, *f]), capsys)


def test_the_transforms_refuse_non_finite_amounts() -> None:
    trace = load_trace(TINY)
    for bad in (math.inf, math.nan, 0.0, -1.0):
        with pytest.raises(ValueError):
            sample(trace, bad)
        with pytest.raises(ValueError):
            scale_time(trace, bad)
        with pytest.raises(ValueError):
            retime_gamma(trace, bad)
        with pytest.raises(ValueError):
            retime_gamma(trace, 5.0, bad)


def test_a_valid_limit_sample_and_scale_still_apply(tmp_path: Path) -> None:
    argv = _sim("--limit", "4", "--sample", "3", "--sample-by", "request", "--rate-scale", "2")
    out = tmp_path / "s.json"
    argv[argv.index("--json") + 1] = str(out)
    assert simulate.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["trace"]["requests"] == 3 and report["time_scale"] == 0.5


# -- 12: tune --validate is checked before the search ----------------------------------------------


@pytest.mark.parametrize("which", ["missing", "empty", "malformed", "header-only"])
def test_tune_checks_its_validation_trace_before_searching(
    which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_search(*_a: Any, **_k: Any) -> None:
        raise AssertionError("searched before checking --validate")

    monkeypatch.setattr(tune, "search", no_search)
    path = tmp_path / "v.jsonl"
    if which == "empty":
        path.write_text("", encoding="utf-8")
    elif which == "malformed":
        path.write_text('{"arrival_s": 0, "request_id": "r"}\n', encoding="utf-8")
    elif which == "header-only":
        write_jsonl(path, Trace([], "x", "kvgate"))
    argv = ["--trace", TINY, "--workers", "1", "--trials", "2", "--jobs", "1", "--quiet"]
    argv += ["--json", "", "--png", "", "--validate", str(path)]
    err = _one_line_exit(lambda: tune.main(argv), capsys)
    assert "v.jsonl" in err


# -- 13: capacity at the search ceiling is a lower bound -------------------------------------------


def test_capacity_at_the_ceiling_says_at_least() -> None:
    s = Search(PolicySpec.parse("kv_aware"))
    for scale in (1.0, 2.0, 4.0):
        s.record(scale, {}, True)
    assert s.next_scale(4, 2.0) is None  # the search stops at --max-scale 4
    (line,) = answer_lines([s], [Objective("ttft", "p95", 2.0)], 10.0, 2)
    assert "at least 40.0 req/s" in line and "--max-scale" in line
    bracketed = Search(PolicySpec.parse("round_robin"))
    bracketed.record(1.0, {}, True)
    bracketed.record(2.0, {}, False)
    (line,) = answer_lines([bracketed], [Objective("ttft", "p95", 2.0)], 10.0, 2)
    assert "at least" not in line and "10.0 req/s" in line


def test_capacity_json_flags_a_ceiling_answer(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    argv = ["--trace", TINY, *SIM, "--iterations", "0", "--max-scale", "2"]
    assert capacity.main([*argv, "--json", str(out), "--png", str(tmp_path / "c.png")]) == 0
    report = json.loads(out.read_text())
    (answer,) = report["answers"]
    assert answer["at_least"] is True and answer["rate_scale"] == 2.0
    assert "at least" in report["lines"][0]


# -- 14: /bound over 1 is explained ----------------------------------------------------------------


def test_the_caption_says_when_the_bound_is_counted_in_larger_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = TINY.replace("block_size=16", "block_size=64")
    json_out = ["--json", str(tmp_path / "s.json")]
    assert simulate.main(["--trace", spec, *SIM, "--quiet", *json_out]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "64-token trace blocks" in out
    assert simulate.main(["--trace", TINY, *SIM, "--quiet", *json_out]) == 0
    assert "-token trace blocks" not in " ".join(capsys.readouterr().out.split())


# -- low: byte-order marks and line numbers --------------------------------------------------------


def test_a_utf8_bom_is_accepted_in_every_format(tmp_path: Path) -> None:
    kv = _kv_file(tmp_path / "kv.jsonl", _kv())
    kv.write_text(kv.read_text(encoding="utf-8"), encoding="utf-8-sig")
    assert len(load_trace(kv).requests) == 1
    mc = _write_lines(tmp_path / "mc.jsonl", [_mc(0), _mc(100)], encoding="utf-8-sig")
    assert len(load_trace(mc).requests) == 2
    az = _write_lines(
        tmp_path / "az.csv",
        ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:17:03.9799600,4808,10"],
        encoding="utf-8-sig",
    )
    assert len(load_trace(az).requests) == 1
    d = tmp_path / "weka"
    d.mkdir()
    (d / "a.json").write_text(json.dumps(_weka_doc()), encoding="utf-8-sig")
    assert len(load_trace(d).requests) == 2
    assert len(load_trace(d / "a.json").requests) == 2


def test_a_malformed_mooncake_line_names_its_line(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "mc.jsonl", [_mc(0), _mc(1), "{oops"])
    with pytest.raises(TraceError, match=r"mc\.jsonl:3: "):
        load_trace(path)
    missing = _write_lines(
        tmp_path / "m2.jsonl", [_mc(0), json.dumps({"timestamp": 1, "hash_ids": []})]
    )
    with pytest.raises(TraceError, match=r"m2\.jsonl:2: .*input_length"):
        load_trace(missing)
