"""The simulated worker against recorded vLLM 0.32 behaviour (tests/fixtures/vllm-0.32/): an output
that does not fit the context is clamped, not refused, in the engine every path shares (the HTTP
worker and bench.simulate agree); a client's disconnect moves no `vllm:request_success_total`
sample, not even finished_reason="abort" (review of the simulator, findings 4 and 7)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from bench.compare import scrape
from bench.simulate import FleetSpec, PolicySpec, simulate_policy
from bench.traces import Trace, TraceRequest
from tests.support.sim_workers import run_sim_workers
from workers.sim.engine import Engine, admitted_max_tokens
from workers.sim.engine_types import EngineConfig, SimRequest
from workers.sim.profiles import get_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32"
FAST = get_profile("fast")


def _run(engine: Engine, req: SimRequest) -> tuple[int, str | None]:
    """(tokens generated, finish reason) of a request alone on the engine."""
    engine.add_request(req, 0.0)
    t, n, reason = 0.0, 0, None
    while engine.has_work():
        out = engine.step(t)
        t += out.duration
        for o in out.outputs:
            n += len(o.new_token_ids)
            reason = o.finish_reason or reason
    return n, reason


# -- finding 4: clamp, do not refuse ----------------------------------------------------------


def test_the_engine_clamps_max_tokens_as_the_recorded_vllm_does() -> None:
    usage = json.loads((FIXTURES / "max_tokens_clamped.json").read_text())["usage"]
    prompt, context = usage["prompt_tokens"], usage["total_tokens"]  # 1000 of a 1024 context
    engine = Engine(EngineConfig(num_blocks=256, block_size=16, max_model_len=context), FAST)
    got = _run(engine, SimRequest("a", list(range(1000, 1000 + prompt)), 500))
    assert got == (usage["completion_tokens"], "length")  # 24 tokens, as recorded
    engine.check_consistency()


def test_the_engine_refuses_only_a_prompt_that_leaves_no_room() -> None:
    config = EngineConfig(num_blocks=256, block_size=16, max_model_len=512)
    assert admitted_max_tokens(config, 511, 100) == 1
    for n in (512, 600):  # vLLM: the prompt alone fills or passes the context
        with pytest.raises(ValueError, match="maximum context length is 512"):
            admitted_max_tokens(config, n, 1)
    # A KV cache smaller than the context (vLLM fits max_model_len to it): clamp to the cache,
    # refuse a prompt the cache cannot hold with one output token.
    small = EngineConfig(num_blocks=8, block_size=16, max_model_len=4096)
    assert admitted_max_tokens(small, 100, 1000) == 28
    with pytest.raises(ValueError, match="KV cache"):
        admitted_max_tokens(small, 128, 1)
    assert _run(Engine(small, FAST), SimRequest("b", list(range(1000, 1100)), 1000)) == (
        28,
        "length",
    )


def test_bench_simulate_serves_what_vllm_serves_with_its_output_clamped() -> None:
    r = TraceRequest(0.0, "a", 1000, 500, 16, [f"x:{i}" for i in range(62)])
    r.validate()
    fleet = FleetSpec(workers=1, num_blocks=1024, max_model_len=1200)
    out = simulate_policy(Trace([r], "t", "kvgate"), PolicySpec.parse("round_robin"), fleet)
    assert out["failed"] == 0 and out["completed"] == 1
    assert out["throughput"]["output_tokens_s"] * out["span_s"] == pytest.approx(200)
    (served,) = fleet.servable([r])
    assert served.output_length == 200 and r.output_length == 500  # the trace is not modified


async def test_the_http_worker_and_bench_simulate_agree_on_a_clamped_request() -> None:
    body = {"model": "sim-llama", "prompt": list(range(1000, 2000)), "max_tokens": 500}
    async with (
        run_sim_workers(1, profile="fast", num_blocks=1024, max_model_len=1200) as fleet,
        httpx.AsyncClient(timeout=30.0) as c,
    ):
        r = await c.post(fleet[0] + "/v1/completions", json=body)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"


# -- finding 7: a disconnect is no request_success sample ---------------------------------------


def _success(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _running(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running")


async def test_a_client_disconnect_moves_no_request_success_sample() -> None:
    probe = json.loads((FIXTURES / "abort_probe.json").read_text())
    assert probe["request_success_delta"] == 0.0 == probe["abort_counter_delta"]
    async with run_sim_workers(1, profile="fast", num_blocks=512, block_size=16) as fleet:
        base = fleet[0]
        async with httpx.AsyncClient(timeout=30.0) as c:
            before = _success((await c.get(base + "/metrics")).text)
            body = {"model": "sim-llama", "prompt": "hello " * 20, "max_tokens": 2000,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            async with c.stream("POST", base + "/v1/completions", json=body) as r:
                got = 0
                async for chunk in r.aiter_raw():
                    got += chunk.count(b"data: ")
                    if got >= 2:
                        break
            for _ in range(200):
                text = (await c.get(base + "/metrics")).text
                if _running(text) == 0:
                    break
                await asyncio.sleep(0.05)
            after = _success(text)
            books = (await c.get(base + "/sim/stats")).json()
    assert _running(text) == 0
    assert after == before  # every finished_reason sample, "abort" included, is unchanged
    assert set(after) == {"stop", "length", "abort", "error", "repetition"}  # all pre-created
    # The engine's own books still know the request was aborted (GET /sim/stats, sim-only).
    assert books["finished_by_reason"] == {"abort": 1}


def test_compare_counts_served_requests_from_stop_and_length_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = "\n".join(
        [
            "# TYPE vllm:request_success_total counter",
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0',
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0',
            'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 7.0',
            'vllm:request_success_total{engine="0",finished_reason="error",model_name="m"} 1.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 4.0',
        ]
    )

    class _Resp:
        pass

    resp = _Resp()
    resp.text = text  # type: ignore[attr-defined]
    monkeypatch.setattr(httpx, "get", lambda url, timeout: resp)
    (m,) = scrape(["http://w0"])
    assert m["requests"] == 5.0 and m["hits"] == 4.0
