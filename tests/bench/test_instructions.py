from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench import instructions
from bench.instructions import callgrind_total, table, top_functions

# The shape `callgrind_control -d` writes: a `summary: 0` near the top, the count at the end.
DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 4242
cmd:  python -m gateway.cli serve --config kvgate.toml
part: 1

desc: I1 cache:
desc: Timerange: Basic block 208586330 - 230000000
positions: line
events: Ir
summary: 0

fl=(1) ceval.c
fn=(1) _PyEval_EvalFrameDefault
0 5
totals: 770753098
"""

ANNOTATED = """--------------------------------------------------------------------------------
Ir                    file:function
--------------------------------------------------------------------------------
236,755,116 (24.17%)  python-build.222/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault'2 [/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0]
 43,624,200 ( 4.67%)  ???:serde_json::ser::format_escaped_str [/x/smg_rs.abi3.so]

--------------------------------------------------------------------------------
-- User-annotated source: foo
"""


def test_the_count_is_the_dumps_totals_line_not_its_summary() -> None:
    assert callgrind_total(DUMP) == 770_753_098
    with pytest.raises(ValueError, match="totals"):
        callgrind_total("events: Ir\nsummary: 0\n")


def test_top_functions_are_read_from_the_annotation_with_paths_cut() -> None:
    assert top_functions(ANNOTATED, 5) == [
        ("ceval.c:_PyEval_EvalFrameDefault'2", 236_755_116),
        ("serde_json::ser::format_escaped_str", 43_624_200),
    ]
    assert top_functions(ANNOTATED, 1) == [("ceval.c:_PyEval_EvalFrameDefault'2", 236_755_116)]
    assert top_functions("no table here", 3) == []


def test_the_table_gives_each_target_against_kvgate_and_says_why_one_is_missing() -> None:
    report = {
        "targets": [
            {"name": "kvgate", "status": "ok", "requests": 600, "errors": 0, "per_request": 1_200},
            {"name": "smg", "status": "ok", "requests": 600, "errors": 0, "per_request": 1_080},
            {"name": "vllm-router", "status": "not measured: no wheel"},
        ]
    }
    rows = list(zip(*(c.cells for c in table(report).columns), strict=True))
    assert rows[1] == ("smg", "600", "0", "1,080", "0.90")
    assert rows[2][0] == "vllm-router" and "no wheel" in rows[2][3]


def test_without_valgrind_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real = shutil.which
    monkeypatch.setattr(
        instructions.shutil, "which", lambda t: None if t == "valgrind" else real(t)
    )
    assert instructions.main(["--json", str(tmp_path / "i.json")]) == 2
    assert "apt-get install valgrind" in capsys.readouterr().out
    assert not (tmp_path / "i.json").exists()


def test_an_unknown_peer_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(instructions.shutil, "which", lambda t: f"/usr/bin/{t}")
    code = instructions.main(["--peers", "nginx", "--json", str(tmp_path / "i.json")])
    assert code == 2 and "unknown peer(s) nginx" in capsys.readouterr().out
