"""`kvgate bench overhead --ladder` / `--peers`: the core layout for small and big hosts, the
summaries on known samples, a report table that fits 100 columns, and one tiny real run."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from rich.console import Console

from bench import overhead
from bench.overhead import (
    CoreLayout,
    Prompts,
    Samples,
    Shot,
    closed_loop,
    core_layout,
    ladder_table,
    outside_ttft,
    split,
    summarize,
    summary_table,
)
from bench.simulate import print_table
from tests.support.aiohttp_app import serve_aiohttp


def _check_layout(lay: CoreLayout, ncpu: int) -> None:
    """What every layout must hold: the router alone on one real core, everything else on the
    other cores, one core set per process."""
    assert lay.cores == ncpu and 0 <= lay.router < ncpu
    assert lay.fleet and lay.loadgens
    assert all(len(c) == 1 for c in (*lay.fleet, *lay.loadgens))
    others = lay.others
    assert others <= set(range(ncpu))
    if ncpu > 1:
        assert lay.router not in others


def test_two_cores_router_alone_fleet_and_load_share_core_0() -> None:
    lay = core_layout(2)
    _check_layout(lay, 2)
    assert lay.router == 1
    assert lay.fleet == (frozenset({0}),) and lay.loadgens == (frozenset({0}),)
    assert lay.shared
    text = lay.describe()
    assert "share a core" in text and "bottleneck" in text
    # More workers asked for: still all on core 0, one process each.
    assert core_layout(2, workers=3).fleet == (frozenset({0}),) * 3


def test_eight_cores_split_the_spare_cores_between_fleet_and_load() -> None:
    lay = core_layout(8)
    _check_layout(lay, 8)
    assert lay.router == 7 and not lay.shared
    fleet = {c for s in lay.fleet for c in s}
    gens = {c for s in lay.loadgens for c in s}
    assert len(lay.fleet) == 3 and fleet == {0, 1, 2}
    assert gens == {3, 4, 5, 6}
    assert "bottleneck" not in lay.describe()


def test_sixteen_cores_is_the_issue_layout() -> None:
    lay = core_layout(16)
    _check_layout(lay, 16)
    fleet = [next(iter(s)) for s in lay.fleet]
    gens = [next(iter(s)) for s in lay.loadgens]
    assert lay.router == 15 and len(fleet) == 6 and len(gens) == 8
    assert len(set(fleet)) == 6 and not set(fleet) & set(gens)  # one core per worker, disjoint


def test_sixty_four_cores_caps_the_fleet_and_the_load_generators() -> None:
    lay = core_layout(64)
    _check_layout(lay, 64)
    assert lay.router == 63 and len(lay.fleet) == 6 and len(lay.loadgens) == 8
    big = core_layout(64, workers=32)
    _check_layout(big, 64)
    fleet = {c for s in big.fleet for c in s}
    assert len(big.fleet) == 32 and len(fleet) == 32
    assert not fleet & {c for s in big.loadgens for c in s}


def test_more_workers_than_cores_share_the_fleet_cores_and_leave_one_for_load() -> None:
    lay = core_layout(4, workers=6)
    _check_layout(lay, 4)
    fleet = {c for s in lay.fleet for c in s}
    assert len(lay.fleet) == 6 and fleet == {0, 1}
    assert {c for s in lay.loadgens for c in s} == {2}


def test_concurrency_is_split_over_load_generators_without_empty_shares() -> None:
    assert split(16, 8) == [2] * 8
    assert split(1, 8) == [1]
    assert split(10, 4) == [3, 3, 2, 2]
    assert sum(split(1024, 7)) == 1024


def test_prompts_are_unique_from_the_first_character_on_and_the_same_for_every_target() -> None:
    a = Prompts("t0c16g0", 16, 4000)
    ps = [a.next() for _ in range(50)]
    assert all(len(p) == 4000 for p in ps)
    heads = {p[: p.index(":") + 1] for p in ps}
    assert len(heads) == 50  # the unique id comes first: no two share even a short prefix
    b = Prompts("t1c16g0", 16, 4000)  # another target, same level: same bodies, other id
    for p, q in zip(ps, (b.next() for _ in range(50)), strict=True):
        assert p != q and p.split(":", 1)[1] == q.split(":", 1)[1]


def test_summary_uses_nearest_rank_and_counts_completions_in_the_window() -> None:
    s = Samples(ttfb=[i / 1000 for i in range(1, 101)], e2e=[i / 100 for i in range(1, 101)])
    s.completed = 200
    s.error("HTTP 503")
    s.merge(Samples(completed=40, errors=0)).merge(Samples(errors=2, error_kinds={"timeout": 2}))
    row = summarize(s, concurrency=16, seconds=4.0)
    assert row["concurrency"] == 16 and row["completed"] == 240 and row["rps"] == 60.0
    assert row["measured"] == 100
    assert row["errors"] == 3 and row["error_kinds"] == {"HTTP 503": 1, "timeout": 2}
    assert row["ttfb_ms"] == pytest.approx({"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0})
    assert row["e2e_ms"] == pytest.approx({"p50": 500.0, "p90": 900.0, "p99": 990.0, "max": 1e3})
    empty = summarize(Samples(), 1, 1.0)
    assert empty["rps"] == 0.0 and set(empty["ttfb_ms"].values()) == {None}


# -- the closed loop against a scripted server ------------------------------------------------


@contextlib.asynccontextmanager
async def _server(mode: str) -> AsyncIterator[str]:
    """An OpenAI-style stub: `starve` holds the first request of the loop 0.6 s (the two before
    it open the connections; it is sent during the warm-up and ends inside the window), `fail`
    answers 500, `cut` ends streams without [DONE]."""
    seen = 0

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal seen
        seen += 1
        body = await request.json()
        assert body["stream"] is True and len(body["messages"][0]["content"]) == 300
        if mode == "fail":
            return web.json_response({"error": "no"}, status=500)
        if mode == "starve" and seen == 3:
            await asyncio.sleep(0.6)
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b'data: {"choices": []}\n\n')
        if mode != "cut":
            await r.write(b"data: [DONE]\n\n")
        return r

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serve_aiohttp(app) as url:
        yield url


def _shot(url: str) -> Shot:
    return Shot(
        url=url,
        concurrency=2,
        warmup_s=0.2,
        seconds=0.6,
        tag="t",
        seed=0,
        prompt_chars=300,
    )


async def test_a_request_starved_from_the_warm_up_on_is_measured() -> None:
    async with _server("starve") as url:
        s = await closed_loop(_shot(url))
    assert s.errors == 0 and s.completed > 0
    assert max(s.e2e) >= 0.6  # sent before the window opened, ended inside it: it counts
    assert len(s.ttfb) == len(s.e2e) >= s.completed


@pytest.mark.parametrize(
    ("mode", "kind"), [("fail", "HTTP 500"), ("cut", "stream ended without [DONE]")]
)
async def test_failed_requests_are_errors_by_kind_not_completions(mode: str, kind: str) -> None:
    async with _server(mode) as url:
        s = await closed_loop(_shot(url))
    assert s.completed == 0 and not s.e2e
    assert s.errors > 0 and s.error_kinds == {kind: s.errors}


# -- the report --------------------------------------------------------------------------------


def _row(c: int) -> dict[str, Any]:
    """A level with wide numbers (seconds-long tails, thousands of req/s)."""
    return {
        "concurrency": c,
        "rps": 12345.678,
        "errors": 12345,
        "ttfb_ms": {"p50": 1234.5678, "p90": 23456.78, "p99": 34567.89},
        "e2e_ms": {"p50": 4567.891, "p90": 56789.01, "p99": 67890.12},
        "router_cpu": 0.987,
        "router_reads_per_request": 18.26,
        "router_writes_per_request": 17.2,
        "outside_ttft_ms": {"matched": 99, "p50": 1.5, "p99": 456.7, "max": 8765.4},
    }


LEVELS = [1, 16, 64, 256, 1024]
REPORT: dict[str, Any] = {
    "setup": {
        "levels": LEVELS,
        "seconds": 8.0,
        "warmup_s": 2.0,
        "prompt_chars": 4000,
        "max_tokens": 16,
    },
    "layout_describe": core_layout(2).describe(),
    "targets": [
        {"name": n, "version": v, "status": "ok", "levels": [_row(c) for c in LEVELS]}
        for n, v in (
            ("kvgate", "0.1.0"),
            ("sglang-router", "0.3.2"),
            ("vllm-router", "0.1.17"),
            ("smg", "1.13.0"),
            ("direct", None),
        )
    ]
    + [{"name": "gone", "status": "skipped", "reason": "pip", "levels": []}],
}


def _render(table: Any, width: int = 100) -> str:
    buf = io.StringIO()
    print_table(Console(file=buf, width=width, color_system=None), table)
    return buf.getvalue()


def test_ladder_table_fits_100_columns_with_every_digit() -> None:
    out = _render(ladder_table(REPORT))
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    for n in ("12345.7", "1234.6", "34567.9", "4567.9", "67890.1", "12345", "99%", "1024", "0.080"):
        assert re.search(rf"(?<![\d.]){re.escape(n)}(?![\d.])", out), n
    assert "sglang-router 0.3.2" in out and "vllm-router 0.1.17" in out
    assert "23456.8" not in out  # p90: --wide only
    assert "gone" not in out  # skipped targets are listed after the table, not as rows
    assert "bottleneck" in out  # the 2-core caption
    assert "18.3+17.2" not in out  # syscalls per request: --wide only
    assert "8765.4" not in out  # the wait outside kvgate's TTFT: --wide only
    wide = _render(ladder_table(REPORT, wide=True))
    assert "…" not in wide and "23456.8" in wide and "56789.0" in wide and "18.3+17.2" in wide
    assert "8765.4" in wide


def test_outside_ttft_matches_the_client_ttfb_with_the_gateways_request_log() -> None:
    lines = [
        b'{"ts":"x","msg":"request","request_id":"kvg-a","ttft_ms":10.0,"e2e_ms":20.0}',
        b'{"ts":"x","msg":"request","request_id":"kvg-b","ttft_ms":5.0}',
        b'{"ts":"x","msg":"request","request_id":"kvg-c","ttft_ms":null}',  # a whole response
        b"INFO something else",
        b'{"ts":"x","msg":"request","request_id":"kvg-d","ttft_ms": 1.0',  # cut off: skipped
    ]
    ids = [
        ("kvg-a", 0.0125, 0.0),
        ("kvg-b", 1.005, 0.0),
        ("kvg-c", 0.5, 0.0),
        ("kvg-d", 0.1, 0.0),
        ("nope", 9.0, 0.0),
    ]
    out = outside_ttft(ids, lines)
    assert out is not None
    assert out["matched"] == 2
    assert out["p50"] == pytest.approx(2.5) and out["max"] == pytest.approx(1000.0)
    assert "before_head" not in out  # no usable time on these lines: no split, the gap stays
    assert outside_ttft([("nope", 1.0, 0.0)], lines) is None


def test_outside_ttft_says_on_which_side_of_the_gateway_the_time_went() -> None:
    """Sent at t=100.000 s; the head complete at 100.250 (the line's time 100.400 minus its e2e
    of 150 ms): 250 ms in the socket. Then 30 ms in the gateway before the worker had it, 20 ms
    at the worker (TTFT 50 ms), and the client saw the first byte at 100.310: 10 ms on the way
    back."""
    line = (
        b'{"ts":"1970-01-01T00:01:40.400Z","msg":"request","request_id":"kvg-a",'
        b'"ttft_ms":50.0,"sent_ms":30.0,"e2e_ms":150.0}'
    )
    out = outside_ttft([("kvg-a", 0.310, 100.0)], [line])
    assert out is not None and out["matched"] == 1
    assert out["max"] == pytest.approx(260.0)
    assert out["before_head"]["max"] == pytest.approx(250.0)
    assert out["in_gateway"]["max"] == pytest.approx(30.0)
    assert out["worker"]["max"] == pytest.approx(20.0)
    assert out["after_first_write"]["max"] == pytest.approx(10.0)


def test_summary_table_fits_100_columns() -> None:
    out = _render(summary_table(REPORT))
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    assert "12346 / 34567.9" in out
    assert all(f"c={c}" in out for c in LEVELS)


# -- one tiny real run -------------------------------------------------------------------------


def test_a_tiny_ladder_writes_the_json_and_the_plot(tmp_path: Path) -> None:
    """kvgate (default config) and one worker direct, 1 simulated worker, two short levels; an
    unknown peer is reported as skipped and the run goes on."""
    out_json, out_png = tmp_path / "o.json", tmp_path / "o.png"
    argv = [
        *("--peers", "no-such-router", "--workers", "1", "--concurrency", "1,4"),
        *("--seconds", "1", "--warmup", "0.3", "--json", str(out_json), "--png", str(out_png)),
    ]
    assert overhead.main(argv) == 0
    report = json.loads(out_json.read_text())
    assert {"machine", "layout", "setup", "targets", "wall_s"} <= set(report)
    assert report["setup"]["levels"] == [1, 4] and report["setup"]["workers"] == 1
    by = {t["name"]: t for t in report["targets"]}
    assert list(by) == ["kvgate", "no-such-router", "direct"]
    assert by["no-such-router"]["status"] == "skipped"
    assert by["no-such-router"]["reason"] == "unknown peer"
    for name in ("kvgate", "direct"):
        t = by[name]
        assert t["status"] == "ok", t["reason"]
        assert [r["concurrency"] for r in t["levels"]] == [1, 4]
        for r in t["levels"]:
            assert {"rps", "completed", "errors", "error_kinds", "ttfb_ms", "e2e_ms"} <= set(r)
            assert set(r["ttfb_ms"]) == set(r["e2e_ms"]) == {"p50", "p90", "p99", "max"}
            assert r["completed"] > 0 and r["rps"] > 0 and r["errors"] == 0
            assert r["ttfb_ms"]["p50"] <= r["ttfb_ms"]["p99"] <= r["e2e_ms"]["p99"]
            assert r["router_cpu_ms_per_request"] == pytest.approx(
                r["router_cpu"] / r["rps"] * 1000, rel=1e-3
            )
            # Counted by the kernel: a request through kvgate is at least two reads (the
            # client's request, the worker's answer) and two writes (the request upstream, the
            # answer to the client); direct, the worker reads one and writes one at least. The
            # window is sampled by this process's ticks, a few ms off the requests' own: bounds.
            least = 1.5 if name == "kvgate" else 0.8
            assert r["router_reads_per_request"] >= least, r
            assert r["router_writes_per_request"] >= least, r
            # kvgate's request log names each request: the client's TTFB minus the gateway's
            # own TTFT (its clock starts later and stops earlier) is never negative.
            out = r.get("outside_ttft_ms")
            if name == "kvgate":
                assert out is not None and out["matched"] >= r["measured"] // 2, r
                assert 0 <= out["p50"] <= out["p99"] <= out["max"], out
            else:
                assert out is None, r
    assert out_png.stat().st_size > 0
