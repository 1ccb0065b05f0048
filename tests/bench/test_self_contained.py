"""The repository stands alone: no path outside it, the sample traces the docs use are shipped
(with their licences), the documented commands name what exists, and packaging metadata is
current. Each check reads files a fresh clone has, so it fails where a user's clone would."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from bench import compare, paths, sim_speed, simulate
from bench.__main__ import TOOLS
from bench.traces import detect_format, load_trace

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "bench/README.md", "bench/data/traces/README.md")
# Spelled in pieces so this file does not match its own search.
OUTSIDE = ("../" + "shared", "/work/" + "shared", "/work/" + "main")


def _repo_text_files() -> list[Path]:
    """Tracked files plus new ones git does not ignore (what the next commit can contain)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    files = []
    for name in filter(None, out.split("\0")):
        path = REPO / name
        if path.is_file() and b"\0" not in path.read_bytes()[:8192]:
            files.append(path)
    return files


def test_no_file_points_outside_the_repository() -> None:
    files = _repo_text_files()
    assert len(files) > 100 and REPO / "README.md" in files
    hits = []
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()):
            if any(s in line for s in OUTSIDE):
                hits.append(f"{path.relative_to(REPO)}:{n + 1}: {line.strip()}")
    assert hits == []


def test_default_traces_are_shipped_and_load() -> None:
    for default in (simulate.DEFAULT_TRACE, compare.DEFAULT_TRACE, sim_speed.DEFAULT_TRACE):
        assert Path(default) == paths.MOONCAKE_TRACE
    assert paths.MOONCAKE_TRACE.is_relative_to(REPO)
    mooncake = load_trace(paths.MOONCAKE_TRACE)
    assert len(mooncake.requests) == 3993  # the figures in bench/README.md are for this file
    weka = load_trace(paths.WEKA_TRACES)
    assert len(weka.requests) == 104 and weka.requests[0].block_size == 64
    assert detect_format(paths.AZURE_TRACE) == "azure"
    lines = paths.AZURE_TRACE.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("TIMESTAMP,") and len(lines) == 1 + 8819


def test_shipped_traces_are_small_and_licensed() -> None:
    files = [p for p in paths.TRACES_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 3_000_000
    for folder in ("mooncake", "azure", "weka-agentic"):
        licences = list((paths.TRACES_DIR / folder).glob("LICENSE*"))
        assert licences, folder
    note = (paths.TRACES_DIR / "README.md").read_text(encoding="utf-8")
    for word in ("Apache-2.0", "CC-BY-4.0", "Mooncake", "Azure", "Attribution"):
        assert word in note


def _commands(doc: str) -> list[str]:
    """Every shell command in the doc's ```sh/```bash blocks, continuation lines joined."""
    text = (REPO / doc).read_text(encoding="utf-8")
    cmds = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split("  #")[0].strip()
            if cmd and not cmd.startswith("#"):
                cmds.append(cmd)
    return cmds


@pytest.mark.parametrize("doc", DOCS)
def test_documented_bench_commands_name_real_tools_and_files(doc: str) -> None:
    """A pasted command must not need an activated virtualenv (`python -m bench...` does) and
    must name only tools and shipped files that exist."""
    cmds = _commands(doc)
    bench_cmds = [c for c in cmds if "kvgate bench" in c]
    assert bench_cmds, doc
    for cmd in cmds:
        assert not re.search(r"\bpython3? -m bench\b", cmd), cmd
    for cmd in bench_cmds:
        words = shlex.split(cmd.split(";")[-1].split("&&")[-1])
        words = words[words.index("bench") + 1 :]
        assert words[0] in TOOLS, cmd
        for w in words:
            for part in w.split("="):
                if part.startswith("bench/data/"):
                    assert (REPO / part).exists(), cmd


def test_readme_sim_command_matches_the_example_config() -> None:
    """`kvgate sim` as documented must serve exactly the workers config.example.toml lists,
    KV events included: without `--kv-events-port` every worker's event replay times out."""
    sim = [c for c in _commands("README.md") if re.search(r"kvgate sim\b", c)]
    assert len(sim) == 1
    words = shlex.split(sim[0])
    flag = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
    port, n, kv = int(flag["--port"]), int(flag["--workers"]), int(flag["--kv-events-port"])
    config = tomllib.loads((REPO / "config.example.toml").read_text(encoding="utf-8"))
    workers = config["workers"]
    assert len(workers) == n
    for i, w in enumerate(workers):  # kvgate sim: worker i on port+i, PUB kv+2i, replay kv+2i+1
        assert w["url"].endswith(f":{port + i}")
        assert w["kv_events"].endswith(f":{kv + 2 * i}")
        assert w["kv_events_replay"].endswith(f":{kv + 2 * i + 1}")


def test_license_is_an_spdx_string() -> None:
    """A TOML-table licence makes every `pip install` warn (deprecated since setuptools 77)."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert meta["project"]["license"] == "Apache-2.0"
    (req,) = meta["build-system"]["requires"]
    m = re.fullmatch(r"setuptools>=(\d+)", req)
    assert m and int(m.group(1)) >= 77
