"""`kvgate bench overhead --processes 1,N`: the layout that keeps an N-process kvgate on cores of
its own, the config such a kvgate needs (Redis quotas, [cluster]), and one tiny real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import overhead
from bench.overhead import (
    core_layout,
    kvgate_default_toml,
    kvgate_target_name,
    parse_processes,
)
from gateway.config import load_settings


def test_one_process_layouts_are_unchanged_by_the_option() -> None:
    for ncpu in (2, 8, 16, 64):
        plain, wide = core_layout(ncpu), core_layout(ncpu, router_cores=1)
        assert (plain.router, plain.fleet, plain.loadgens) == (
            wide.router,
            wide.fleet,
            wide.loadgens,
        )
        assert plain.router_cores(1) == [ncpu - 1]


def test_sixteen_cores_keep_four_router_cores_off_the_fleet_and_the_load() -> None:
    lay = core_layout(16, router_cores=4)
    assert lay.routers == (12, 13, 14, 15) and lay.router == 15
    assert lay.router_cores(4) == [12, 13, 14, 15] and lay.router_cores(1) == [15]
    assert len(lay.fleet) == 6 and len(lay.loadgens) == 6  # 6 workers, 6 load generators
    assert not lay.others & set(lay.routers)
    assert "kvgate xN" in lay.describe() and "shared with" not in lay.describe()


def test_two_cores_two_processes_share_core_0_and_say_so() -> None:
    lay = core_layout(2, router_cores=2)
    assert lay.router_cores(2) == [0, 1] and lay.router_cores(1) == [1]
    assert lay.fleet == (frozenset({0}),) and lay.loadgens == (frozenset({0}),)
    assert "shared with the fleet" in lay.describe()


def test_parse_processes() -> None:
    assert parse_processes(None) == [1] and parse_processes("1,4,4") == [1, 4]
    for bad in ("0", "x", "1,-2"):
        with pytest.raises(ValueError):
            parse_processes(bad)
    assert kvgate_target_name(1) == "kvgate" and kvgate_target_name(4) == "kvgate x4"


def test_the_several_process_config_is_valid_and_shares_through_redis(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text(
        kvgate_default_toml(8000, ["http://127.0.0.1:9"], None, 4, "redis://127.0.0.1:1/0")
    )
    s = load_settings(path)
    assert s.server.processes == 4 and s.quota.backend == "redis" and s.cluster.enabled
    assert s.quota.redis_url == "redis://127.0.0.1:1/0" and not s.tenants
    path.write_text(kvgate_default_toml(8000, ["http://127.0.0.1:9"]))
    assert load_settings(path).server.processes == 1
    with pytest.raises(ValueError):
        kvgate_default_toml(8000, [], None, 2, None)


def test_a_tiny_ladder_with_two_processes(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "o.json", tmp_path / "o.png"
    argv = [
        *("--processes", "2", "--no-direct", "--workers", "1", "--concurrency", "8"),
        *("--seconds", "1", "--warmup", "0.3", "--json", str(out_json), "--png", str(out_png)),
    ]
    assert overhead.main(argv) == 0
    report = json.loads(out_json.read_text())
    assert report["setup"]["processes"] == [2]
    (target,) = report["targets"]
    assert target["name"] == "kvgate x2" and target["processes"] == 2
    assert target["status"] == "ok", target["reason"]
    (row,) = target["levels"]
    assert row["completed"] > 0 and row["errors"] == 0
