"""kvgate as a bench target (bench.gateways, `bench.compare --gateways N`): the config each of N
replicas gets, and N real `kvgate serve` processes on one real Redis, fed by one replay that
spreads requests over them."""

from __future__ import annotations

import copy
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from bench.compare import SimFleet, gateways_describe, main, markdown, start_fleet
from bench.gateways import Shared, kv_event_endpoints, kvgate_config, start_kvgates
from bench.metrics import SLO
from bench.redis_server import RedisServer
from bench.replay import ReplayOptions, run_replay
from bench.simulate import PolicySpec
from bench.traces import SyntheticSpec, Trace, synthetic
from gateway.config import Settings

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def _settings(text: str) -> Settings:
    return Settings(**tomllib.loads(text))


def test_one_gateway_keeps_its_plain_config() -> None:
    s = _settings(kvgate_config(PolicySpec.parse("kv_aware"), 8123, URLS))
    assert s.quota.backend == "memory" and not s.cluster.enabled
    assert s.routing.policy == "kv_aware" and not s.routing.token_mode.models
    assert [w.kv_events for w in s.workers] == ["", ""]


def test_replicas_share_quotas_and_cluster_state_under_a_fresh_namespace() -> None:
    a = Shared.fresh("redis://127.0.0.1:7000/0", "kv_aware[queue=0.3]")
    b = Shared.fresh("redis://127.0.0.1:7000/0", "kv_aware[queue=0.3]")
    assert a.namespace != b.namespace and a.namespace.startswith("bench-kv-aware-queue-0-3-")
    spec = PolicySpec.parse("kv_aware[queue=0.3]")
    configs = [_settings(kvgate_config(spec, port, URLS, shared=a)) for port in (8123, 8124)]
    for s in configs:
        assert s.quota.backend == "redis" and s.quota.redis_url == a.redis_url
        assert s.cluster.enabled and s.cluster.redis_url in ("", a.redis_url)
        assert s.quota.key_prefix == f"kvgate:{a.namespace}:"  # no braces: the store refuses them
        assert s.cluster.key_prefix == f"kvgate:{{{a.namespace}}}:"  # one hash slot
        assert s.quota.usage_stream.startswith(s.quota.key_prefix)
        assert s.routing.weights.queue == 0.3 and not s.tenants
    assert [s.server.port for s in configs] == [8123, 8124]
    # --no-cluster: the same replicas sharing quotas only (each learns from its own dispatches)
    alone = Shared.fresh("redis://127.0.0.1:7000/0", "kv_aware", cluster=False)
    s = _settings(kvgate_config(spec, 8125, URLS, shared=alone))
    assert s.quota.backend == "redis" and not s.cluster.enabled


def test_precise_target_routes_kv_aware_on_the_workers_kv_events() -> None:
    spec = PolicySpec.parse("kv_aware_precise")
    kv = kv_event_endpoints(5600, 2)
    assert kv == [
        ("tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"),
        ("tcp://127.0.0.1:5602", "tcp://127.0.0.1:5603"),
    ]
    s = _settings(kvgate_config(spec, 8123, URLS, kv_events=kv))
    assert s.routing.policy == "kv_aware" and s.routing.token_mode.models == {"sim-llama": "sim"}
    assert [(w.kv_events, w.kv_events_replay) for w in s.workers] == kv
    with pytest.raises(ValueError, match="KV-event endpoints"):
        kvgate_config(spec, 8123, URLS)
    argv = SimFleet(workers=2).argv(9000, 5600)
    assert argv[argv.index("--kv-events-port") + 1] == "5600"
    assert "--kv-events-port" not in SimFleet(workers=2).argv(9000)


def test_several_gateways_need_redis(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="redis_url"):
        start_kvgates(PolicySpec.parse("kv_aware"), URLS, tmp_path, "t", gateways=2)
    with pytest.raises(ValueError):
        start_kvgates(PolicySpec.parse("kv_aware"), URLS, tmp_path, "t", gateways=0)


