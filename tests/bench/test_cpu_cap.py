"""`bench overhead --router-cpu`: the cgroup that holds a router to a share of one core.

The cgroup files are plain files under a stand-in root here (the kernel's cgroupfs behaves the
same for what these read and write), so the tests need neither root nor a cgroup mount."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import overhead
from bench.cpu_cap import PERIOD_US, CpuCap, CpuCapError
from bench.peers import start


def _v1(root: Path) -> Path:
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    return root


def _v2(root: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers)
    (root / "cgroup.subtree_control").write_text("")
    return root


def test_v1_sets_a_short_period_and_the_share_of_it(tmp_path: Path) -> None:
    cap = CpuCap.create(0.3, "r", root=_v1(tmp_path))
    assert cap.path == tmp_path / "cpu" / "r"
    assert (cap.path / "cpu.cfs_period_us").read_text() == str(PERIOD_US) == "10000"
    assert (cap.path / "cpu.cfs_quota_us").read_text() == "3000"


def test_v2_enables_the_controller_and_writes_cpu_max(tmp_path: Path) -> None:
    root = _v2(tmp_path)
    cap = CpuCap.create(0.25, "r", root=root)
    assert (root / "cgroup.subtree_control").read_text() == "+cpu"
    assert (cap.path / "cpu.max").read_text() == "2500 10000"


def test_several_processes_get_several_cores_worth(tmp_path: Path) -> None:
    cap = CpuCap.create(0.3 * 4, "r4", root=_v2(tmp_path))
    assert (cap.path / "cpu.max").read_text() == "12000 10000"


def test_a_tiny_share_gets_the_kernels_floor_of_one_ms(tmp_path: Path) -> None:
    cap = CpuCap.create(0.01, "r", root=_v2(tmp_path))
    assert (cap.path / "cpu.max").read_text() == "1000 10000"


@pytest.mark.parametrize("share", [0.0, -0.5, 100.0])
def test_a_share_out_of_range_is_refused(tmp_path: Path, share: float) -> None:
    with pytest.raises(CpuCapError, match="share of one core"):
        CpuCap.create(share, "r", root=_v2(tmp_path))


def test_no_cpu_controller_is_one_line_saying_so(tmp_path: Path) -> None:
    with pytest.raises(CpuCapError, match="cpu controller is not available"):
        CpuCap.create(0.3, "r", root=_v2(tmp_path, "io memory"))
    with pytest.raises(CpuCapError, match="no cgroup v1 cpu controller"):
        CpuCap.create(0.3, "r", root=tmp_path / "nothing")


def test_a_cgroup_that_cannot_be_made_is_an_error_not_an_uncapped_run(tmp_path: Path) -> None:
    root = _v1(tmp_path)
    (root / "cpu" / "r").write_text("a file where the group would go")
    with pytest.raises(CpuCapError, match="cannot make a cgroup"):
        CpuCap.create(0.3, "r", root=root)


def test_a_started_process_joins_before_it_runs(tmp_path: Path) -> None:
    """The child writes its own pid into the group before exec: all of it is held, threads and
    children included, from its first instruction."""
    cap = CpuCap.create(0.5, "r", root=_v2(tmp_path))
    (cap.path / "cgroup.procs").write_text("")
    proc = start("child", [sys.executable, "-c", "pass"], tmp_path / "logs", cap=cap)
    assert proc.popen.wait(timeout=30) == 0
    assert (cap.path / "cgroup.procs").read_text() == str(proc.popen.pid)


def test_a_child_that_cannot_join_does_not_start(tmp_path: Path) -> None:
    cap = CpuCap.create(0.5, "r", root=_v2(tmp_path))  # no cgroup.procs: joining fails
    with pytest.raises(Exception):  # noqa: B017 - subprocess re-raises the child's OSError
        start("child", [sys.executable, "-c", "pass"], tmp_path / "logs", cap=cap)


def test_remove_says_whether_the_group_went(tmp_path: Path) -> None:
    cap = CpuCap.create(0.5, "r", root=_v2(tmp_path))
    assert cap.remove() is False  # not empty (a kernel group with a process in it: EBUSY)
    for f in cap.path.iterdir():
        f.unlink()
    assert cap.remove() is True and not cap.path.exists()
    assert cap.remove() is True  # already gone


def test_overhead_without_a_cgroup_ends_in_one_line_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(share: float, name: str | None = None, root: Path = Path("/")) -> CpuCap:
        raise CpuCapError("/sys/fs/cgroup: no cgroup v1 cpu controller")

    started: list[object] = []
    monkeypatch.setattr(overhead.CpuCap, "create", staticmethod(refuse))
    monkeypatch.setattr(overhead, "start_sim_fleet", lambda *a: started.append(a))
    rc = overhead.main(["--router-cpu", "0.3", "--concurrency", "1", "--no-direct"])
    assert rc == 2 and not started
    assert "--router-cpu: /sys/fs/cgroup: no cgroup v1 cpu controller" in capsys.readouterr().out