@pytest.mark.parametrize(
    "argv", [["--gateways", "0"], ["--gateways", "2", "--predict-share", "everything"]]
)
def test_compare_rejects_bad_gateway_flags(argv: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2
    assert not list(tmp_path.iterdir())  # refused before starting anything


def test_reports_say_how_many_gateways_ran() -> None:
    one = {"gateways": 1, "prediction": {"replicas": 1, "label": "one gateway"}}
    assert gateways_describe(one) == "1 gateway process; prediction: one gateway"
    four = {"gateways": 4, "prediction": {"replicas": 4, "label": "shared all, 0.1 s late"}}
    text = gateways_describe(four)
    assert text.startswith("4 gateway processes (replicas) on one Redis")
    assert text.endswith("prediction: shared all, 0.1 s late")
    report = {
        "trace": {
            "describe": "t",
            "bound": {"token_hit_rate": 0.6, "block_hit_rate": 0.6},
            "pooled_bound": {"token_hit_rate": 0.5},
        },
        "fleet_describe": "2 simulated workers",
        "replay": {"endpoint": "text", "max_concurrency": 8},
        "slo_describe": "-",
        "seed": 0,
        "machine": {"cpu": "cpu", "cores": 2, "python": "3.11"},
        "wall_s": 1.0,
        "targets": [],
        **four,
    }
    assert f"- kvgate: {text}\n" in markdown(report)
    assert "[cluster] enabled" in text
    before = {**four, "cluster": False, "prediction": {"replicas": 4, "label": "independent"}}
    assert "[cluster] off" in gateways_describe(before)
    legacy = copy.deepcopy(report)
    del legacy["gateways"], legacy["prediction"]  # reports written before --gateways
    assert "- kvgate: 1 gateway process\n" in markdown(legacy)


def _metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=2.0).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_two_gateway_processes_share_one_redis_and_split_the_replay(tmp_path: Path) -> None:
    fleet = SimFleet(
        workers=2, num_blocks=512, profile="fast", gpu_slowdown=1.0, max_model_len=4096
    )
    procs = []
    with RedisServer() as redis:
        try:
            sim, urls, kv = start_fleet(fleet, tmp_path, "t", kv_events=True)
            procs.append(sim)
            gws, bases, shared = start_kvgates(
                PolicySpec.parse("kv_aware_precise"),
                urls,
                tmp_path,
                "t",
                gateways=2,
                kv_events=kv,
                redis_url=redis.url,
            )
            procs += gws
            assert shared is not None and len(set(bases)) == 2
            deadline = time.monotonic() + 20
            while not all(_metric(u, "kvgate_cluster_replicas") == 2.0 for u in bases):
                assert time.monotonic() < deadline, "the replicas never saw each other"
                time.sleep(0.1)
            for u in bases:
                assert _metric(u, 'kvgate_cluster_state{state="ok"}') == 1.0
            spec = SyntheticSpec(
                groups=2, users=2, system_tokens=256, question_tokens=32, output_tokens=4,
                rate=50.0, num_requests=16, block_size=16, seed=1,
            )  # fmt: skip
            opts = ReplayOptions(url=",".join(bases), endpoint="text", request_timeout_s=30)
            res = run_replay(synthetic(spec), opts, SLO(), show_progress=False)
        finally:
            for p in reversed(procs):
                p.stop()
    assert res["completed"] == 16 and res["failed"] == 0
    per = res["per_url"]
    assert list(per) == bases and all(c["ok"] > 0 for c in per.values())
    assert sum(c["ok"] for c in per.values()) == 16


def test_compare_rate_replays_the_sample_at_that_mean_rate() -> None:
    from bench.compare import build_parser, pace, prepare

    def paced(argv: list[str]) -> Trace:
        args = build_parser().parse_args(argv)
        return pace(prepare(args), args, SimFleet(), lambda s: None)[0]

    trace = paced(["--sample", "0.05", "--rate", "3", "--peers", "none"])
    n = len(trace.requests)
    assert n > 50
    assert (n - 1) / trace.duration_s == pytest.approx(3.0, rel=1e-6)
    slow = paced(["--sample", "0.05", "--rate", "0.5"])
    assert [r.request_id for r in slow.requests] == [r.request_id for r in trace.requests]
    assert (n - 1) / slow.duration_s == pytest.approx(0.5, rel=1e-6)
